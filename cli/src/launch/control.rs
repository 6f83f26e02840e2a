//! The launcher's control socket, through which `hugemem update` asks a
//! running `hugemem launch` to update its QEMU (`update/` does the work).
//!
//! The socket is created by the launcher (mode 0600, in a directory of mode
//! 0700 when the launcher creates that too, and only in a directory no other
//! uid can write: `control_dir`) and removed when it exits, if the path
//! still names the socket it bound. A peer must have the launcher's uid or
//! be root (`SO_PEERCRED`); `hugemem update` checks the same of the listener
//! before it sends anything. One request per connection, one JSON line each
//! way:
//!
//! ```text
//! → {"update":{"qemu":"/usr/local/bin/qemu-system-x86_64"}}   (qemu: null = the same binary)
//! ← {"ok":{…UpdateReport…}}  or  {"error":"…"}
//! → {"park":{"name":"vm1"}}                                   (QEMU: `hugemem park NAME`)
//! ← {"parked":{…ParkReport…}}  or  {"error":"…"}
//! ```
//!
//! The launcher serves requests one at a time from the thread that waits
//! for the VMM; a request that does not arrive within [`REQUEST_WAIT`] is
//! dropped, so a peer that connects and says nothing cannot stall it.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::control_dir::{check_socket_dir, SocketDirError};
use super::process::{Spawner, Supervisor};
use super::update::{ParkReport, Reply, Request, UpdateReport, Updater};

/// How long the launcher waits for a connected peer's request line.
pub const REQUEST_WAIT: Duration = Duration::from_secs(5);

/// Errors of the control socket, both ends.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// A name that cannot be a file name.
    #[error(
        "invalid VM name {0:?}: use letters, digits, '.', '_' and '-' (not starting with '.')"
    )]
    Name(String),
    /// Creating, binding or connecting failed.
    #[error("control socket {path}: {source}")]
    Socket {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The exchange failed.
    #[error("control socket {path}: {what}")]
    Exchange {
        /// The socket.
        path: PathBuf,
        /// What happened.
        what: String,
    },
    /// The launcher refused or failed the update.
    #[error("the update failed: {0}")]
    Failed(String),
    /// The launcher refused or failed the park.
    #[error("the park failed: {0}")]
    ParkFailed(String),
    /// The socket's directory would let another uid take the socket.
    #[error(transparent)]
    Dir(#[from] SocketDirError),
    /// The process listening on the socket is neither of the caller's uid
    /// nor root's: not the caller's launch.
    #[error(
        "control socket {path}: the process listening on it runs as uid {peer_uid} (pid \
         {peer_pid}), not as you (uid {own_uid}) or root, so it is no launch of yours; \
         nothing was sent to it (run `hugemem update` as the user that launched the VM)"
    )]
    NotOurs {
        /// The socket.
        path: PathBuf,
        /// The listener's uid.
        peer_uid: u32,
        /// The listener's pid (when it listened).
        peer_pid: i32,
        /// The caller's effective uid.
        own_uid: u32,
    },
}

/// Where a launch named `name` puts its control socket:
/// `$XDG_RUNTIME_DIR/hugemem/vm/NAME.sock`, or `/run/hugemem/vm/NAME.sock`
/// when `XDG_RUNTIME_DIR` is unset.
///
/// # Errors
///
/// [`ControlError::Name`] for a name that is not a plain file name.
pub fn control_socket_path(name: &str) -> Result<PathBuf, ControlError> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !ok {
        return Err(ControlError::Name(name.to_owned()));
    }
    let runtime = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run"));
    Ok(runtime
        .join("hugemem")
        .join("vm")
        .join(format!("{name}.sock")))
}

/// The listening control socket; removes its file when dropped, if the
/// path still names the file it bound.
#[derive(Debug)]
pub(crate) struct ControlSocket {
    listener: UnixListener,
    path: PathBuf,
    /// The socket file's device and inode, right after the bind.
    bound: (u64, u64),
}

