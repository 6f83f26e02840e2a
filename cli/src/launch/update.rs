//! Live update of a launched QEMU without copying guest RAM (issue 26).
//!
//! `hugemem launch --name VM -- qemu-system-x86_64 …` gives QEMU a QMP
//! monitor on a socket pair (`qmp.rs`) and listens on a control socket
//! (`control.rs`). `hugemem update VM [--qemu NEW]` asks it to update; the
//! launcher, on the thread that waits for the VMM:
//!
//! 1. gets the guest RAM for the successor: a second daemon connection
//!    takes the allocation over with HANDOFF (its own file descriptors, a
//!    new token; the old connection then owns nothing), or, from a daemon
//!    without HANDOFF, duplicates of its own descriptors;
//! 2. starts the new QEMU with the same arguments on that memory, a monitor
//!    of its own, `-incoming defer`, and one end of a second socket pair
//!    (the migration channel) inherited;
//! 3. sets the migration capabilities `x-ignore-shared` (RAM blocks on
//!    shared memory are not sent: the destination maps the same pages) and
//!    `events` on both QEMUs, starts `migrate-incoming fd:N` on the new one,
//!    passes the other end to the old one (`getfd`, SCM_RIGHTS) and runs
//!    `migrate fd:…` there;
//! 4. waits for the old QEMU's MIGRATION `completed` event and the new one's
//!    RESUME (events, no polling), reads `query-migrate` (RAM bytes
//!    transferred, QEMU's downtime), tells the old QEMU to `quit`, reaps it,
//!    and from then on supervises the new one (signals, exit status).
//!
//! On a failure before the switch, the new QEMU is killed and the old one
//! keeps running the guest (resumed with `cont` if the migration had
//! stopped it); the error goes back to `hugemem update`. Memory is never at
//! risk: both QEMUs map the same daemon pages, and the daemon keeps pages
//! any process maps.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use std::sync::Arc;

use backend::client::{Client, ClientError};
use backend::proto::{RegionInfo, Status};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use serde_json::{json, Value};
use tracing::{info, warn};

use super::build::build_args;
use super::command_line::{BuildOptions, MemoryFile, MemoryRegion, Vmm};
use super::control::{reply, ControlSocket, Reply, Request, UpdateReport};
use super::error::LaunchError;
use super::process::{pidfd, Spawner, Supervisor};
use super::qmp::{is_event, monitor_args, Qmp, QmpError};
use super::reattach::{Held, Successor};

/// Why an update failed.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// Getting the successor's memory or starting it failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A QMP exchange failed.
    #[error("{what}: {source}")]
    Qmp {
        /// Which QEMU, doing what.
        what: String,
        /// The cause.
        #[source]
        source: QmpError,
    },
    /// Socket pairs, pidfds.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The migration ended other than completed.
    #[error("the migration ended {status}: {detail}")]
    Migration {
        /// QEMU's status.
        status: String,
        /// `query-migrate`'s error text, if any.
        detail: String,
    },
}

fn qmp_err(what: &str) -> impl FnOnce(QmpError) -> UpdateError + '_ {
    move |source| UpdateError::Qmp {
        what: what.to_owned(),
        source,
    }
}

/// The guest RAM a QEMU maps: the descriptors the launcher holds for it
/// and the region table.
#[derive(Debug)]
pub(crate) struct Memory {
    /// One per region.
    pub(crate) fds: Vec<OwnedFd>,
    /// The daemon's region table.
    pub(crate) regions: Vec<RegionInfo>,
    /// hugetlbfs paths (with `--hugetlbfs`), else empty.
    pub(crate) paths: Vec<String>,
}

impl Memory {
    fn vmm_regions(&self, hugetlbfs: bool) -> Vec<MemoryRegion> {
        self.regions
            .iter()
            .zip(&self.fds)
            .enumerate()
            .map(|(i, (r, fd))| MemoryRegion {
                size: r.size,
                node: (r.node != backend::proto::ANY_NODE).then_some(r.node),
                file: match self.paths.get(i) {
                    Some(path) if hugetlbfs => MemoryFile::Path(PathBuf::from(path)),
                    _ => MemoryFile::Fd(fd.as_raw_fd()),
                },
            })
            .collect()
    }

