//! cloud-hypervisor processes the bench starts itself (the floor and the
//! copying baseline, `baselines.rs`; `bench offload`'s baselines). Like `hugemem update`'s switch, the bench binds each
//! one's API socket and passes it as `--api-socket fd=N` (a request can go
//! the moment the process starts), and reads its `--event-monitor` from a
//! pipe: a receiving process says `migration-receive-ready` there once its
//! migration socket listens.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hugemem::launch::vmm::cloud_hypervisor::api::{ChApi, ChApiError};
use hugemem::launch::vmm::cloud_hypervisor::events::{ChEvents, RECEIVE_READY};

use super::baselines::{BaselineVmm, Migration};
use super::error::io;
use super::error::VmmUpdateError;
use super::guest::{monotonic_ns, GuestRam};
use crate::harness::vmm::{written_bytes, VmmProcess};

/// How long one API request, and one migration, may take.
pub(crate) const CH_DEADLINE: Duration = Duration::from_secs(600);

fn api_err(what: &'static str) -> impl FnOnce(ChApiError) -> VmmUpdateError {
    move |e| VmmUpdateError::Ch(format!("{what}: {e}"))
}

/// A cloud-hypervisor the bench started; killed when dropped.
pub(crate) struct BenchCh {
    process: VmmProcess,
    api: ChApi,
    events: Option<ChEvents>,
}

impl BenchCh {
    /// Starts `argv` (program first) with its API socket at
    /// `dir/NAME.api`, its stderr in `dir/NAME.log` and `inherit` open
    /// under their numbers. Without a VM on its command line it waits for
    /// a `receive-migration`.
    pub(crate) fn start(
        argv: &[OsString],
        dir: &Path,
        name: &str,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<Self, VmmUpdateError> {
        let api_path = dir.join(format!("{name}.api"));
        let listener =
            UnixListener::bind(&api_path).map_err(io(format!("bind {}", api_path.display())))?;
        let api_fd = OwnedFd::from(listener);
        let (events, theirs) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| io("event pipe")(e.into()))?;
        let log = std::fs::File::create(dir.join(format!("{name}.log")))
            .map_err(io("cloud-hypervisor log"))?;
        let mut command = Command::new(&argv[0]);
        command
            .args(&argv[1..])
            .arg("--api-socket")
            .arg(format!("fd={}", api_fd.as_raw_fd()))
            .arg("--event-monitor")
            .arg(format!("fd={}", theirs.as_raw_fd()))
            .stdout(Stdio::null())
            .stderr(log);
        let mut fds = inherit.to_vec();
        fds.extend([api_fd.as_fd(), theirs.as_fd()]);
        let process = VmmProcess::spawn(command, &fds).map_err(io("start cloud-hypervisor"))?;
        Ok(Self {
            process,
            api: ChApi::new(&api_path),
            events: Some(ChEvents::new(events)),
        })
    }

    /// Its pid.
    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Its API.
    pub(crate) fn api(&self) -> &ChApi {
        &self.api
    }

    /// Waits until its VM runs: its guest memory (a memfd) is there from
    /// then on. Before the VM from the command line is made, `vm.info` fails
    /// or names the state `Created` (the configuration alone).
    pub(crate) fn wait_running(&self) -> Result<(), VmmUpdateError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = self.api.vm_state(CH_DEADLINE);
            match state {
                Ok(ref s) if s == "Running" => return Ok(()),
                _ if Instant::now() > deadline => {
                    return Err(VmmUpdateError::Ch(format!(
                        "the VM does not run within 30 s: {state:?}"
                    )))
                }
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }

    /// Has it `receive-migration` on `channel` (a UNIX socket it binds)
    /// and waits until it listens there (its `migration-receive-ready`
    /// event); then reads and drops its events from now on.
    pub(crate) fn listen_for_migration(
        &mut self,
        channel: &Path,
    ) -> Result<Receiving, VmmUpdateError> {
        let receiver = self.api.clone();
        let listen = channel.to_owned();
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done_tx.send(receiver.receive_migration(&listen, CH_DEADLINE));
        });
        let mut events = self
            .events
            .take()
            .ok_or_else(|| VmmUpdateError::Ch("the receiver's events were dropped".into()))?;
        events.wait_for(RECEIVE_READY, CH_DEADLINE).map_err(|e| {
            VmmUpdateError::Ch(format!(
                "the receiver did not listen for the migration: {e}"
            ))
        })?;
        events.drain_in_background();
        Ok(Receiving(done_rx))
    }

    /// Reads (and drops) its events from now on, so that it never finds
    /// the pipe full: for a process that receives no migration.
    pub(crate) fn drain_events(&mut self) {
        if let Some(events) = self.events.take() {
            events.drain_in_background();
        }
    }

    /// Ends it after its guest moved away: a migration's source exits by
    /// itself; one that lingers is told to (`vmm.shutdown`). Then reaps it.
    pub(crate) fn retire(self) {
        let api = self.api;
        self.process.end(|| {
            let _ = api.shutdown_vmm(CH_DEADLINE);
        });
    }
}