impl ControlSocket {
    /// Binds `path` (mode 0600), in a directory no other uid can write
    /// (`control_dir`; created, mode 0700, when missing). A stale socket file
    /// nobody listens on is replaced; one a live launcher listens on is an
    /// error.
    pub(crate) fn bind(path: &Path) -> Result<Self, ControlError> {
        let err = |source| ControlError::Socket {
            path: path.to_owned(),
            source,
        };
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
        check_socket_dir(dir, nix::unistd::geteuid().as_raw())?;
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "another launch listens on it (choose another --name)",
                )));
            }
            std::fs::remove_file(path).map_err(err)?;
        }
        let listener = UnixListener::bind(path).map_err(err)?;
        // No other uid can write the directory, so this is the file just bound.
        let file = std::fs::symlink_metadata(path).map_err(err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
        listener.set_nonblocking(true).map_err(err)?;
        Ok(Self {
            listener,
            path: path.to_owned(),
            bound: (file.dev(), file.ino()),
        })
    }

    /// The listening socket (readable when a peer connects).
    pub(crate) fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// The socket file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts one peer of our uid (or root) and reads its request; `None`
    /// when there was none, or it was refused or unreadable (logged).
    pub(crate) fn accept(&self) -> Option<(UnixStream, Request)> {
        let (stream, _) = self.listener.accept().ok()?;
        let uid = nix::unistd::geteuid().as_raw();
        match getsockopt(&stream, PeerCredentials) {
            Ok(cred) if cred.uid() == uid || cred.uid() == 0 => {}
            Ok(cred) => {
                tracing::warn!(
                    peer_uid = cred.uid(),
                    "control socket: peer of another uid refused"
                );
                let _ = reply(
                    stream,
                    &Reply::Error("refused: not the launcher's uid".into()),
                );
                return None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "control socket: no peer credentials");
                return None;
            }
        }
        let read = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(REQUEST_WAIT)));
        if let Err(e) = read {
            tracing::warn!(error = %e, "control socket: cannot set up the connection");
            return None;
        }
        let mut line = String::new();
        let mut reader = BufReader::new(std::io::Read::take(&stream, 4096));
        if let Err(e) = reader.read_line(&mut line) {
            tracing::warn!(error = %e, "control socket: no request");
            return None;
        }
        match serde_json::from_str(&line) {
            Ok(request) => Some((stream, request)),
            Err(e) => {
                let _ = reply(stream, &Reply::Error(format!("bad request: {e}")));
                None
            }
        }
    }
}

impl Drop for ControlSocket {
    /// Removes the socket file, unless the path names another file now (one
    /// that replaced ours is not ours to remove). A replacement between the
    /// stat and the unlink would still be removed; only root and the
    /// launcher's own uid can write the directory (`control_dir`), so only
    /// they could race it.
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(now) if (now.dev(), now.ino()) == self.bound => {
                let _ = std::fs::remove_file(&self.path);
            }
            Ok(_) => tracing::warn!(
                path = %self.path.display(),
                "control socket: the path names another file than the socket this launch bound; left in place"
            ),
            Err(_) => {}
        }
    }
}

/// The control socket served on the thread that waits for the VMM: one
/// request per readable wake-up, answered by the updater.
pub(crate) struct ControlServer {
    socket: ControlSocket,
    updater: Updater,
}

impl ControlServer {
    /// Serves `socket` with `updater`.
    pub(crate) fn new(socket: ControlSocket, updater: Updater) -> Self {
        Self { socket, updater }
    }
}

impl Supervisor for ControlServer {
    fn fd(&self) -> BorrowedFd<'_> {
        self.socket.listener().as_fd()
    }

    fn serve(&mut self, vmm: &mut Child, spawner: &Spawner) {
        let Some((stream, request)) = self.socket.accept() else {
            return;
        };
        let answer = self.updater.answer(request, vmm, spawner);
        if let Err(e) = reply(stream, &answer) {
            tracing::warn!(error = %e, "cannot answer the update request");
        }
        tracing::debug!("control request answered");
    }
}

/// Writes `answer` as one line on `stream`.
fn reply(mut stream: UnixStream, answer: &Reply) -> std::io::Result<()> {
    let mut text = serde_json::to_string(answer).map_err(std::io::Error::other)?;
    text.push('\n');
    stream.write_all(text.as_bytes())
}

/// `hugemem update`: asks the launch listening on `path` to update its QEMU
/// (to `qemu`, or the same binary) and waits up to `timeout` for the result.
///
/// # Errors
///
/// [`ControlError`]: no such launch, a listener of another uid than the
/// caller's or root's ([`ControlError::NotOurs`], sent nothing), no answer in
/// time, or the launcher's error text.
pub fn request_update(
    path: &Path,
    qemu: Option<&Path>,
    timeout: Duration,
) -> Result<UpdateReport, ControlError> {
    let request = Request::Update {
        qemu: qemu.map(Path::to_path_buf),
    };
    match exchange(path, &request, timeout)? {
        Reply::Ok(report) => Ok(report),
        Reply::Error(text) => Err(ControlError::Failed(text)),
        Reply::Parked(_) => Err(ControlError::Exchange {
            path: path.to_owned(),
            what: "a park's answer to an update".into(),
        }),
    }
}

