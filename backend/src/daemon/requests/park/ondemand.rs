//! A postcopy RESTORE: the VM runs in its new cloud-hypervisor from the
//! receiver's `Complete`, while memory not filled yet (a VM parked on
//! demand from a directory; a copy clone's fresh memory, filled from its
//! template: `clone_copy.rs`) is filled as the receiver asks for it on its
//! fault connection (`PageFault`, one huge page at a time), and in the
//! background, in guest-address order, by the fill engine. Each slot's
//! fault is filled in the region its fd describes ([`FillTarget`]). Each unit is
//! filled exactly once whoever gets there first (its page state is the
//! claim, as in the lazy mode); a fault on a unit the background is
//! filling waits for it (`UnitsDone`: the background filler says when
//! each unit is done, nobody spins).
//!
//! The receiver never sees a page before it is filled: in postcopy mode
//! cloud-hypervisor maps nothing of the memory fds until it asked for the
//! page and was answered (userfaultfd MINOR mode, `UFFDIO_CONTINUE`). The
//! zones are declared hugetlb in the configuration sent (cloud-hypervisor
//! takes the fault size from it), and the RESTORE's reply comes once every
//! unit is filled and the receiver closed its fault connection (it had
//! every page): the allocation is handed out only then, so no fill ever
//! runs on memory that is no longer the parked VM's (or the copy's). A
//! fault connection that ends with an error while a copy clone's memory was
//! left to fill instead fails the RESTORE: its guest could never get the
//! pages it did not take (`fault_connection_ended`). A VM parked on demand
//! keeps the earlier rule (the restore stands): a user who stops its VMM
//! while the fill goes on ends the connection the same way.
//!
//! `Complete` goes out only once every `PageFault` the receiver sent by
//! then is answered (`ch_migration::in_flight`): cloud-hypervisor asks for
//! the guest's first page when the state comes, and a guest resumed with
//! that request still unanswered was seen to die on `kvm_pvm`
//! (docs/operations.md, "Clones").

use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};

use ch_migration::fault::{
    announce_fault_connection, serve_page_faults_tracked, FaultRequest, FaultServeError,
    FaultServeStats,
};
use ch_migration::in_flight::InFlight;
use ch_migration::layout::{migration_config_slots, with_hugetlb_zones};
use ch_migration::peer::send_snapshot_steps;
use ch_migration::ChMigrationError;
use guest_mem::{
    fill_region_planned, fill_unit, FillCounts, FillOptions, FillPlan, PageState, Region, UnitFill,
};
use numa::Topology;
use tracing::{info, warn};

use super::error::StepError;
use super::socket::MIGRATION_IO_TIMEOUT;
use crate::daemon::requests::parked::loads::{LoadFailed, PendingLoad};

/// One region a postcopy restore sends (each slot's fd describes one), and
/// what fills it.
pub struct FillTarget<'a> {
    /// The region.
    pub region: &'a Region,
    /// Its fill plan (no sources: nothing to read, for memory that holds
    /// the VM's bytes already).
    pub plan: FillPlan<'a>,
}

/// What a postcopy restore sends and fills.
pub struct Postcopy<'a> {
    /// The receiver's migration connection.
    pub main: &'a UnixStream,
    /// Its fault connection (not announced yet).
    pub fault: &'a UnixStream,
    /// Each slot and its fd.
    pub memory: &'a [(u32, BorrowedFd<'a>)],
    /// The parked configuration.
    pub config: &'a [u8],
    /// The parked state.
    pub state: &'a [u8],
    /// End with `CompletePaused`.
    pub paused: bool,
    /// The regions the slots' fds describe, each with its plan.
    pub targets: &'a [FillTarget<'a>],
    /// Which target each slot's fd is: (slot, index in `targets`).
    pub slot_targets: &'a [(u32, usize)],
    /// Something is left to fill (false: every page holds the VM's bytes).
    pub to_fill: bool,
    /// A fault connection that ends with an error while something is left
    /// to fill fails the RESTORE (a copy clone: the copy is released).
    /// False for a VM parked on demand: its guest ran on that memory from
    /// `Complete`, and a VMM its user stops while the fill goes on ends the
    /// connection the same way; the restore stands, as with a clean close.
    pub broken_fault_fails: bool,
    /// The targets' bytes were all zero before the fill (nothing to zero).
    pub dest_is_zero: bool,
    /// The files of a VM parked on demand (they name a failed read).
    pub pending: Option<&'a PendingLoad>,
    /// The host's nodes (the fill engine's workers).
    pub topology: &'a Topology,
    /// What the log lines call it.
    pub what: &'static str,
    /// Called once every unit is filled (nothing is read from the sources
    /// after it): a copy clone lets go of its template there.
    pub on_filled: &'a (dyn Fn() + Sync),
}

