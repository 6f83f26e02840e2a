//! QEMU's side of `hugemem launch --restore NAME -- qemu-system-x86_64 …`.
//!
//! QEMU must map the parked memory from its command line, so the daemon's
//! RESTORE starts *before* QEMU: the launcher plays the receiver of the
//! daemon's local migration (`Start → MemoryFd ×N → Config → State →
//! Complete`, `parked.rs` for the documents) and leaves `Complete`
//! unanswered. QEMU starts on the received fds with the same
//! `memory-backend-file` options as at the park, two monitors of the
//! launcher's (one for the restore, one for updates and the next park) and
//! `-incoming defer`. Once it runs, the receiver sets `x-ignore-shared`,
//! has it `migrate-incoming fd:N`, feeds it the parked device state and
//! waits for its RESUME event; only then does it answer `Complete` OK, and
//! the daemon hands the allocation to the RESTORE's connection. Any
//! failure answers `Complete` with an error: the VM stays parked.
//!
//! A copy clone (`--clone-of NAME --clone-mode copy`) is the same with
//! RESTORE's COPY: the daemon sends fresh pool memory, filled from the
//! template before anything is sent (eager: QEMU has no postcopy restore
//! through hugemem), and the template stays parked. A shared clone starts
//! the same way on the template's memory mapped privately (`clone.rs`).
//!
//! The command line: left out (`-- qemu-system-x86_64` alone), the parked
//! one is reused; given, it must name what the parked one named where QEMU
//! would refuse the state otherwise (machine, accelerator, CPU, vCPUs,
//! devices, NUMA, objects, globals). A mismatch is said before QEMU starts.

use std::error::Error;
use std::ffi::OsString;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

use ch_migration::peer::{answer_complete, receive_until_complete, Snapshot};
use ch_migration::Limits;
use hugemem_client::client::{Allocation, Client, ClientError};
use hugemem_client::park::RestoreOptions;
use serde_json::json;

use super::command_line::Sharing;
use super::parked::{ParkedConfig, ParkedState};
use super::qmp::{is_event, monitor_args_as, Qmp};
use super::switch::QemuSwitch;
use crate::launch::command_line::{MemoryFile, MemoryRegion};
use crate::launch::config::LaunchConfig;
use crate::launch::error::{LaunchError, Unsupported};
use crate::launch::update::VmmSwitch;
use crate::launch::vmm::adapter::{RestoreLaunch, RestoreReceiver, VmmRestore};

/// The restore monitor's chardev id (the update's is `hm-qmp`).
const RESTORE_MONITOR: &str = "hm-qmp-restore";

/// QEMU restores parked QEMU VMs.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct QemuRestore;

/// The daemon's RESTORE, running on a thread of its own while QEMU starts.
type PendingRestore = mpsc::Receiver<(Result<Allocation, ClientError>, Client)>;

/// The options whose values must be the parked VM's.
const SAME_AS_PARKED: &[&str] = &[
    "-M",
    "-machine",
    "-accel",
    "-enable-kvm",
    "-cpu",
    "-smp",
    "-device",
    "-numa",
    "-object",
    "-global",
];

/// The options of `args` that must match the parked VM's, with their values.
fn significant(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let key =
            a.strip_prefix('-').map_or(
                a.as_str(),
                |k| {
                    if k.starts_with('-') {
                        &a[1..]
                    } else {
                        a
                    }
                },
            );
        let (key, inline) = key
            .split_once('=')
            .map_or((key, None), |(k, v)| (k, Some(v)));
        let key = if key == "-M" { "-machine" } else { key };
        if SAME_AS_PARKED.contains(&key) {
            let value = match (key, inline) {
                ("-enable-kvm", _) => String::new(),
                (_, Some(v)) => v.to_owned(),
                (_, None) => it.next().cloned().unwrap_or_default(),
            };
            out.push(format!("{key} {value}").trim_end().to_owned());
        }
    }
    out
}

