//! What the hugemem side and the floor share: watching the guest across one
//! update on its own pages, and adding the update to an [`UpdateSeries`].

use std::time::Duration;

use microguest::SpinState;

use super::error::VmmUpdateError;
use super::guest::{gap_within, GuestRam, HostClock};
use super::report::{median, UpdateSeries};
use super::setup::{idle_gap, HOST_CHECK_END, MARKER, START_GPA, STRIDE};

/// One update, as [`UpdateSeries::push`] takes it.
pub(crate) struct OneUpdate {
    /// The guest's state once it counts on under the new QEMU.
    pub(crate) guest: SpinState,
    /// The guest's recorded gap overlapping the switch, TSC ticks.
    pub(crate) switch_gap_ticks: Option<u64>,
    /// The new QEMU's start (or the request) to the old QEMU gone, ms.
    pub(crate) update_ms: f64,
    /// `migrate` to RESUME, ms.
    pub(crate) switch_ms: f64,
    /// QEMU's downtime figure, ms.
    pub(crate) qemu_downtime_ms: u64,
    /// RAM bytes the migration sent.
    pub(crate) ram_transferred_bytes: u64,
}

impl OneUpdate {
    /// "N ms, guest paused N ms, N RAM bytes sent": a progress line's tail.
    pub(crate) fn summary(&self, tsc_hz: f64) -> String {
        format!(
            "{:.1} ms, guest paused {:.2} ms, {} RAM bytes sent",
            self.update_ms,
            self.guest.max_gap as f64 / tsc_hz * 1e3,
            self.ram_transferred_bytes
        )
    }
}

/// The guest's count in `ram` (the running VMM's) just before an update,
/// its largest gap zeroed so that the next read covers the update alone.
pub(crate) fn before_update(ram: &GuestRam) -> Result<u64, VmmUpdateError> {
    ram.reset_max_gap()?;
    Ok(ram.spin()?.count)
}

/// The guest in `ram` (the new VMM's) once it counts past `before`, and its
/// recorded gap overlapping the switch (`migrate_at_ns`..`resumed_at_ns`,
/// `CLOCK_MONOTONIC`, placed on the guest's clock through `clock`).
pub(crate) fn after_update(
    ram: &GuestRam,
    before: u64,
    clock: &HostClock,
    migrate_at_ns: u64,
    resumed_at_ns: u64,
) -> Result<(SpinState, Option<u64>), VmmUpdateError> {
    let now = ram.counting_past(before)?;
    let offset = ram.tsc_offset()?;
    let switch = gap_within(
        &now,
        clock.tsc_at(migrate_at_ns) - offset,
        clock.tsc_at(resumed_at_ns) - offset,
    );
    Ok((now, switch))
}

/// What the guest shows once the migrations are over.
pub(crate) struct Settled {
    /// The largest gap over an idle window, ms: the noise floor.
    pub(crate) idle_gap_ms: f64,
    /// Pages the host finds without the guest's value.
    pub(crate) stale_host: u64,
    /// Pages the guest found changed (its own check).
    pub(crate) stale_guest: u64,
}

/// The guest in `ram` (of `size` bytes) after its migrations: its largest
/// gap over an idle `window`, then the host's and the guest's stale pages.
pub(crate) fn settled(
    ram: &GuestRam,
    size: u64,
    window: Duration,
    tsc_hz: f64,
) -> Result<Settled, VmmUpdateError> {
    let idle_gap_ms = idle_gap(ram, window, tsc_hz)? * 1e3;
    let stale_host = ram.stale_pages(
        START_GPA.max(microguest::IMAGE_END_GPA),
        size.min(HOST_CHECK_END),
        STRIDE,
        MARKER,
    )?;
    Ok(Settled {
        idle_gap_ms,
        stale_host,
        stale_guest: ram.spin()?.bad,
    })
}

impl UpdateSeries {
    /// `count` updates in a row from the VMM `first`: `update(vmm, step)`
    /// (steps from 1) moves the guest from `vmm` to a new VMM and gives it
    /// with the update's figures, each said on `progress` as `{what}
    /// {step}: …` and added here. Returns the last VMM.
    pub(crate) fn in_a_row<V>(
        &mut self,
        count: usize,
        (what, tsc_hz): (&str, f64),
        first: V,
        progress: &mut dyn FnMut(&str),
        mut update: impl FnMut(V, usize) -> Result<(V, OneUpdate), VmmUpdateError>,
    ) -> Result<V, VmmUpdateError> {
        let mut vmm = first;
        for step in 1..=count {
            let (next, one) = update(vmm, step)?;
            vmm = next;
            progress(&format!("{what} {step}: {}", one.summary(tsc_hz)));
            self.push(one, tsc_hz);
        }
        Ok(vmm)
    }

    /// Adds one update.
    pub(crate) fn push(&mut self, one: OneUpdate, tsc_hz: f64) {
        self.downtime_ms
            .push(one.guest.max_gap as f64 / tsc_hz * 1e3);
        self.switch_gap_ms
            .push(one.switch_gap_ticks.map(|t| t as f64 / tsc_hz * 1e3));
        self.update_ms.push(one.update_ms);
        self.switch_ms.push(one.switch_ms);
        self.qemu_downtime_ms.push(one.qemu_downtime_ms);
        self.ram_transferred_max_bytes = self
            .ram_transferred_max_bytes
            .max(one.ram_transferred_bytes);
        self.stale_guest = one.guest.bad;
        self.updates += 1;
    }

    /// The medians, and what the guest in `ram` (the last VMM's) shows
    /// after the last update: the largest gap over an idle window as long as the median
    /// update, pages the host finds without the guest's value, pages the
    /// guest found changed.
    pub(crate) fn finish(
        &mut self,
        ram: &GuestRam,
        size: u64,
        tsc_hz: f64,
    ) -> Result<(), VmmUpdateError> {
        self.downtime_median_ms = median(&self.downtime_ms);
        self.update_median_ms = median(&self.update_ms);
        let found: Vec<f64> = self.switch_gap_ms.iter().flatten().copied().collect();
        self.switch_gap_median_ms = (!found.is_empty()).then(|| median(&found));
        self.ram_transferred_max_pct = self.ram_transferred_max_bytes as f64 * 100.0 / size as f64;
        let window = Duration::from_secs_f64(self.update_median_ms / 1e3);
        let after = settled(ram, size, window, tsc_hz)?;
        self.idle_gap_ms = after.idle_gap_ms;
        self.stale_host = after.stale_host;
        self.stale_guest = after.stale_guest;
        Ok(())
    }
}