/// What serving the fault connection came to.
type FaultServed = Result<FaultServeStats, FaultServeError<FaultFillError>>;

/// Why a unit could not be filled for a fault.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct FaultFillError(String);

/// Says when units leave `Clearing`: each filler calls [`UnitsDone::notify`]
/// after each unit it finished (the background through
/// `FillOptions::unit_done`), so that a fault on a unit another filler holds, and
/// the wait for the last units, block until then instead of spinning.
#[derive(Default)]
struct UnitsDone {
    lock: Mutex<()>,
    done: Condvar,
}

impl UnitsDone {
    /// Some unit left `Clearing` (filled, or back to `Dirty` on an error).
    fn notify(&self) {
        let _held = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.done.notify_all();
    }

    /// Blocks until `ready()`, checked under the lock: a filler's state
    /// change comes before its `notify`, so no wake-up is missed.
    fn wait_until(&self, ready: impl Fn() -> bool) {
        let mut held = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        while !ready() {
            held = self.done.wait(held).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Notifies its [`UnitsDone`] when dropped.
struct WakeOnDrop<'a>(&'a UnitsDone);

impl Drop for WakeOnDrop<'_> {
    fn drop(&mut self) {
        self.0.notify();
    }
}

/// True when some unit of `region` is held by a filler.
fn any_clearing(region: &Region) -> bool {
    let states = region.states();
    (0..states.len()).any(|u| matches!(states.get(u), Ok(PageState::Clearing)))
}

/// What a fault's fill works with.
struct FaultFill<'a> {
    targets: &'a [FillTarget<'a>],
    slot_targets: &'a [(u32, usize)],
    opts: &'a FillOptions<'a>,
    units_done: &'a UnitsDone,
    /// What is left to fill (its files and checksums name a failure).
    pending: Option<&'a PendingLoad>,
    /// Bytes checked against their checksums by faults.
    verified: AtomicU64,
}

impl FaultFill<'_> {
    /// A failed fill of target `target` as the tenant reads it: the file
    /// named.
    fn describe(&self, target: usize, e: &guest_mem::FillError) -> LoadFailed {
        match self.pending {
            Some(p) => p.describe(target, e),
            None => LoadFailed(hugemem_client::diag::chain(e)),
        }
    }

    /// The region slot `slot`'s fd describes, with its plan, and its
    /// index in the targets.
    fn target_of(&self, slot: u32) -> Result<(usize, &FillTarget<'_>), FaultFillError> {
        self.slot_targets
            .iter()
            .find(|(s, _)| *s == slot)
            .and_then(|(_, t)| Some((*t, self.targets.get(*t)?)))
            .ok_or_else(|| FaultFillError(format!("slot {slot} has no memory fd")))
    }
}

/// Fills the units that hold `[offset, offset + len)` of the region slot
/// `slot`'s fd describes, waiting for any another thread is filling.
fn fill_range(f: &FaultFill<'_>, slot: u32, offset: u64, len: u64) -> Result<(), FaultFillError> {
    let (index, target) = f.target_of(slot)?;
    let (region, units_done) = (target.region, f.units_done);
    let end = offset.checked_add(len.max(1));
    if end.is_none_or(|end| end > region.len()) {
        return Err(FaultFillError(format!(
            "{len:#x} bytes at {offset:#x} are outside slot {slot}'s memory ({:#x} bytes)",
            region.len()
        )));
    }
    let unit = region.state_unit();
    let first = usize::try_from(offset / unit).map_err(|e| FaultFillError(e.to_string()))?;
    let last = usize::try_from((offset + len.max(1) - 1) / unit)
        .map_err(|e| FaultFillError(e.to_string()))?;
    for u in first..=last {
        loop {
            let outcome = fill_unit(region, &target.plan, u, f.opts);
            if !matches!(outcome, Ok(UnitFill::Busy | UnitFill::Done(_))) {
                // This thread's unit left `Clearing`, filled or not.
                units_done.notify();
            }
            let outcome = outcome.map_err(|e| FaultFillError(f.describe(index, &e).0))?;
            if let UnitFill::Filled(counts) = outcome {
                f.verified
                    .fetch_add(counts.bytes_verified, Ordering::Relaxed);
            }
            match outcome {
                UnitFill::Filled(_) | UnitFill::Done(_) => break,
                // The background filler holds it: done within one unit's
                // read, and it says so.
                UnitFill::Busy => units_done
                    .wait_until(|| !matches!(region.states().get(u), Ok(PageState::Clearing))),
            }
        }
    }
    Ok(())
}

