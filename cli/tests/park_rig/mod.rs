//! What the fault tests with the real cloud-hypervisor share
//! (`park_ch_faults.rs`, `park_ch_restart.rs`): the counting guest
//! launched, parked, saved and restored through the real binary; a
//! cloud-hypervisor waiting in `receive-migration` that the test (playing
//! the launcher) can kill at an exact step of a restore, through a
//! **relay** between it and the daemon that reads each request, and can
//! hold its page faults (a **gate** on the fault connection); and the
//! same relay between a sending cloud-hypervisor and the daemon for a
//! park.

// Each test binary that includes this uses a part of it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ch_migration::{Command as Step, RequestHeader, HEADER_SIZE};
use hugemem::launch::vmm::cloud_hypervisor::api::ChApi;
use test_support::prelude::wait_until;

pub const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
/// How long one API call or step may take.
pub const STEP: Duration = Duration::from_secs(60);

// The set-up is the other park tests' (`common::park`).
pub use crate::common::park::{set_up, Setup};

/// `hugemem launch --restore NAME [--on-demand]` on the daemon at `socket`.
pub fn restore(socket: &Path, ch: &str, name: &str, api: &Path, on_demand: bool) -> Child {
    let mut cmd = Command::new("timeout");
    cmd.args(["600", HUGEMEM, "launch", "--socket"])
        .arg(socket)
        .args(["--restore", name]);
    if on_demand {
        cmd.arg("--on-demand");
    }
    cmd.args(["--", ch, "--api-socket"])
        .arg(api)
        .spawn()
        .expect("spawn hugemem launch --restore")
}