    fn bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    fn duplicate(&self) -> std::io::Result<Self> {
        Ok(Self {
            fds: self
                .fds
                .iter()
                .map(OwnedFd::try_clone)
                .collect::<Result<_, _>>()?,
            regions: self.regions.clone(),
            paths: self.paths.clone(),
        })
    }
}

/// `CLOCK_MONOTONIC` now, ns (0 if unreadable): comparable across the
/// processes of one host, so a bench can place the switch on its clock.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| {
            u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
                + u64::try_from(t.tv_nsec()).unwrap_or(0)
        })
        .unwrap_or(0)
}

/// What the updater needs to start a QEMU like the running one.
#[derive(Debug, Clone)]
pub(crate) struct QemuCommand {
    /// The program running now.
    pub(crate) program: OsString,
    /// The user's arguments (without hugemem's memory options).
    pub(crate) user_args: Vec<OsString>,
    /// How the memory options are built.
    pub(crate) opts: BuildOptions,
}

impl QemuCommand {
    /// The full argument list (program first) for `memory`, with the monitor
    /// on fd `monitor` and, for a successor, `-incoming defer`.
    pub(crate) fn argv(
        &self,
        program: &OsString,
        memory: &Memory,
        monitor: i32,
        incoming: bool,
    ) -> Result<Vec<OsString>, LaunchError> {
        let regions = memory.vmm_regions(self.opts.hugetlbfs);
        let mut argv = vec![program.clone()];
        argv.extend(build_args(
            Vmm::Qemu,
            &self.user_args,
            &regions,
            &self.opts,
        )?);
        argv.extend(monitor_args(monitor).map(OsString::from));
        if incoming {
            argv.extend(["-incoming".into(), "defer".into()]);
        }
        Ok(argv)
    }
}

/// Where the successor's memory comes from: the daemon, by HANDOFF.
pub(crate) struct Daemon {
    /// The daemon's socket.
    pub(crate) socket: PathBuf,
    /// The allocation as the watcher knows it (its token changes with each
    /// HANDOFF).
    pub(crate) held: Held,
    /// Ask for hugetlbfs paths.
    pub(crate) want_paths: bool,
    /// Where the new owning connection goes (the daemon watcher).
    pub(crate) successor: Arc<Successor>,
}

/// The launcher's side of live updates: the control socket, the running
/// QEMU's monitor and memory. Served on the thread that waits for the VMM.
pub(crate) struct Updater {
    control: ControlSocket,
    command: QemuCommand,
    daemon: Daemon,
    qmp: Option<Qmp>,
    /// The first QEMU's monitor, greeted at the first update.
    monitor: Option<UnixStream>,
    memory: Memory,
    deadline: Duration,
}

impl Updater {
    /// An updater for the QEMU about to start on `memory`, whose monitor is
    /// the other end of `monitor`.
    pub(crate) fn new(
        control: ControlSocket,
        command: QemuCommand,
        daemon: Daemon,
        memory: Memory,
        monitor: UnixStream,
        deadline: Duration,
    ) -> Self {
        Self {
            control,
            command,
            daemon,
            qmp: None,
            monitor: Some(monitor),
            memory,
            deadline,
        }
    }