/// True when no unit of `region` is left to fill: each is `Clean` (filled)
/// or `Mapped`.
pub fn all_filled(region: &Region) -> bool {
    let states = region.states();
    (0..states.len()).all(|u| matches!(states.get(u), Ok(PageState::Clean | PageState::Mapped)))
}

/// Fills every target in turn (the background fill); what it read, or
/// the index of the target that failed and why.
fn fill_targets(
    topology: &Topology,
    targets: &[FillTarget<'_>],
    opts: &FillOptions<'_>,
) -> Result<(FillCounts, usize, usize), (usize, guest_mem::FillError)> {
    let (mut counts, mut units, mut threads) = (FillCounts::default(), 0, 0);
    for (i, t) in targets.iter().enumerate() {
        let report = fill_region_planned(topology, t.region, &t.plan, opts).map_err(|e| (i, e))?;
        counts += report.counts;
        units += report.units_filled;
        threads = threads.max(report.threads);
    }
    Ok((counts, units, threads))
}

/// Runs a postcopy restore (see the module docs): returns once the receiver
/// answered the last step, every unit is filled and the fault connection
/// ended. Returns the bytes checked against a manifest's checksums.
///
/// # Errors
///
/// The receiver's refusal, a fill that failed, the configuration.
pub fn send(p: Postcopy<'_>) -> Result<u64, StepError> {
    let first = p.targets.first().ok_or(StepError::NoMemory)?;
    let page = first.region.page_size().bytes();
    let config = if page > 4096 {
        with_hugetlb_zones(p.config, page).map_err(StepError::failed("the VM's configuration"))?
    } else {
        p.config.to_vec()
    };
    let slots =
        migration_config_slots(&config, 64).map_err(StepError::failed("the VM's configuration"))?;
    let opts = FillOptions {
        dest_is_zero: p.dest_is_zero,
        ..FillOptions::default()
    };
    let units_done = UnitsDone::default();
    let notify = |_unit: usize| units_done.notify();
    // Each unit the background fill is done with wakes the faults waiting.
    let background_opts = FillOptions {
        unit_done: Some(&notify),
        ..opts
    };
    let faults = FaultFill {
        targets: p.targets,
        slot_targets: p.slot_targets,
        opts: &opts,
        units_done: &units_done,
        pending: p.pending,
        verified: AtomicU64::new(0),
    };
    let every_filled = || p.targets.iter().all(|t| all_filled(t.region));
    let mut verified = 0;
    let filled = AtomicBool::new(!p.to_fill || every_filled());
    // At once: the receiver reads the role of a connection it accepted
    // within seconds, whenever its accept loop gets to it.
    announce_fault_connection(p.fault).map_err(|e| StepError::FaultConnectionNotTaken(e.into()))?;
    let what = p.what;
    let in_flight = InFlight::default();
    std::thread::scope(|scope| {
        let mut fault_thread = None;
        let mut background = None;
        let start_serving = || {
            let (filled, slots, faults) = (&filled, &slots, &faults);
            let (units_done, background_opts) = (&units_done, &background_opts);
            let in_flight = &in_flight;
            fault_thread = Some(scope.spawn(move || {
                serve_page_faults_tracked(p.fault, slots, in_flight, |req: FaultRequest| {
                    if filled.load(Ordering::Acquire) {
                        return Ok(());
                    }
                    fill_range(faults, req.slot, req.file_offset, req.length)
                })
            }));
            if !filled.load(Ordering::Acquire) {
                background = Some(scope.spawn(move || {
                    // However it ends (a unit it failed on left `Clearing`
                    // without a report; a panic), waiters look again.
                    let _wake = WakeOnDrop(units_done);
                    fill_targets(p.topology, p.targets, background_opts)
                }));
            }
            Ok(())
        };
        let answered = || all_answered(&in_flight, p.fault);
        let sent = send_snapshot_steps(
            p.main,
            p.memory,
            (&config, p.state),
            p.paused,
            (start_serving, answered),
        );
        if let Err(e) = sent {
            // The receiver may hold the fault connection open: end its thread.
            let _ = p.fault.shutdown(std::net::Shutdown::Both);
            return Err(StepError::not_taken(e));
        }
        // A fill that failed ends the fault connection at once: the
        // receiver's next fault fails (cloud-hypervisor then stops the VM)
        // instead of waiting for its own prefault to reach the page.
        let give_up = |why: StepError| {
            let _ = p.fault.shutdown(std::net::Shutdown::Both);
            Err(why)
        };
        if let Some(bg) = background {
            match bg.join() {
                Ok(Ok((counts, units, threads))) => {
                    verified += counts.bytes_verified;
                    info!(
                        read = counts.bytes_read,
                        units, threads, "{what}: background fill done"
                    );
                }
                Ok(Err((target, e))) => {
                    return give_up(StepError::Fill(faults.describe(target, &e)));
                }
                Err(_) => return give_up(StepError::Panicked("background fill")),
            }
            // Units a fault was filling as the background passed them.
            units_done.wait_until(|| !p.targets.iter().any(|t| any_clearing(t.region)));
            if !every_filled() {
                return give_up(StepError::FaultFill);
            }
            filled.store(true, Ordering::Release);
            (p.on_filled)();
        }
        if let Some(t) = fault_thread {
            fault_connection_ended(t.join(), what, p.to_fill && p.broken_fault_fails)?;
        }
        Ok(verified + faults.verified.load(Ordering::Relaxed))
    })
}

/// Before `Complete`: the receiver asked for the guest's first page when
/// the state came, and its guest resumes only once that (and whatever
/// else it asked for by then) is answered (see the module docs).
fn all_answered(in_flight: &InFlight, fault: &UnixStream) -> Result<(), ChMigrationError> {
    if in_flight.wait_answered(fault, MIGRATION_IO_TIMEOUT) {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "its fault connection never stopped asking for pages",
    )
    .into())
}