/// `hugemem ARGS --socket SOCKET`: its output, which must be a success.
pub fn run_ok(socket: &Path, args: &[&std::ffi::OsStr]) -> String {
    let out = Command::new("timeout")
        .arg("300")
        .arg(HUGEMEM)
        .args(args)
        .arg("--socket")
        .arg(socket)
        .output()
        .expect("run hugemem");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "hugemem {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// SIGKILL to `pid` (a process this test started).
pub fn kill_9(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// A cloud-hypervisor waiting in `vm.receive-migration` on `listen`, as
/// `hugemem launch --restore` starts one; the test kills it when it likes.
pub struct Receiver {
    child: Arc<Mutex<Child>>,
    pub api: ChApi,
    pub listen: PathBuf,
}

impl Receiver {
    /// cloud-hypervisor `ch` with its API at `<dir>/<tag>.api`, asked to
    /// receive on `<dir>/<tag>.rx` (postcopy: `memory_mode=postcopy`).
    pub fn start(ch: &str, dir: &Path, tag: &str, postcopy: bool) -> Self {
        let api_path = dir.join(format!("{tag}.api"));
        let listen = dir.join(format!("{tag}.rx"));
        let log = std::fs::File::create(dir.join(format!("{tag}.log"))).expect("log");
        let child = Command::new(ch)
            .arg("--api-socket")
            .arg(format!("path={}", api_path.display()))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn cloud-hypervisor");
        let api = ChApi::new(&api_path);
        wait_until("cloud-hypervisor's API", STEP, || {
            api.ping(Duration::from_secs(1)).is_ok()
        });
        let (caller, at) = (api.clone(), listen.clone());
        std::thread::spawn(move || {
            if postcopy {
                let body = serde_json::json!({
                    "receiver_url": format!("unix:{}", at.display()),
                    "memory_mode": "Postcopy",
                });
                let _ = caller.put("vm.receive-migration", Some(&body), STEP);
            } else {
                let _ = caller.receive_migration(&at, STEP);
            }
        });
        Self {
            child: Arc::new(Mutex::new(child)),
            api,
            listen,
        }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.lock().expect("child").id()
    }

    /// A connection to its migration socket, once it listens.
    pub fn connect(&self) -> UnixStream {
        let deadline = Instant::now() + STEP;
        loop {
            match UnixStream::connect(&self.listen) {
                Ok(s) => return s,
                Err(e) if Instant::now() < deadline => {
                    // Not bound or not listening yet: nothing was accepted.
                    assert!(
                        matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ECONNREFUSED)),
                        "connect {}: {e}",
                        self.listen.display()
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("cloud-hypervisor never listened: {e}"),
            }
        }
    }

    /// A closure that SIGKILLs it and reaps it (for a relay's cut).
    pub fn killer(&self) -> impl FnOnce() + Send + 'static {
        let child = Arc::clone(&self.child);
        move || {
            let mut c = child.lock().expect("child");
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL, and waits for it to exit.
    pub fn kill(&self) {
        (self.killer())();
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where a relay cuts the exchange: the step's request is not passed on
/// (`Before`), or its answer was passed back (`After`); `cut` runs there
/// (it kills a process) and the relay closes both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Before the first request of this command is passed on.
    Before(Step),
    /// After the answer to the first request of this command came back.
    After(Step),
    /// Never: the exchange runs to its end.
    Never,
}

fn read_exact(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> bool {
    let mut got = 0;
    while got < buf.len() {
        match hugemem_client::sys::recv_with_fds(sock.as_fd(), &mut buf[got..], fds, 8, false) {
            Ok(r) if r.bytes > 0 => got += r.bytes,
            _ => return false,
        }
    }
    true
}

/// One request read whole: its command, bytes and fds.
fn read_request(sock: &UnixStream) -> Option<(Step, Vec<u8>, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    let mut head = [0u8; HEADER_SIZE];
    if !read_exact(sock, &mut head, &mut fds) {
        return None;
    }
    let h = RequestHeader::decode(&head).ok()?;
    let mut bytes = head.to_vec();
    let mut payload = vec![0u8; usize::try_from(h.length).ok()?];
    if !read_exact(sock, &mut payload, &mut fds) {
        return None;
    }
    bytes.extend(payload);
    Some((h.command, bytes, fds))
}

/// Sends a request as its sender did: the header, then the payload with
/// the fds on its first byte (cloud-hypervisor reads the header alone).
fn send(sock: &UnixStream, bytes: &[u8], fds: &[OwnedFd]) -> bool {
    let fds: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    let (head, payload) = bytes.split_at(HEADER_SIZE.min(bytes.len()));
    if payload.is_empty() {
        return hugemem_client::proto::socket::send_all(sock.as_fd(), head, &fds).is_ok();
    }
    hugemem_client::proto::socket::send_all(sock.as_fd(), head, &[]).is_ok()
        && hugemem_client::proto::socket::send_all(sock.as_fd(), payload, &fds).is_ok()
}

/// What passed a relay.
#[derive(Debug, Default)]
pub struct Relayed {
    /// The requests passed on (or cut), in order.
    pub commands: Vec<Step>,
    /// The cut was reached (and its action ran).
    pub cut: bool,
}

/// Passes requests from `requests` to `answers`' peer and its answers back,
/// one at a time, until `cut` (see [`Cut`]) or either side ends. The first
/// memory fd that passes is sent on `memory` (a duplicate).
pub fn relay(
    requests: UnixStream,
    answers: UnixStream,
    cut: Cut,
    at_cut: impl FnOnce() + Send + 'static,
    memory: Option<mpsc::Sender<OwnedFd>>,
) -> JoinHandle<Relayed> {
    std::thread::spawn(move || {
        let mut seen = Relayed::default();
        let mut memory = memory;
        while let Some((cmd, bytes, fds)) = read_request(&requests) {
            let first = !seen.commands.contains(&cmd);
            seen.commands.push(cmd);
            if cmd == Step::MemoryFd {
                if let (Some(tx), Some(fd)) = (memory.take(), fds.first()) {
                    let _ = tx.send(fd.try_clone().expect("dup the memory fd"));
                }
            }
            if first && cut == Cut::Before(cmd) {
                at_cut();
                seen.cut = true;
                return seen;
            }
            if !send(&answers, &bytes, &fds) {
                break;
            }
            drop(fds);
            let mut answer = [0u8; HEADER_SIZE];
            if (&answers).read_exact(&mut answer).is_err()
                || (&requests).write_all(&answer).is_err()
            {
                break;
            }
            if first && cut == Cut::After(cmd) {
                at_cut();
                seen.cut = true;
                return seen;
            }
            if matches!(cmd, Step::Complete | Step::CompletePaused) {
                break;
            }
        }
        // Both sides close here, as a killed process's would.
        seen
    })
}

/// Holds the page faults a receiver asks for while closed.
#[derive(Debug, Default)]
pub struct Gate {
    open: Mutex<bool>,
    changed: Condvar,
}

impl Gate {
    /// A closed gate.
    pub fn closed() -> Arc<Self> {
        Arc::default()
    }

    /// Lets the faults through.
    pub fn open(&self) {
        *self.open.lock().expect("gate") = true;
        self.changed.notify_all();
    }

    fn wait_open(&self) {
        let mut open = self.open.lock().expect("gate");
        while !*open {
            open = self.changed.wait(open).expect("gate");
        }
    }
}

/// Copies bytes from `from` to `to` until `from` ends (then ends `to`'s
/// writing side), each chunk only once `gate` is open.
fn pipe(from: UnixStream, to: UnixStream, gate: Option<Arc<Gate>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match (&from).read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(g) = &gate {
                g.wait_open();
            }
            if (&to).write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    })
}

/// A fault connection through the test: the daemon's end (to hand it in
/// the RESTORE) for the receiver's connection `ch`; the receiver's
/// requests pass only while `gate` is open.
pub fn fault_relay(ch: UnixStream, gate: &Arc<Gate>) -> UnixStream {
    let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
    let (ours2, ch2) = (ours.try_clone().expect("dup"), ch.try_clone().expect("dup"));
    pipe(ours, ch, None);
    pipe(ch2, ours2, Some(Arc::clone(gate)));
    daemon_end
}

/// The memory fd a relay passed on, as a file to read the guest's
/// counter from.
pub fn memory_file(rx: &mpsc::Receiver<OwnedFd>) -> std::fs::File {
    std::fs::File::from(
        rx.recv_timeout(STEP)
            .expect("the memory fd passed the relay"),
    )
}

/// A launched counting guest on the daemon at `socket`, parked as `name`
/// with `hugemem park` (its launcher ends): the guest's count then.
pub fn launch_and_park(socket: &Path, setup: &Setup, name: &str) -> u64 {
    let api = setup.dir.path().join(format!("{name}-launch.api"));
    let guest = (setup.ch.as_str(), setup.elf.as_path());
    crate::common::park::launch_and_park_on(socket, guest, &api, name)
        .1
        .count
}

/// [`launch_and_park`], saved to `<dir>/<name>-saved` and parked again from
/// there as `name`, on demand or read at once; the guest's count.
pub fn park_from_disk(socket: &Path, setup: &Setup, name: &str, on_demand: bool) -> u64 {
    let parked_at = launch_and_park(socket, setup, name);
    let saved = setup.dir.path().join(format!("{name}-saved"));
    run_ok(
        socket,
        &[
            "unpark".as_ref(),
            name.as_ref(),
            "--save".as_ref(),
            saved.as_os_str(),
        ],
    );
    let mut args = vec![
        "park".as_ref(),
        name.as_ref(),
        "--from-dir".as_ref(),
        saved.as_os_str(),
    ];
    if on_demand {
        args.push("--on-demand".as_ref());
    }
    run_ok(socket, &args);
    parked_at
}

/// `hugemem serve` (with `--takeover`: a successor) on `socket` with
/// `config`, a process of its own.
pub fn serve(socket: &Path, config: &Path, takeover: bool) -> test_support::process::ServeProcess {
    let mut cmd = Command::new(HUGEMEM);
    cmd.args(["serve", "--config"])
        .arg(config)
        .arg("--socket")
        .arg(socket);
    if takeover {
        cmd.arg("--takeover");
    }
    test_support::process::ServeProcess(cmd.spawn().expect("spawn hugemem serve"))
}

/// A daemon process on `socket`, once it answers.
pub fn serving(socket: &Path, config: &Path) -> test_support::process::ServeProcess {
    let d = serve(socket, config, false);
    wait_until("the daemon answers", STEP, || {
        hugemem_client::client::Client::connect(socket).is_ok()
    });
    d
}

/// The STATS of the daemon on `socket`.
pub fn stats(socket: &Path) -> hugemem_client::stats::Stats {
    let mut c = hugemem_client::client::Client::connect(socket).expect("connect");
    c.set_timeout(Some(STEP)).expect("timeout");
    c.stats().expect("STATS")
}

/// Ends a restored VM: SIGTERM to its launcher (`launch`, the `timeout`
/// around it), which stops cloud-hypervisor and frees the memory.
pub fn stop_launch(launch: &mut Child) {
    let launcher = crate::common::child_of(launch.id());
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(launcher).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    );
    let status = launch.wait().expect("wait for the launcher");
    assert_ne!(
        status.code(),
        Some(124),
        "the launcher did not finish in time"
    );
}

/// `hugemem launch --restore NAME` of a VM parked at guest count
/// `parked_at`: the guest counts on from there with no page changed;
/// then it is stopped.
pub fn restore_and_check(
    socket: &Path,
    setup: &Setup,
    name: &str,
    parked_at: u64,
    on_demand: bool,
) {
    let api = setup.dir.path().join(format!("{name}-restored.api"));
    let mut launch = restore(socket, &setup.ch, name, &api, on_demand);
    let launcher = crate::common::child_of(launch.id());
    let vmm = crate::common::child_of(launcher);
    let ram = crate::common::park::memfd_of(vmm);
    let state = crate::common::counting_past(&ram, parked_at, "the restored guest to count on");
    assert_eq!(state.bad, 0, "{name}: the guest found a page changed");
    eprintln!(
        "{name}: restored, counts on from {parked_at} ({})",
        state.count
    );
    drop(ram);
    stop_launch(&mut launch);
}