/// The arguments to run: the parked ones when `given` is empty, else
/// `given`, once it names what the parked VM named where QEMU would refuse.
pub(super) fn arguments(parked: &[String], given: &[OsString]) -> Result<Vec<OsString>, String> {
    if given.is_empty() {
        return Ok(parked.iter().map(OsString::from).collect());
    }
    let given_text: Vec<String> = given
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let (was, now) = (significant(parked), significant(&given_text));
    if was != now {
        let missing: Vec<&String> = was.iter().filter(|o| !now.contains(o)).collect();
        let extra: Vec<&String> = now.iter().filter(|o| !was.contains(o)).collect();
        return Err(format!(
            "the command line does not describe the parked VM, and QEMU would refuse its \
             state: the parked VM ran with {was:?}, this command line has {now:?} (missing \
             {missing:?}, not parked {extra:?}, or in another order); leave the arguments \
             out to reuse the parked ones"
        ));
    }
    Ok(given.to_vec())
}

/// The received memory as QEMU's regions, by slot. QEMU maps each
/// region's file from its start (QEMU 7.2's `memory-backend-file` has no
/// `offset`), so each slot's one mapping must be the whole region at
/// offset 0 of its fd: a VM whose memory the daemon placed otherwise is
/// refused here rather than run on the wrong bytes.
fn regions(
    config: &ParkedConfig,
    memory: Vec<(u32, OwnedFd)>,
) -> Result<(Vec<MemoryRegion>, Vec<OwnedFd>), String> {
    let mappings = &config.memory_manager_data.guest_ram_mappings;
    for (slot, r) in (0u32..).zip(&config.regions) {
        let mut of_slot = mappings.iter().filter(|m| m.slot == slot);
        match (of_slot.next(), of_slot.next()) {
            (Some(m), None) if m.file_offset == 0 && m.size == r.size => {}
            _ => {
                return Err(format!(
                    "slot {slot}'s memory is not one whole region at the start of its file \
                     ({:?}); QEMU maps a region's file from its start",
                    mappings
                        .iter()
                        .filter(|m| m.slot == slot)
                        .collect::<Vec<_>>()
                ))
            }
        }
    }
    if mappings.len() != config.regions.len() {
        return Err(format!(
            "{} guest RAM mappings for {} regions",
            mappings.len(),
            config.regions.len()
        ));
    }
    let mut fds: Vec<Option<OwnedFd>> = (0..config.regions.len()).map(|_| None).collect();
    for (slot, fd) in memory {
        let cell = usize::try_from(slot)
            .ok()
            .and_then(|s| fds.get_mut(s))
            .ok_or_else(|| format!("memory for slot {slot}, which the VM does not have"))?;
        *cell = Some(fd);
    }
    let fds: Vec<OwnedFd> = fds
        .into_iter()
        .enumerate()
        .map(|(i, fd)| fd.ok_or_else(|| format!("no memory for slot {i}")))
        .collect::<Result<_, _>>()?;
    let regions = config
        .regions
        .iter()
        .zip(&fds)
        .map(|(r, fd)| MemoryRegion {
            size: r.size,
            node: r.node,
            file: MemoryFile::Fd(fd.as_raw_fd()),
        })
        .collect();
    Ok((regions, fds))
}