/// How the fault thread ended. The receiver closes its fault connection
/// once it mapped every page (or as its process ends). A connection that
/// ended with an error (a broken socket: the receiver reset its VM; a
/// refused request) while a copy clone's memory was left to fill
/// (`to_fill`) leaves a guest that can never get the pages it did not
/// take: the restore fails, its launcher then stops the VMM, and the copy
/// is released. Memory that held every byte
/// already (a VM parked in the pool) was the receiver's from `Complete`:
/// its guest ran on it and may have written it, so it must not stay parked
/// beside its old state; the restore stands, as with a clean close.
fn fault_connection_ended(
    joined: std::thread::Result<FaultServed>,
    what: &str,
    to_fill: bool,
) -> Result<(), StepError> {
    match joined {
        Ok(Ok(stats)) => {
            info!(
                faults = stats.faults,
                bytes = stats.bytes,
                "{what}: fault connection ended"
            );
            Ok(())
        }
        Ok(Err(e)) if to_fill => {
            warn!(error = %e, "{what}: the fault connection ended with an error before the receiver had every page; the restore fails");
            Err(StepError::FaultConnectionBroken(e.into()))
        }
        Ok(Err(e)) => {
            warn!(error = %e, "{what}: the fault connection ended with an error; the VM's memory held every page and its guest ran on it from Complete, so the restore stands");
            Ok(())
        }
        Err(_) => Err(StepError::Panicked("fault thread")),
    }
}

/// Fills every region of `regions` (the allocation's, in order) from
/// `pending` before a restore without postcopy, or a save; returns the
/// bytes checked against a manifest.
///
/// # Errors
///
/// The fill's failure.
pub fn fill_all(
    topology: &Topology,
    regions: &[std::sync::Arc<Region>],
    pending: &PendingLoad,
) -> Result<u64, StepError> {
    if pending.regions() > regions.len() {
        return Err(StepError::FillRegions {
            files: pending.regions(),
            holds: regions.len(),
        });
    }
    let opts = FillOptions {
        dest_is_zero: pending.dest_is_zero,
        ..FillOptions::default()
    };
    let mut verified = 0;
    for (i, region) in regions.iter().enumerate() {
        let plan = pending.plan(i, region).map_err(StepError::Fill)?;
        let report = fill_region_planned(topology, region, &plan, &opts)
            .map_err(|e| StepError::Fill(pending.describe(i, &e)))?;
        if !all_filled(region) {
            return Err(StepError::StillFilling);
        }
        verified += report.counts.bytes_verified;
    }
    Ok(verified)
}
