//! systemd's side of the fd store and readiness, for the tests of
//! `hugemem serve --fd-store` (systemd itself cannot run here: see
//! docs/operations.md, "Testing the unit"): a datagram socket named by
//! `NOTIFY_SOCKET` receives `FDSTORE=1` / `FDSTOREREMOVE=1` messages with
//! `FDNAME=` and their fds (`SCM_RIGHTS`), keeps them by name as systemd
//! does, and passes them back to the next start as `LISTEN_FDS` /
//! `LISTEN_FDNAMES` / `LISTEN_PID` on fds 3 and up.

use std::collections::BTreeMap;
use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use crate::process::ServeProcess as Daemon;

/// systemd's side: the notify socket and the fd store.
pub struct FakeSystemd {
    path: PathBuf,
    store: Arc<Mutex<BTreeMap<String, OwnedFd>>>,
    ready: Arc<Mutex<u32>>,
}

impl FakeSystemd {
    /// A notify socket in `dir`, served by a thread of its own.
    pub fn new(dir: &Path) -> Self {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).expect("notify socket");
        let store: Arc<Mutex<BTreeMap<String, OwnedFd>>> = Arc::default();
        let ready: Arc<Mutex<u32>> = Arc::default();
        let (st, rd) = (Arc::clone(&store), Arc::clone(&ready));
        std::thread::spawn(move || loop {
            let mut buf = vec![0u8; 4096];
            let mut cmsg = nix::cmsg_space!([RawFd; 253]);
            let mut iov = [IoSliceMut::new(&mut buf)];
            let Ok(msg) = nix::sys::socket::recvmsg::<()>(
                sock.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
            ) else {
                return;
            };
            let mut fds = Vec::new();
            if let Ok(cmsgs) = msg.cmsgs() {
                for c in cmsgs {
                    if let nix::sys::socket::ControlMessageOwned::ScmRights(r) = c {
                        // SAFETY: the kernel installed these fds for us.
                        fds.extend(r.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
                    }
                }
            }
            let n = msg.bytes;
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            let lines: Vec<&str> = text.lines().collect();
            let name = lines
                .iter()
                .find_map(|l| l.strip_prefix("FDNAME="))
                .unwrap_or("stored")
                .to_string();
            if lines.contains(&"FDSTORE=1") {
                if let Some(fd) = fds.pop() {
                    st.lock().expect("store").insert(name, fd);
                }
            } else if lines.contains(&"FDSTOREREMOVE=1") {
                st.lock().expect("store").remove(&name);
            }
            if lines.contains(&"READY=1") {
                *rd.lock().expect("ready") += 1;
            }
        });
        Self { path, store, ready }
    }

    /// The names of the fds in the store.
    pub fn names(&self) -> Vec<String> {
        self.store.lock().expect("store").keys().cloned().collect()
    }

    /// How many `READY=1` came.
    pub fn ready_count(&self) -> u32 {
        *self.ready.lock().expect("ready")
    }

    /// Drops every stored fd, as `systemctl stop` does (the next start
    /// gets none).
    pub fn drop_store(&self) {
        self.store.lock().expect("store").clear();
    }

    /// A duplicate of the stored fd `name`.
    pub fn stored(&self, name: &str) -> Option<OwnedFd> {
        let store = self.store.lock().expect("store");
        store.get(name).and_then(|fd| fd.try_clone().ok())
    }

    /// Starts `hugemem serve --fd-store` (the binary `hugemem`) as systemd
    /// would: the stored fds on 3.., `LISTEN_FDS`, `LISTEN_FDNAMES`,
    /// `LISTEN_PID`.
    pub fn start(&self, hugemem: &Path, socket: &Path, config: &Path) -> Daemon {
        let store = self.store.lock().expect("store");
        // Duplicates above anything the child has, so the dup2s onto 3..
        // never overwrite a source.
        let sources: Vec<RawFd> = store
            .values()
            // SAFETY: F_DUPFD_CLOEXEC of an open fd; the result is ours.
            .map(|fd| unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 500) })
            .collect();
        assert!(sources.iter().all(|f| *f >= 500), "dup");
        let names: Vec<String> = store.keys().cloned().collect();
        drop(store);
        let mut cmd = Command::new("/bin/sh");
        let script = if sources.is_empty() {
            "exec \"$0\" \"$@\"".to_string()
        } else {
            format!(
                "LISTEN_PID=$$ LISTEN_FDS={} LISTEN_FDNAMES={} exec \"$0\" \"$@\"",
                sources.len(),
                names.join(":")
            )
        };
        cmd.arg("-c")
            .arg(script)
            .arg(hugemem)
            .args(["serve", "--fd-store", "--config"])
            .arg(config)
            .arg("--socket")
            .arg(socket)
            .env("NOTIFY_SOCKET", &self.path)
            .env_remove("LISTEN_PID")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_FDNAMES")
            .stdin(Stdio::null());
        let srcs = sources.clone();
        // SAFETY: the closure runs between fork and exec and only calls
        // `onto_fds` (dup2, async-signal-safe, no allocation).
        unsafe {
            cmd.pre_exec(move || onto_fds(&srcs));
        }
        let child = cmd.spawn().expect("spawn hugemem serve");
        for s in sources {
            // SAFETY: our duplicate, no longer needed once the child has it.
            unsafe { libc::close(s) };
        }
        Daemon(child)
    }
}

/// Puts `sources` on fds 3.. of the child, inherited across exec. Runs
/// between fork and exec.
fn onto_fds(sources: &[RawFd]) -> std::io::Result<()> {
    for (i, src) in sources.iter().enumerate() {
        // SAFETY: dup2 of an open descriptor (all sources are above any
        // target: duplicated from 500 up) onto 3 + i; what was there in the
        // child is nothing it uses (it execs right after).
        if unsafe { libc::dup2(*src, 3 + i as RawFd) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
