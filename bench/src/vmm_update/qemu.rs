//! QEMU processes the bench starts itself (the baselines, `baselines.rs`),
//! each with its QMP monitor connected to a socket the bench listens on:
//! QEMU connects at start, the bench accepts (no waiting for a socket file
//! to appear). A migration goes over a UNIX socket, `x-ignore-shared` when
//! the memory stays (the new QEMU maps the same memfd, `-incoming defer`).

use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use hugemem::launch::vmm::qemu::qmp::{is_event, ram_bytes_sent, Qmp};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use serde_json::json;

use super::baselines::{BaselineVmm, Migration};
use super::error::io;
use super::error::VmmUpdateError;
use super::guest::{monotonic_ns, GuestRam};
use super::setup::number;
use crate::harness::vmm::VmmProcess;

/// How long a QMP reply or event may take, and QEMU to connect.
pub(crate) const QMP_DEADLINE: Duration = Duration::from_secs(600);

/// A QEMU the bench started, with its monitor; killed when dropped.
pub(crate) struct BenchQemu {
    process: VmmProcess,
    pub(crate) qmp: Qmp,
}

impl BenchQemu {
    /// Starts `argv` (program first) with its monitor connecting to a
    /// socket at `monitor`, and `inherit` open under their numbers, and
    /// greets it.
    pub(crate) fn start(
        argv: &[OsString],
        monitor: &Path,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<Self, VmmUpdateError> {
        let listener =
            UnixListener::bind(monitor).map_err(io(format!("bind {}", monitor.display())))?;
        let mut command = Command::new(&argv[0]);
        command
            .args(&argv[1..])
            .arg("-chardev")
            .arg(format!("socket,id=bench-qmp,path={}", monitor.display()))
            .args(["-mon", "chardev=bench-qmp,mode=control"]);
        let process = VmmProcess::spawn(command, inherit).map_err(io("start QEMU"))?;
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        let connected = matches!(poll(&mut fds, PollTimeout::from(30_000u16)), Ok(1));
        if !connected {
            let status = process.kill();
            return Err(VmmUpdateError::Qemu(format!(
                "QEMU did not connect its monitor within 30 s (exit: {status:?})"
            )));
        }
        let (stream, _) = listener.accept().map_err(io("accept QEMU's monitor"))?;
        let qmp = Qmp::handshake(stream, QMP_DEADLINE)
            .map_err(|e| VmmUpdateError::Qemu(format!("monitor: {e}")))?;
        Ok(Self { process, qmp })
    }

    /// Runs a QMP command.
    pub(crate) fn execute(
        &mut self,
        command: &str,
        args: serde_json::Value,
    ) -> Result<serde_json::Value, VmmUpdateError> {
        self.qmp
            .execute(command, args)
            .map_err(|e| VmmUpdateError::Qemu(format!("{command}: {e}")))
    }

    /// Its pid.
    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// `quit`, then reaps it.
    pub(crate) fn quit(self) {
        let Self { process, mut qmp } = self;
        process.end(|| {
            let _ = qmp.execute("quit", json!({}));
        });
    }
}

/// One migration, as [`migrate`] saw it.
pub(crate) struct Migrated {
    /// `CLOCK_MONOTONIC` just before `migrate`, ns.
    pub(crate) migrate_at_ns: u64,
    /// `CLOCK_MONOTONIC` once the destination's RESUME arrived, ns.
    pub(crate) resumed_at_ns: u64,
    /// The source's `query-migrate` after the migration.
    pub(crate) stats: serde_json::Value,
}

/// Runs `migrate` to `uri` on `src` (whose destination `dst` already takes
/// `migrate-incoming` there, both with the `events` capability), waits for
/// the source's MIGRATION end and the destination's RESUME (events, no
/// polling). `what` names the migration in errors.
pub(crate) fn migrate(
    src: &mut BenchQemu,
    dst: &mut BenchQemu,
    uri: &str,
    what: &str,
) -> Result<Migrated, VmmUpdateError> {
    let migrate_at_ns = monotonic_ns();
    src.execute("migrate", json!({ "uri": uri }))?;
    let end = src
        .qmp
        .wait_event(|e| is_event(e, "MIGRATION", &["completed", "failed", "cancelled"]))
        .map_err(|e| VmmUpdateError::Qemu(format!("waiting for {what}: {e}")))?;
    let stats = src.execute("query-migrate", json!({}))?;
    if !is_event(&end, "MIGRATION", &["completed"]) {
        return Err(VmmUpdateError::Qemu(format!("{what} ended: {stats}")));
    }
    dst.qmp
        .wait_event(|e| is_event(e, "RESUME", &[]))
        .map_err(|e| VmmUpdateError::Qemu(format!("waiting for {what}'s destination: {e}")))?;
    Ok(Migrated {
        migrate_at_ns,
        resumed_at_ns: monotonic_ns(),
        stats,
    })
}

/// The `unix:` URI of a migration socket at `channel`.
fn uri(channel: &Path) -> String {
    format!("unix:{}", channel.display())
}

impl BaselineVmm for BenchQemu {
    const SENT: &'static str = "RAM bytes sent";

    fn start(
        argv: &[OsString],
        dir: &Path,
        name: &str,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<Self, VmmUpdateError> {
        Self::start(argv, &dir.join(format!("{name}.qmp")), inherit)
    }

    fn receiver(
        argv: &[OsString],
        dir: &Path,
        name: &str,
        memory: Option<BorrowedFd<'_>>,
    ) -> Result<Self, VmmUpdateError> {
        let mut incoming = argv.to_vec();
        incoming.extend(["-incoming", "defer"].map(OsString::from));
        let inherit: Vec<BorrowedFd<'_>> = memory.into_iter().collect();
        Self::start(&incoming, &dir.join(format!("{name}.qmp")), &inherit)
    }

    fn own_ram(&self) -> Result<GuestRam, VmmUpdateError> {
        GuestRam::of(self.pid())
    }

    fn prepare(
        src: &mut Self,
        dst: &mut Self,
        channel: &Path,
        local: bool,
    ) -> Result<(), VmmUpdateError> {
        let mut caps = vec![json!({"capability": "events", "state": true})];
        if local {
            caps.insert(0, json!({"capability": "x-ignore-shared", "state": true}));
        }
        let caps = json!({ "capabilities": caps });
        dst.execute("migrate-set-capabilities", caps.clone())?;
        src.execute("migrate-set-capabilities", caps)?;
        if !local {
            src.execute(
                "migrate-set-parameters",
                json!({"max-bandwidth": 1u64 << 40}),
            )?;
        }
        dst.execute("migrate-incoming", json!({ "uri": uri(channel) }))?;
        Ok(())
    }

    fn migrate(
        src: &mut Self,
        dst: &mut Self,
        channel: &Path,
        local: bool,
    ) -> Result<Migration, VmmUpdateError> {
        let what = if local {
            "the plain update's migration"
        } else {
            "the copying migration"
        };
        let m = migrate(src, dst, &uri(channel), what)?;
        Ok(Migration {
            migrate_at_ns: m.migrate_at_ns,
            resumed_at_ns: m.resumed_at_ns,
            sent_bytes: ram_bytes_sent(&m.stats),
            qemu_downtime_ms: Some(number(&m.stats, "/downtime")),
            qemu_total_ms: Some(number(&m.stats, "/total-time")),
        })
    }

    fn end(self) {
        self.quit();
    }
}
