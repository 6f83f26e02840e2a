//! Spin mode of the PVH guest ([`PvhConfig::spin`](crate::PvhConfig::spin)):
//! a guest that keeps running, for tests and benchmarks of what happens to a
//! *running* VM (a live update of its VMM, say).
//!
//! After it has touched its pages and written its report line, a spinning
//! guest does not power off. It re-reads every page it touched, forever, in
//! the same order, and for each page:
//!
//! * checks that the page still holds `marker ^ gpa` ([`crate::pattern`]);
//!   a page that does not is counted in [`SpinState::bad`] (its GPA in
//!   [`SpinState::bad_gpa`]): memory that did not survive whatever the host
//!   did to the VM;
//! * ticks: increments the 64-bit [`SpinState::count`], reads the TSC, and
//!   keeps the largest gap between two consecutive ticks
//!   ([`SpinState::max_gap`], in TSC ticks: the longest the guest was kept
//!   from running, as its own clock saw it) and a ring of the latest
//!   [`GAP_RING`] gaps of at least [`PvhConfig::gap_min_ticks`](crate::PvhConfig::gap_min_ticks).
//!
//! Everything lives in the guest's parameter block, at fixed guest-physical
//! addresses ([`SPIN_BLOCK_GPA`], [`SPIN_BLOCK_LEN`]): the host reads it
//! through its own view of guest RAM (a `pread` of the memory file at the
//! GPA, where guest RAM starts at file offset 0 as under QEMU microvm) and
//! needs no guest I/O. [`SpinState::parse`] decodes the bytes.
//!
//! A caveat on the guest's clock under QEMU/KVM: QEMU saves the guest's TSC
//! when it stops a VM and restores it when the VM runs again (on the same
//! or another QEMU after a migration), so a pause in which the VM was
//! *stopped* does not show as a TSC gap; only time in which the vCPU was
//! meant to run but did not (host preemption, a stop QEMU does not account
//! for) does. [`SpinState::tsc`] against the host's TSC shows the rest: the
//! guest's TSC falls behind the host's by the time it was stopped.

use crate::image;

/// Guest-physical address of the spin block (its first field, the spin flag).
pub const SPIN_BLOCK_GPA: u64 = image::LINK_BASE + (image::PARAMS + image::P_SPIN) as u64;
/// Bytes of the spin block, from [`SPIN_BLOCK_GPA`].
pub const SPIN_BLOCK_LEN: usize = image::P_GAPS + 16 * image::GAP_RING - image::P_SPIN;
/// Guest-physical address of the 64-bit iteration counter.
pub const COUNTER_GPA: u64 = image::LINK_BASE + (image::PARAMS + image::P_COUNT) as u64;
/// Guest-physical address of the largest gap ([`SpinState::max_gap`]); a
/// host may write 0 there to measure the largest gap from then on.
pub const MAX_GAP_GPA: u64 = image::LINK_BASE + (image::PARAMS + image::P_MAXGAP) as u64;
/// End of the guest's own image (code, parameter block, page tables,
/// stack) from [`crate::pvh`]'s load address 1 MiB: the guest neither
/// touches nor checks pages overlapping `[1 MiB, IMAGE_END_GPA)`.
pub const IMAGE_END_GPA: u64 = image::LINK_BASE + image::IMAGE_END as u64;
/// Entries in the ring of recent long gaps.
pub const GAP_RING: usize = image::GAP_RING;

/// One gap the guest recorded: its end and its length, in TSC ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    /// The guest TSC at the tick that ended the gap.
    pub end_tsc: u64,
    /// Ticks since the tick before.
    pub ticks: u64,
}

/// The spin block as the guest last wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpinState {
    /// Spin mode is on (the guest was built with it; the guest never writes it).
    pub spinning: bool,
    /// Iterations (one per page re-read, or per pass when no page is touched).
    pub count: u64,
    /// The guest TSC at the latest iteration.
    pub tsc: u64,
    /// The guest TSC when spinning started (0: not yet).
    pub start_tsc: u64,
    /// Largest gap between consecutive iterations, TSC ticks.
    pub max_gap: u64,
    /// Pages re-read with a value other than `marker ^ gpa`.
    pub bad: u64,
    /// The latest such page.
    pub bad_gpa: u64,
    /// Gaps put into the ring so far (the ring holds the latest [`GAP_RING`]).
    pub gaps_recorded: u64,
    /// The latest recorded gaps, oldest first.
    pub recent_gaps: Vec<Gap>,
}