impl VmmRestore for QemuRestore {
    fn prepare(&self, cfg: &LaunchConfig, _private: &Path) -> Result<RestoreLaunch, LaunchError> {
        let unsupported = |what| LaunchError::from(Unsupported { vmm: "QEMU", what });
        if cfg.on_demand {
            return Err(unsupported("launch --restore --on-demand"));
        }
        if cfg.hugetlbfs {
            return Err(unsupported(
                "launch --restore --hugetlbfs (a restore maps the daemon's fds)",
            ));
        }
        // A copy clone: RESTORE with COPY of its template (eager).
        let copy = cfg.clone_of.is_some();
        if copy {
            // A command line given is checked before the daemon copies.
            let given = super::identity::text(&cfg.command[1..]);
            super::identity::clone_identity(&given, false, false).map_err(LaunchError::Options)?;
        }
        let name = cfg
            .clone_of
            .clone()
            .or_else(|| cfg.restore.clone())
            .ok_or_else(|| LaunchError::Options("--restore needs a name".into()))?;
        let mut client = Client::connect(&cfg.socket)?;
        let (ours, daemons) = UnixStream::pair()
            .map_err(|e| LaunchError::Options(format!("cannot make a socket pair: {e}")))?;
        let (done_tx, done_rx) = mpsc::channel();
        // The launcher blocked the signals it forwards before this thread
        // starts (`launch::run`): it never takes a SIGTERM meant for QEMU.
        let asked = name.clone();
        std::thread::spawn(move || {
            let how = RestoreOptions {
                copy,
                ..RestoreOptions::default()
            };
            let answer = client.restore_with(&asked, &daemons, how);
            drop(daemons);
            let _ = done_tx.send((answer, client));
        });
        let snapshot = match receive_until_complete(&ours, Limits::default()) {
            Ok(s) => s,
            Err(e) => {
                drop(ours);
                // The daemon's refusal says more than the broken exchange.
                return Err(match done_rx.recv() {
                    Ok((Err(refused), _)) => LaunchError::Client(refused),
                    _ => LaunchError::Options(format!("the daemon's RESTORE: {e}")),
                });
            }
        };
        match launch_on(cfg, snapshot, Sharing::Shared) {
            Ok(mut on) => {
                for line in &on.replaced {
                    tracing::info!(name = %name, replaced = %line, "the copy clone holds its own in place of the template's");
                    eprintln!("hugemem launch: clone of {name}: {line}");
                }
                on.receiver.daemon = Some(ours);
                on.receiver.pending = Some(done_rx);
                Ok(RestoreLaunch {
                    argv: on.argv,
                    inherit: on.inherit,
                    receiver: Box::new(on.receiver),
                    update: on.update,
                })
            }
            Err(e) => {
                // The VM stays parked.
                let _ = answer_complete(&ours, false);
                drop(ours);
                let _ = done_rx.recv();
                Err(e)
            }
        }
    }
}

/// What [`launch_on`] makes: QEMU's command line and what it inherits.
pub(super) struct QemuOn {
    /// The argv, program first.
    pub(super) argv: Vec<OsString>,
    /// The fds QEMU inherits.
    pub(super) inherit: Vec<OwnedFd>,
    /// What feeds it the parked state.
    pub(super) receiver: QemuReceiver,
    /// Its update switch (`--control-socket`, a restore's or a copy's).
    pub(super) update: Option<Box<dyn VmmSwitch>>,
    /// For a clone: what it holds in place of its template's, one line a
    /// device.
    pub(super) replaced: Vec<String>,
}

