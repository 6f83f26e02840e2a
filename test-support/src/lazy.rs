//! Lazy mode through a daemon: a dirty pooled region made on purpose and a
//! lazy ALLOC served from it, guest touches in threads (blocking in a fault
//! until served), the VMM-side mapping.

use std::os::fd::AsFd;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use backend::client::{Allocation, Client};
use backend::lazy::GuestMapping;
use backend::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo};
use backend::stats::Stats;
use guest_mem::PageSize;

use crate::map::Map;

/// One 2 MiB page, in bytes.
pub const HUGE: usize = 2 << 20;

/// 2 MiB pages in a lazy test's region.
pub const PAGES: usize = 64;

/// A lazy test's region size.
pub const SIZE: u64 = (PAGES * HUGE) as u64;

/// The stale pattern a dirty pooled region holds.
pub const STALE: u8 = 0xEE;

/// How long a lazy test waits for anything.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Reserves three regions' worth of 2 MiB pages; `false` (after the
/// skip) when the kernel cannot give them.
pub fn reserve(test: &str) -> bool {
    match guest_mem::ensure_free(PageSize::Huge2M, 3 * PAGES as u64, None) {
        Ok(r) if r.met => true,
        Ok(r) => {
            crate::skip!("{test}: only {} free 2 MiB pages", r.free);
            false
        }
        Err(e) => {
            crate::skip!("{test}: {e}");
            false
        }
    }
}

/// Polls `cond` until it holds, failing the test after [`DEADLINE`].
pub fn wait_deadline(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// An ALLOC of [`SIZE`] bytes of 2 MiB pages with `mode`.
pub fn req(mode: ClearMode) -> AllocRequest {
    AllocRequest {
        total_size: SIZE,
        page_policy: PagePolicy::Huge2M,
        clear_mode: mode,
        lock: false,
        parts: vec![],
        want_paths: false,
    }
}

/// Reads `map[off]` in a thread (blocking in a fault until served).
pub fn touch(map: &Arc<Map>, off: usize) -> mpsc::Receiver<u8> {
    let (tx, rx) = mpsc::channel();
    let m = Arc::clone(map);
    std::thread::spawn(move || {
        let _ = tx.send(m.read(off));
    });
    rx
}

/// Dirty bytes over every pool in a STATS document.
pub fn dirty_bytes(stats: &Stats) -> u64 {
    stats.pool_sum(|p| p.dirty_bytes)
}

/// Tries at a dirty region before a lazy test gives up: each is lost only
/// when the scrubbers clean the region between FREE and the lazy ALLOC.
pub const TRIES: usize = 10;

/// Makes a dirty pooled region (eager ALLOC, stale pattern, FREE), waits for
/// it to leave quarantine, and asks for lazy memory at once. Returns the
/// allocation; it panics if the scrubbers won every one of [`TRIES`] tries.
pub fn lazy_alloc_from_dirty_pool(client: &mut Client, stats: &dyn Fn() -> Stats) -> Allocation {
    for attempt in 0..TRIES {
        let eager = client.alloc(req(ClearMode::Eager)).expect("eager alloc");
        {
            let m = Map::shared(eager.fds[0].as_fd(), SIZE as usize);
            m.fill(0, m.len(), STALE);
        }
        let id = eager.id;
        drop(eager); // close our fds: nothing of ours holds the region now
        let discarded = stats().counters.regions_discarded;
        client.free(id).expect("free");
        // Out of quarantine: dirty (the case wanted), or already scrubbed
        // clean or discarded between two polls (then the ALLOC below is not
        // LAZY and the loop tries again); waiting for dirty alone hung when
        // the scrubbers won the race.
        wait_deadline("the region to leave quarantine", || {
            let s = stats();
            dirty_bytes(&s) > 0
                || (s.pool_sum(|p| p.quarantined_bytes) == 0
                    && (s.pool_sum(|p| p.clean_bytes) >= SIZE
                        || s.counters.regions_discarded > discarded))
        });
        let lazy = client.alloc(req(ClearMode::Lazy)).expect("lazy alloc");
        if lazy.regions[0].flags & RegionInfo::FLAG_LAZY != 0 {
            return lazy;
        }
        println!(
            "OBSERVED: attempt {attempt}: the scrubbers cleaned the region first (flags {:#x})",
            lazy.regions[0].flags
        );
        client.free(lazy.id).expect("free");
    }
    panic!("never got a dirty region for a lazy ALLOC in {TRIES} tries");
}

/// The [`GuestMapping`] of `alloc`'s first region at `map`.
pub fn mapping(alloc: &Allocation, map: &Map) -> GuestMapping {
    GuestMapping {
        region_id: alloc.regions[0].region_id,
        region_offset: 0,
        addr: map.addr(),
        len: SIZE,
    }
}
