//! QEMU's switch: a migration over a socket pair with `x-ignore-shared`,
//! so RAM blocks on shared memory are not sent (the successor maps the
//! same pages), driven over each QEMU's QMP monitor (`qmp.rs`).
//!
//! The successor starts with `-incoming defer`, a monitor of its own and
//! one end of the migration channel inherited. Both QEMUs get the
//! capabilities `x-ignore-shared` and `events`; the successor listens with
//! `migrate-incoming fd:N`, the running one gets the other end (`getfd`,
//! SCM_RIGHTS) and runs `migrate`. The switch is done when the running
//! QEMU's MIGRATION event says `completed` and the successor's RESUME
//! arrives (events, no polling); `query-migrate` gives QEMU's figures.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::process::Child;
use std::time::{Duration, Instant};

use hugemem_client::client::Allocation;
use serde_json::{json, Value};
use tracing::warn;

use super::command_line::build;
use super::qmp::{is_event, monitor_args, ram_bytes_sent, Qmp, QmpError};
use crate::launch::allocation::memory_regions;
use crate::launch::command_line::BuildOptions;
use crate::launch::error::LaunchError;
use crate::launch::update::{
    monotonic_ns, MigrationFigures, ParkReport, SuccessorCommand, Switched, UpdateError, VmmSwitch,
};

fn qmp_err(what: &str) -> impl FnOnce(QmpError) -> UpdateError + '_ {
    move |source| UpdateError::Control {
        what: what.to_owned(),
        source: Box::new(source),
    }
}

/// The launcher's ends of a started successor's channels, from
/// [`VmmSwitch::successor`] to [`VmmSwitch::switch`].
#[derive(Debug)]
struct Pending {
    /// The successor's monitor.
    monitor: UnixStream,
    /// The running QEMU's end of the migration channel.
    channel: UnixStream,
    /// The successor's end's number, for `migrate-incoming fd:N`.
    incoming: RawFd,
}

/// QEMU's side of live updates: how to start a QEMU like the running one,
/// and the running one's monitor.
#[derive(Debug)]
pub(crate) struct QemuSwitch {
    /// The program running now.
    program: OsString,
    /// The user's arguments (without hugemem's memory options).
    user_args: Vec<OsString>,
    /// How the memory options are built.
    opts: BuildOptions,
    /// How long any one QMP exchange and the old QEMU's exit may take.
    deadline: Duration,
    /// The running QEMU's monitor, once greeted.
    qmp: Option<Qmp>,
    /// The first QEMU's monitor, greeted at the first update.
    first_monitor: Option<UnixStream>,
    /// Between `successor` and `switch`.
    pending: Option<Pending>,
    /// The replaced QEMU's monitor, between `switch` and `retire_old`.
    replaced: Option<Qmp>,
}

impl QemuSwitch {
    /// The switch for the first QEMU, about to run `full` (program first):
    /// adds its monitor to `full` and returns the end QEMU inherits.
    pub(crate) fn for_launch(
        full: &mut Vec<OsString>,
        user_args: &[OsString],
        opts: BuildOptions,
        deadline: Duration,
    ) -> std::io::Result<(Self, OwnedFd)> {
        let (ours, theirs) = UnixStream::pair()?;
        full.extend(monitor_args(theirs.as_raw_fd()).map(Into::into));
        let switch = Self {
            program: full.first().cloned().unwrap_or_default(),
            user_args: user_args.to_vec(),
            opts,
            deadline,
            qmp: None,
            first_monitor: Some(ours),
            pending: None,
            replaced: None,
        };
        Ok((switch, theirs.into()))
    }

    /// The successor's full argument list (program first) on `memory`,
    /// with its monitor on fd `monitor` and `-incoming defer`.
    fn argv(
        &self,
        program: &OsString,
        memory: &Allocation,
        monitor: RawFd,
    ) -> Result<Vec<OsString>, LaunchError> {
        let regions = memory_regions(memory, self.opts.hugetlbfs)?;
        let mut argv = vec![program.clone()];
        argv.extend(build(&self.user_args, &regions)?);
        argv.extend(monitor_args(monitor).map(OsString::from));
        argv.extend(["-incoming".into(), "defer".into()]);
        Ok(argv)
    }

    /// Sets both QEMUs up and starts the migration; returns when `migrate`
    /// was sent, with the successor's monitor, the `Instant` and the
    /// monotonic ns of the send.
    fn start_migration(&mut self, pending: Pending) -> Result<(Qmp, Instant, u64), UpdateError> {
        let mut new = Qmp::handshake(pending.monitor, self.deadline)
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
        new.execute(
            "migrate-incoming",
            json!({"uri": format!("fd:{}", pending.incoming)}),
        )
        .map_err(qmp_err("migrate-incoming on the new QEMU"))?;
        old.execute_with_fd(
            "getfd",
            json!({"fdname": "hm-migrate"}),
            pending.channel.as_fd(),
        )
        .map_err(qmp_err("getfd on the running QEMU"))?;
        drop(pending.channel);
        let migrate = Instant::now();
        let migrate_at = monotonic_ns();
        old.execute("migrate", json!({"uri": "fd:hm-migrate"}))
            .map_err(qmp_err("migrate on the running QEMU"))?;
        Ok((new, migrate, migrate_at))
    }