/// QEMU's command line on the received snapshot, its memory mapped as
/// `sharing` says (a shared clone's: privately).
pub(super) fn launch_on(
    cfg: &LaunchConfig,
    snapshot: Snapshot,
    sharing: Sharing,
) -> Result<QemuOn, LaunchError> {
    let opt = LaunchError::Options;
    let parked = ParkedConfig::parse(&snapshot.config).map_err(|e| opt(e.to_string()))?;
    let stream = ParkedState::stream(&snapshot.state).map_err(|e| opt(e.to_string()))?;
    let program = cfg
        .command
        .first()
        .cloned()
        .ok_or_else(|| opt("no VMM command given after --".into()))?;
    let args = arguments(&parked.args, &cfg.command[1..]).map_err(opt)?;
    let replaced = match cfg.clone_of {
        Some(_) => {
            let text = super::identity::text(&args);
            let shared = sharing != Sharing::Shared;
            let writable = sharing == Sharing::Private { rom: false };
            super::identity::clone_identity(&text, shared, writable).map_err(opt)?
        }
        None => Vec::new(),
    };
    let (regions, memory) = regions(&parked, snapshot.memory).map_err(opt)?;
    let pair = || UnixStream::pair().map_err(|e| opt(format!("cannot make a socket pair: {e}")));
    let (monitor, monitor_theirs) = pair()?;
    let (channel, channel_theirs) = pair()?;
    let mut argv = vec![program];
    argv.extend(super::command_line::build_as(&args, &regions, sharing)?);
    argv.extend(monitor_args_as(RESTORE_MONITOR, monitor_theirs.as_raw_fd()).map(OsString::from));
    argv.extend(["-incoming".into(), "defer".into()]);
    let mut inherit = memory;
    inherit.extend([OwnedFd::from(monitor_theirs), OwnedFd::from(channel_theirs)]);
    let incoming = inherit.last().map_or(-1, AsRawFd::as_raw_fd);
    let update = match cfg.control {
        Some(_) if sharing == Sharing::Shared => {
            let (switch, fd) =
                QemuSwitch::for_launch(&mut argv, &args, cfg.build_options(), cfg.update_timeout)
                    .map_err(|e| opt(format!("cannot set up live updates: {e}")))?;
            inherit.push(fd);
            Some(Box::new(switch) as Box<dyn VmmSwitch>)
        }
        _ => None,
    };
    let receiver = QemuReceiver {
        monitor: Some(monitor),
        qmp: Mutex::new(None),
        channel: Some(channel),
        incoming,
        stream,
        daemon: None,
        pending: None,
        deadline: cfg.update_timeout,
    };
    Ok(QemuOn {
        argv,
        inherit,
        receiver,
        update,
        replaced,
    })
}

/// The receiving half: the new QEMU's restore monitor and incoming
/// channel, the parked state, the daemon's RESTORE waiting on `Complete`.
pub(super) struct QemuReceiver {
    monitor: Option<UnixStream>,
    qmp: Mutex<Option<Qmp>>,
    /// The launcher's end of the incoming channel.
    channel: Option<UnixStream>,
    /// QEMU's end's number.
    incoming: RawFd,
    /// QEMU's parked migration stream.
    stream: Vec<u8>,
    /// The daemon's RESTORE peer, its `Complete` unanswered.
    daemon: Option<UnixStream>,
    pending: Option<PendingRestore>,
    deadline: Duration,
}

/// Why QEMU did not take the parked VM.
#[derive(Debug, thiserror::Error)]
#[error("QEMU did not take the parked VM: {0}")]
pub(super) struct NotTaken(String);

impl QemuReceiver {
    /// After a failed start: has QEMU quit.
    pub(super) fn quit(&self) {
        if let Some(qmp) = self.qmp.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            let _ = qmp.execute("quit", json!({}));
        }
    }

    /// Has QEMU load the parked state and run the guest.
    pub(super) fn run_guest(&mut self) -> Result<(), NotTaken> {
        let fail = |what: &str, e: &dyn std::fmt::Display| NotTaken(format!("{what}: {e}"));
        let monitor = self
            .monitor
            .take()
            .ok_or_else(|| NotTaken("no monitor".into()))?;
        let mut qmp = Qmp::handshake(monitor, self.deadline)
            .map_err(|e| fail("its monitor (did it start?)", &e))?;
        let caps = json!({"capabilities": [
            {"capability": "x-ignore-shared", "state": true},
            {"capability": "events", "state": true},
        ]});
        let setup = qmp.execute("migrate-set-capabilities", caps).and_then(|_| {
            qmp.execute(
                "migrate-incoming",
                json!({"uri": format!("fd:{}", self.incoming)}),
            )
        });
        if let Err(e) = setup {
            *self.qmp.lock().unwrap_or_else(|p| p.into_inner()) = Some(qmp);
            return Err(fail("setting up the incoming migration", &e));
        }
        let channel = self
            .channel
            .take()
            .ok_or_else(|| NotTaken("no channel".into()))?;
        let stream = std::mem::take(&mut self.stream);
        // QEMU reads as it loads: the state goes on a thread of its own.
        let feeder = std::thread::spawn(move || {
            let written = (&channel).write_all(&stream);
            let _ = channel.shutdown(std::net::Shutdown::Write);
            written
        });
        let event = qmp.wait_event(|e| {
            is_event(e, "RESUME", &[]) || is_event(e, "MIGRATION", &["failed", "cancelled"])
        });
        let fed = feeder.join();
        let result = match event {
            Ok(e) if is_event(&e, "RESUME", &[]) => Ok(()),
            Ok(e) => Err(NotTaken(format!("its migration {e}"))),
            Err(e) => Err(fail("waiting for it to run the guest", &e)),
        };
        *self.qmp.lock().unwrap_or_else(|p| p.into_inner()) = Some(qmp);
        match fed {
            Ok(Err(e)) if result.is_err() => Err(fail("feeding it the state", &e)),
            _ => result,
        }
    }
}