fn field(block: &[u8], offset: usize) -> u64 {
    let at = offset - image::P_SPIN;
    let mut word = [0u8; 8];
    word.copy_from_slice(&block[at..at + 8]);
    u64::from_le_bytes(word)
}

impl SpinState {
    /// Decodes the [`SPIN_BLOCK_LEN`] bytes read from [`SPIN_BLOCK_GPA`];
    /// `None` when `block` is shorter.
    ///
    /// The guest writes while the host reads, so fields of one snapshot may
    /// come from neighbouring iterations; each field on its own is a value
    /// the guest wrote (aligned 8-byte stores are atomic on x86).
    pub fn parse(block: &[u8]) -> Option<Self> {
        if block.len() < SPIN_BLOCK_LEN {
            return None;
        }
        let recorded = field(block, image::P_NGAPS);
        let kept = recorded.min(GAP_RING as u64);
        let recent_gaps = (recorded - kept..recorded)
            .map(|n| {
                let at = image::P_GAPS + 16 * (n as usize % GAP_RING);
                Gap {
                    end_tsc: field(block, at),
                    ticks: field(block, at + 8),
                }
            })
            .collect();
        Some(Self {
            spinning: field(block, image::P_SPIN) != 0,
            count: field(block, image::P_COUNT),
            tsc: field(block, image::P_TSC),
            start_tsc: field(block, image::P_SPINTSC),
            max_gap: field(block, image::P_MAXGAP),
            bad: field(block, image::P_BAD),
            bad_gpa: field(block, image::P_BADGPA),
            gaps_recorded: recorded,
            recent_gaps,
        })
    }
}

// The counter and the largest gap are inside the block, and the block is in
// the loaded part of the image (below the page tables the PVH prologue builds).
const _: () = assert!(COUNTER_GPA > SPIN_BLOCK_GPA);
const _: () = assert!(MAX_GAP_GPA + 8 <= SPIN_BLOCK_GPA + SPIN_BLOCK_LEN as u64);
const _: () = assert!(COUNTER_GPA + 8 <= SPIN_BLOCK_GPA + SPIN_BLOCK_LEN as u64);
const _: () =
    assert!(SPIN_BLOCK_GPA + (SPIN_BLOCK_LEN as u64) <= image::LINK_BASE + image::FILE_END as u64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_decodes_with_the_ring_oldest_first() {
        let mut block = vec![0u8; SPIN_BLOCK_LEN];
        let mut put = |offset: usize, v: u64| {
            let at = offset - image::P_SPIN;
            block[at..at + 8].copy_from_slice(&v.to_le_bytes());
        };
        put(image::P_SPIN, 1);
        put(image::P_COUNT, 77);
        put(image::P_MAXGAP, 5000);
        // 18 gaps recorded: the ring holds gaps 2..18, gap n in slot n % 16.
        put(image::P_NGAPS, 18);
        for n in 2..18u64 {
            let slot = image::P_GAPS + 16 * (n as usize % GAP_RING);
            put(slot, 1000 + n);
            put(slot + 8, n);
        }
        let s = SpinState::parse(&block).expect("long enough");
        assert!(s.spinning);
        assert_eq!((s.count, s.max_gap, s.gaps_recorded), (77, 5000, 18));
        assert_eq!(s.recent_gaps.len(), GAP_RING);
        assert_eq!(
            s.recent_gaps[0],
            Gap {
                end_tsc: 1002,
                ticks: 2
            }
        );
        assert_eq!(
            s.recent_gaps[15],
            Gap {
                end_tsc: 1017,
                ticks: 17
            }
        );
        assert!(SpinState::parse(&block[1..]).is_none());
    }
}