/// `hugemem park NAME` of a launched QEMU: asks the launch listening on
/// `path` to park its VM under `name` in its daemon and waits up to
/// `timeout` for the result. The VMM exits once the daemon has the VM.
///
/// # Errors
///
/// As [`request_update`]; [`ControlError::ParkFailed`] with the
/// launcher's text (the VM runs on).
pub fn request_park(
    path: &Path,
    name: &str,
    timeout: Duration,
) -> Result<ParkReport, ControlError> {
    let request = Request::Park {
        name: name.to_owned(),
    };
    match exchange(path, &request, timeout)? {
        Reply::Parked(report) => Ok(report),
        Reply::Error(text) => Err(ControlError::ParkFailed(text)),
        Reply::Ok(_) => Err(ControlError::Exchange {
            path: path.to_owned(),
            what: "an update's answer to a park".into(),
        }),
    }
}

/// One request on the control socket at `path` and its reply, sent only
/// to a launch of the caller's uid or root's.
fn exchange(path: &Path, request: &Request, timeout: Duration) -> Result<Reply, ControlError> {
    let socket = |source| ControlError::Socket {
        path: path.to_owned(),
        source,
    };
    let stream = UnixStream::connect(path).map_err(socket)?;
    // Whoever could bind the path may listen on it: the request (and the
    // QEMU path in it) goes only to a launch of the caller's uid or root's.
    let listener = getsockopt(&stream, PeerCredentials).map_err(|e| socket(e.into()))?;
    let own_uid = nix::unistd::geteuid().as_raw();
    if listener.uid() != own_uid && listener.uid() != 0 {
        return Err(ControlError::NotOurs {
            path: path.to_owned(),
            peer_uid: listener.uid(),
            peer_pid: listener.pid(),
            own_uid,
        });
    }
    let exchange = |what: String| ControlError::Exchange {
        path: path.to_owned(),
        what,
    };
    let mut text = serde_json::to_string(request).map_err(|e| exchange(e.to_string()))?;
    text.push('\n');
    (&stream)
        .write_all(text.as_bytes())
        .map_err(|e| exchange(format!("cannot send the request: {e}")))?;
    tracing::debug!("control request sent");
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| exchange(e.to_string()))?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .map_err(|e| exchange(format!("no answer within {timeout:?}: {e}")))?;
    tracing::debug!("control answer read");
    if line.is_empty() {
        return Err(exchange(
            "the launcher closed the connection without an answer".into(),
        ));
    }
    serde_json::from_str(&line).map_err(|e| exchange(format!("bad answer {line:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn names_become_paths_under_the_runtime_dir() {
        let path = control_socket_path("vm-1.a_b").expect("name");
        assert!(path.ends_with("hugemem/vm/vm-1.a_b.sock"), "{path:?}");
        for bad in ["", ".x", "a/b", "a b", "..", &"x".repeat(65)] {
            assert!(control_socket_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn one_request_and_one_reply_per_connection() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub").join("vm.sock");
        let socket = ControlSocket::bind(&path).expect("bind");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(
            ControlSocket::bind(&path).is_err(),
            "a live socket is not replaced"
        );
        let report = UpdateReport {
            vmm: "QEMU".into(),
            old_pid: 1,
            new_pid: 2,
            program: "qemu".into(),
            handoff: true,
            ram_transferred_bytes: 10,
            ram_total_bytes: 20,
            guest_ram_bytes: 30,
            qemu_downtime_ms: 4,
            qemu_total_ms: 5,
            update_ms: 6.5,
            switch_ms: 7.5,
            migrate_at_ns: 8,
            resumed_at_ns: 9,
        };
        std::thread::scope(|s| {
            let client =
                s.spawn(|| request_update(&path, Some(Path::new("/q")), Duration::from_secs(10)));
            let (stream, request) = loop {
                if let Some(got) = socket.accept() {
                    break got;
                }
                let mut fds = [nix::poll::PollFd::new(
                    std::os::fd::AsFd::as_fd(socket.listener()),
                    nix::poll::PollFlags::POLLIN,
                )];
                nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE).expect("poll");
            };
            assert_eq!(
                request,
                Request::Update {
                    qemu: Some("/q".into())
                }
            );
            reply(stream, &Reply::Ok(report.clone())).expect("reply");
            assert_eq!(client.join().expect("client").expect("report"), report);
        });
        // Garbage gets an error line, not a hang.
        let mut raw = UnixStream::connect(&path).expect("connect");
        raw.write_all(b"nonsense\n").expect("write");
        assert!(socket.accept().is_none());
        let mut answer = String::new();
        raw.read_to_string(&mut answer).expect("read");
        assert!(answer.contains("bad request"), "{answer}");
        drop(socket);
        assert!(!path.exists(), "the socket file goes with the launcher");
    }
}