/// A `receive-migration` under way ([`BenchCh::listen_for_migration`]).
pub(crate) struct Receiving(mpsc::Receiver<Result<(), ChApiError>>);

impl Receiving {
    /// Waits for its answer: the guest runs in the receiver.
    pub(crate) fn wait(self) -> Result<(), VmmUpdateError> {
        self.0
            .recv_timeout(CH_DEADLINE)
            .map_err(|_| VmmUpdateError::Ch("receive-migration did not answer".into()))?
            .map_err(api_err("receive-migration"))
    }
}

/// One migration, as [`migrate`] saw it.
pub(crate) struct ChMigrated {
    /// `CLOCK_MONOTONIC` just before `send-migration`, ns.
    pub(crate) migrate_at_ns: u64,
    /// `CLOCK_MONOTONIC` once the destination's `receive-migration`
    /// answered (the guest runs there), ns.
    pub(crate) resumed_at_ns: u64,
    /// What the source wrote meanwhile (`/proc/PID/io` `wchar`), bytes.
    pub(crate) written_bytes: u64,
}

/// Migrates the guest from `src` to `dst` (started without a VM) over a
/// UNIX socket at `channel`; `local`: the guest memory's fds move instead
/// of its RAM. Returns once `dst` runs the guest.
pub(crate) fn migrate(
    src: &BenchCh,
    dst: &mut BenchCh,
    channel: &Path,
    local: bool,
) -> Result<ChMigrated, VmmUpdateError> {
    let received = dst.listen_for_migration(channel)?;
    let written_before = written_bytes(src.pid());
    let migrate_at_ns = monotonic_ns();
    src.api
        .send_migration(channel, local, CH_DEADLINE)
        .map_err(api_err("send-migration"))?;
    received.wait()?;
    let resumed_at_ns = monotonic_ns();
    let written_after = written_bytes(src.pid());
    let state = dst.api.vm_state(CH_DEADLINE).map_err(api_err("vm.info"))?;
    if state != "Running" {
        return Err(VmmUpdateError::Ch(format!(
            "the destination's VM is {state} after the migration, not Running"
        )));
    }
    let written_bytes = written_before
        .zip(written_after)
        .map(|(b, a)| a.saturating_sub(b))
        .ok_or_else(|| VmmUpdateError::Ch("cannot read the source's /proc/PID/io".into()))?;
    Ok(ChMigrated {
        migrate_at_ns,
        resumed_at_ns,
        written_bytes,
    })
}

impl BaselineVmm for BenchCh {
    const SENT: &'static str = "bytes written by the source";

    fn start(
        argv: &[OsString],
        dir: &Path,
        name: &str,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<Self, VmmUpdateError> {
        let mut ch = Self::start(argv, dir, name, inherit)?;
        ch.drain_events();
        Ok(ch)
    }

    fn receiver(
        argv: &[OsString],
        dir: &Path,
        name: &str,
        _memory: Option<BorrowedFd<'_>>,
    ) -> Result<Self, VmmUpdateError> {
        Self::start(&argv[..1], dir, name, &[])
    }

    fn own_ram(&self) -> Result<GuestRam, VmmUpdateError> {
        self.wait_running()?;
        GuestRam::of_memfd(self.pid())
    }

    fn prepare(
        _src: &mut Self,
        _dst: &mut Self,
        _channel: &Path,
        _local: bool,
    ) -> Result<(), VmmUpdateError> {
        // The receiver listens as the migration starts (`migrate`).
        Ok(())
    }

    fn migrate(
        src: &mut Self,
        dst: &mut Self,
        channel: &Path,
        local: bool,
    ) -> Result<Migration, VmmUpdateError> {
        let m = migrate(src, dst, channel, local)?;
        Ok(Migration {
            migrate_at_ns: m.migrate_at_ns,
            resumed_at_ns: m.resumed_at_ns,
            sent_bytes: m.written_bytes,
            qemu_downtime_ms: None,
            qemu_total_ms: None,
        })
    }

    fn end(self) {
        self.retire();
    }
}