    fn update(
        &mut self,
        vmm: &mut Child,
        spawner: &Spawner,
        qemu: Option<PathBuf>,
    ) -> Result<UpdateReport, UpdateError> {
        let started = Instant::now();
        if let Some(monitor) = self.monitor.take() {
            let qmp = Qmp::handshake(monitor, self.deadline)
                .map_err(qmp_err("the running QEMU's monitor"))?;
            self.qmp = Some(qmp);
        }
        let program = qemu.map_or_else(|| self.command.program.clone(), OsString::from);
        let (memory, handoff) = self.successor_memory()?;
        let (monitor_ours, monitor_theirs) = UnixStream::pair()?;
        let (migrate_old, migrate_new) = UnixStream::pair()?;
        let argv = self
            .command
            .argv(&program, &memory, monitor_theirs.as_raw_fd(), true)?;
        // The migration channel's fd, for `migrate-incoming fd:N`.
        let incoming = migrate_new.as_raw_fd();
        let mut inherit: Vec<BorrowedFd<'_>> = memory.fds.iter().map(AsFd::as_fd).collect();
        inherit.push(monitor_theirs.as_fd());
        inherit.push(migrate_new.as_fd());
        info!(command = ?argv, "starting the successor QEMU");
        let mut successor = spawner.spawn(&argv, &inherit)?;
        drop(inherit);
        drop(monitor_theirs);
        drop(migrate_new);
        let switched = self.switch(&mut successor, monitor_ours, migrate_old, incoming);
        let (new_qmp, switch_time, window, stats) = match switched {
            Ok(done) => done,
            Err(e) => {
                let _ = successor.kill();
                let _ = successor.wait();
                self.keep_old_running();
                return Err(e);
            }
        };
        // The old QEMU has handed the guest over: let it go.
        let old_pid = vmm.id();
        let old = std::mem::replace(vmm, successor);
        let mut old_qmp = self.qmp.replace(new_qmp);
        if let Some(q) = old_qmp.as_mut() {
            if let Err(e) = q.execute("quit", json!({})) {
                // It may close the monitor before it answers.
                tracing::debug!(error = %e, "quit on the old QEMU");
            }
        }
        self.reap(old, old_pid);
        self.memory = memory;
        let ram = stats.get("ram").cloned().unwrap_or(Value::Null);
        let number = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64).unwrap_or(0);
        let report = UpdateReport {
            old_pid,
            new_pid: vmm.id(),
            program: program.to_string_lossy().into_owned(),
            handoff,
            ram_transferred_bytes: number(&ram, "transferred"),
            ram_total_bytes: number(&ram, "total"),
            guest_ram_bytes: self.memory.bytes(),
            qemu_downtime_ms: number(&stats, "downtime"),
            qemu_total_ms: number(&stats, "total-time"),
            update_ms: started.elapsed().as_secs_f64() * 1e3,
            switch_ms: switch_time.as_secs_f64() * 1e3,
            migrate_at_ns: window.0,
            resumed_at_ns: window.1,
        };
        info!(?report, "QEMU updated under the running guest");
        Ok(report)
    }

    /// Step 1: the allocation on a new daemon connection (HANDOFF), which
    /// the daemon watcher takes over at once; from a daemon without
    /// HANDOFF, duplicates of the launcher's descriptors.
    fn successor_memory(&mut self) -> Result<(Memory, bool), UpdateError> {
        let Some(token) = self.daemon.held.token else {
            return Ok((self.memory.duplicate()?, false));
        };
        let mut client = Client::connect(&self.daemon.socket).map_err(LaunchError::from)?;
        let alloc = match client.handoff(self.daemon.held.id, token, self.daemon.want_paths) {
            Ok(alloc) => alloc,
            Err(ClientError::Refused {
                status: Status::Unsupported,
                message,
            }) => {
                warn!(%message, "the daemon cannot hand the allocation over; the new QEMU gets the launcher's descriptors");
                return Ok((self.memory.duplicate()?, false));
            }
            Err(e) => return Err(LaunchError::from(e).into()),
        };
        let held = Held::of(&alloc);
        let memory = Memory {
            fds: alloc.fds,
            regions: alloc.regions,
            paths: alloc.paths,
        };
        // The new connection owns the allocation from here on, whatever
        // happens to the update.
        self.daemon.held = held.clone();
        self.daemon.successor.offer(client, held);
        Ok((memory, true))
    }

    /// Steps 3 and 4 up to the new QEMU's RESUME: returns its monitor, the
    /// time from `migrate` to RESUME, and the old QEMU's `query-migrate`.
    fn switch(
        &mut self,
        successor: &mut Child,
        monitor: UnixStream,
        channel: UnixStream,
        incoming: i32,
    ) -> Result<(Qmp, Duration, (u64, u64), Value), UpdateError> {
        let mut new = Qmp::handshake(monitor, self.deadline)
            .map_err(qmp_err("the new QEMU's monitor (did it start?)"))?;
        let old = self.qmp.as_mut().ok_or_else(|| {
            UpdateError::Io(std::io::Error::other("no monitor on the running QEMU"))
        })?;
        old.clear_events();
        let caps = json!({"capabilities": [
            {"capability": "x-ignore-shared", "state": true},
            {"capability": "events", "state": true},
        ]});
        new.execute("migrate-set-capabilities", caps.clone())
            .map_err(qmp_err("migrate-set-capabilities on the new QEMU"))?;
        old.execute("migrate-set-capabilities", caps)
            .map_err(qmp_err("migrate-set-capabilities on the running QEMU"))?;
        new.execute("migrate-incoming", json!({"uri": format!("fd:{incoming}")}))
            .map_err(qmp_err("migrate-incoming on the new QEMU"))?;
        old.execute_with_fd("getfd", json!({"fdname": "hm-migrate"}), channel.as_fd())
            .map_err(qmp_err("getfd on the running QEMU"))?;
        drop(channel);
        let migrate = Instant::now();
        let migrate_at = monotonic_ns();
        old.execute("migrate", json!({"uri": "fd:hm-migrate"}))
            .map_err(qmp_err("migrate on the running QEMU"))?;
        let end = old
            .wait_event(|e| is_event(e, "MIGRATION", &["completed", "failed", "cancelled"]))
            .map_err(qmp_err("waiting for the migration to end"))?;
        let stats = old
            .execute("query-migrate", json!({}))
            .map_err(qmp_err("query-migrate on the running QEMU"))?;
        let status = end
            .pointer("/data/status")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_owned();
        if status != "completed" {
            let detail = stats
                .get("error-desc")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            return Err(UpdateError::Migration { status, detail });
        }
        new.wait_event(|e| is_event(e, "RESUME", &[]) || is_event(e, "MIGRATION", &["failed"]))
            .map_err(qmp_err("waiting for the new QEMU to run the guest"))
            .and_then(|e| {
                if is_event(&e, "RESUME", &[]) {
                    Ok(())
                } else {
                    Err(UpdateError::Migration {
                        status: "failed on the new QEMU".into(),
                        detail: e.to_string(),
                    })
                }
            })?;
        let switch = migrate.elapsed();
        let resumed_at = monotonic_ns();
        if let Ok(Some(status)) = successor.try_wait() {
            return Err(UpdateError::Migration {
                status: "with the new QEMU gone".into(),
                detail: format!("it ended with {status}"),
            });
        }
        Ok((new, switch, (migrate_at, resumed_at), stats))
    }

    /// After a failed update: make sure the running QEMU runs the guest.
    fn keep_old_running(&mut self) {
        let Some(old) = self.qmp.as_mut() else {
            return;
        };
        let _ = old.execute("migrate_cancel", json!({}));
        match old.execute("query-status", json!({})) {
            Ok(s) if s.get("running").and_then(Value::as_bool) == Some(true) => {}
            Ok(s) => {
                warn!(status = %s, "the running QEMU stopped for the failed migration; resuming it");
                if let Err(e) = old.execute("cont", json!({})) {
                    warn!(error = %e, "cannot resume the running QEMU");
                }
            }
            Err(e) => warn!(error = %e, "cannot ask the running QEMU for its status"),
        }
    }

    /// Waits for the replaced QEMU to exit (it was told to quit), killing it
    /// when it has not within the deadline.
    fn reap(&self, mut old: Child, pid: u32) {
        let exited = i32::try_from(pid)
            .ok()
            .and_then(|p| pidfd(nix::unistd::Pid::from_raw(p)).ok());
        if let Some(fd) = exited {
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
            let millis = u16::try_from(self.deadline.as_millis()).unwrap_or(u16::MAX);
            if !matches!(poll(&mut fds, PollTimeout::from(millis)), Ok(1)) {
                warn!(pid, "the old QEMU did not quit in time; killing it");
                let _ = old.kill();
            }
        }
        match old.wait() {
            Ok(status) => info!(pid, %status, "the old QEMU exited"),
            Err(e) => warn!(pid, error = %e, "cannot reap the old QEMU"),
        }
    }
}

impl Supervisor for Updater {
    fn fd(&self) -> BorrowedFd<'_> {
        self.control.listener().as_fd()
    }

    fn serve(&mut self, vmm: &mut Child, spawner: &Spawner) {
        let Some((stream, request)) = self.control.accept() else {
            return;
        };
        let Request::Update { qemu } = request;
        let answer = match self.update(vmm, spawner, qemu) {
            Ok(report) => Reply::Ok(report),
            Err(e) => {
                let text = backend::diag::chain(&e).to_string();
                warn!(error = %text, "update failed; the running QEMU keeps the guest");
                Reply::Error(format!("{text} (the running QEMU keeps the guest)"))
            }
        };
        if let Err(e) = reply(stream, &answer) {
            warn!(error = %e, "cannot answer the update request");
        }
    }
}