    /// Waits for the running QEMU's migration to end; returns its
    /// `query-migrate` when it completed.
    fn wait_migrated(&mut self) -> Result<Value, UpdateError> {
        let old = self.qmp.as_mut().ok_or_else(|| {
            UpdateError::Io(std::io::Error::other("no monitor on the running QEMU"))
        })?;
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
        Ok(stats)
    }
}

/// Waits for the successor's RESUME: it runs the guest.
fn wait_resumed(new: &mut Qmp) -> Result<(), UpdateError> {
    let event = new
        .wait_event(|e| is_event(e, "RESUME", &[]) || is_event(e, "MIGRATION", &["failed"]))
        .map_err(qmp_err("waiting for the new QEMU to run the guest"))?;
    if is_event(&event, "RESUME", &[]) {
        Ok(())
    } else {
        Err(UpdateError::Migration {
            status: "failed on the new QEMU".into(),
            detail: event.to_string(),
        })
    }
}

/// QEMU's figures from `query-migrate`.
fn figures(stats: &Value) -> MigrationFigures {
    let ram = stats.get("ram").cloned().unwrap_or(Value::Null);
    let number = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64).unwrap_or(0);
    MigrationFigures {
        ram_transferred_bytes: ram_bytes_sent(stats),
        ram_total_bytes: number(&ram, "total"),
        downtime_ms: number(stats, "downtime"),
        total_ms: number(stats, "total-time"),
    }
}

impl VmmSwitch for QemuSwitch {
    fn name(&self) -> &'static str {
        "QEMU"
    }

    fn program(&self) -> &OsString {
        &self.program
    }

    fn connect_running(&mut self) -> Result<(), UpdateError> {
        if let Some(monitor) = self.first_monitor.take() {
            let qmp = Qmp::handshake(monitor, self.deadline)
                .map_err(qmp_err("the running QEMU's monitor"))?;
            self.qmp = Some(qmp);
        }
        Ok(())
    }

    fn successor(
        &mut self,
        program: &OsString,
        memory: &Allocation,
    ) -> Result<SuccessorCommand, UpdateError> {
        let (monitor, monitor_theirs) = UnixStream::pair()?;
        let (channel, channel_theirs) = UnixStream::pair()?;
        let argv = self.argv(program, memory, monitor_theirs.as_raw_fd())?;
        self.pending = Some(Pending {
            monitor,
            channel,
            incoming: channel_theirs.as_raw_fd(),
        });
        Ok(SuccessorCommand {
            argv,
            inherit: vec![monitor_theirs.into(), channel_theirs.into()],
        })
    }

    fn switch(&mut self, _running: &Child, successor: &mut Child) -> Result<Switched, UpdateError> {
        let pending = self.pending.take().ok_or_else(|| {
            UpdateError::Io(std::io::Error::other("no successor QEMU was prepared"))
        })?;
        let (mut new, migrate, migrate_at_ns) = self.start_migration(pending)?;
        let stats = self.wait_migrated()?;
        wait_resumed(&mut new)?;
        let switch_time = migrate.elapsed();
        let resumed_at_ns = monotonic_ns();
        if let Ok(Some(status)) = successor.try_wait() {
            return Err(UpdateError::Migration {
                status: "with the new QEMU gone".into(),
                detail: format!("it ended with {status}"),
            });
        }
        // The successor runs the guest: its monitor is the running one.
        self.replaced = self.qmp.replace(new);
        Ok(Switched {
            switch_time,
            migrate_at_ns,
            resumed_at_ns,
            figures: figures(&stats),
        })
    }

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

    fn running_reachable(&mut self) -> bool {
        let Some(qmp) = self.qmp.as_mut() else {
            return false;
        };
        matches!(
            qmp.execute("query-status", json!({})),
            Ok(_) | Err(super::qmp::QmpError::Refused { .. })
        )
    }

    fn park(
        &mut self,
        memory: &Allocation,
        daemon: &std::path::Path,
        name: &str,
    ) -> Result<ParkReport, UpdateError> {
        let started = Instant::now();
        let qmp = self.qmp.as_mut().ok_or_else(|| {
            UpdateError::Io(std::io::Error::other("no monitor on the running QEMU"))
        })?;
        let command = (&self.program, self.user_args.as_slice());
        let done = match super::park::park(qmp, memory, command, (daemon, name), self.deadline) {
            Ok(done) => done,
            Err(e) => {
                self.keep_old_running();
                return Err(e);
            }
        };
        // The daemon has the VM: this QEMU may go. Its reply is not
        // awaited (it may close the monitor before it answers, and the VM
        // is safe whatever it does now: the launcher's wait sees it exit).
        if let Err(e) = qmp.send_command("quit", json!({})) {
            tracing::debug!(error = %e, "quit on the parked QEMU");
        }
        super::park::step(started, "quit sent");
        Ok(ParkReport {
            vmm: "QEMU".into(),
            name: name.to_owned(),
            alloc_id: done.parked.alloc_id,
            bytes: done.parked.bytes,
            copied_bytes: done.parked.copied_bytes,
            slots: done.parked.slots,
            state_bytes: done.state_bytes,
            ram_transferred_bytes: done.ram_transferred_bytes,
            park_ms: started.elapsed().as_secs_f64() * 1e3,
            migrate_ms: done.migrate_time.as_secs_f64() * 1e3,
        })
    }

    fn retire_old(&mut self) {
        if let Some(mut old) = self.replaced.take() {
            if let Err(e) = old.execute("quit", json!({})) {
                // It may close the monitor before it answers.
                tracing::debug!(error = %e, "quit on the old QEMU");
            }
        }
    }
}