impl RestoreReceiver for QemuReceiver {
    fn receive(
        &mut self,
        client: &mut Client,
        _name: &str,
        _on_demand: bool,
    ) -> Result<Allocation, Box<dyn Error + Send + Sync>> {
        let daemon = self
            .daemon
            .take()
            .ok_or_else(|| NotTaken("no RESTORE".into()))?;
        let pending = self
            .pending
            .take()
            .ok_or_else(|| NotTaken("no RESTORE".into()))?;
        let ran = self.run_guest();
        // The daemon hands the allocation over only on an OK `Complete`.
        let answered = answer_complete(&daemon, ran.is_ok());
        drop(daemon);
        let (restored, own) = pending
            .recv_timeout(self.deadline)
            .map_err(|_| NotTaken("the daemon did not answer the RESTORE".into()))?;
        ran?;
        answered?;
        // The RESTORE's connection owns the allocation: the launcher
        // watches it from here on.
        *client = own;
        Ok(restored?)
    }

    fn stop(&self) {
        self.quit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_parked_command_line_is_reused_or_checked() {
        let parked = strings(&[
            "-M", "microvm", "-accel", "kvm", "-kernel", "/a", "-display", "none",
        ]);
        let reused = arguments(&parked, &[]).expect("reused");
        assert_eq!(reused.len(), parked.len());
        let same: Vec<OsString> = ["-machine=microvm", "--accel", "kvm", "-kernel", "/b"]
            .iter()
            .map(OsString::from)
            .collect();
        assert!(
            arguments(&parked, &same).is_ok(),
            "other kernel, display: fine"
        );
        let other: Vec<OsString> = ["-M", "q35", "-accel", "kvm"]
            .iter()
            .map(OsString::from)
            .collect();
        let err = arguments(&parked, &other).expect_err("another machine");
        assert!(
            err.contains("-machine microvm") && err.contains("q35"),
            "{err}"
        );
        let device: Vec<OsString> = [
            "-M",
            "microvm",
            "-accel",
            "kvm",
            "-device",
            "virtio-rng-device",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        assert!(arguments(&parked, &device).is_err(), "a device more");
    }

    #[test]
    fn a_slot_not_at_the_start_of_its_file_is_refused() {
        use super::super::parked::ParkedRegion;
        let region = |size| ParkedRegion { size, node: None };
        let mut config = ParkedConfig::new(
            &"qemu-system-x86_64".into(),
            &[],
            vec![region(2 << 20), region(4 << 20)],
        )
        .expect("config");
        let fds = || -> Vec<(u32, OwnedFd)> {
            (0..2)
                .map(|slot| {
                    let file = std::fs::File::open("/dev/null").expect("open");
                    (slot, OwnedFd::from(file))
                })
                .collect()
        };
        let (regions_ok, _) = regions(&config, fds()).expect("whole regions");
        assert_eq!(regions_ok.len(), 2);
        // As a load of two memory files places the second: 1 GiB into the
        // one region both slots' fds are.
        config.memory_manager_data.guest_ram_mappings[1].file_offset = 1 << 30;
        let err = regions(&config, fds()).expect_err("slot 1 at an offset");
        assert!(err.contains("slot 1"), "{err}");
        config.memory_manager_data.guest_ram_mappings.pop();
        let err = regions(&config, fds()).expect_err("slot 1 unmapped");
        assert!(err.contains("slot 1"), "{err}");
    }
}
