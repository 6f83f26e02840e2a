//! The recycled, pre-zeroed pool: every region the daemon owns, in which
//! state, and who it belongs to.
//!
//! # Design
//!
//! A region lives in exactly one entry state for its whole life in the daemon:
//!
//! ```text
//! fresh ─► Reserved ─► InUse ─FREE/disconnect─► Quarantined ─no holder─► Dirty ─scrubbed─► Clean
//!             ▲  │                                 │   │                   │                 │
//!             │  └── failed ALLOC ──► Clean/Dirty  │   └─ pages detached ──┼────────────────►┤
//!             │                                    ▼      (holes reserved) │                 │
//!             │                           back to the kernel               │                 │
//!             └─ ALLOC takes an exact-size (or a smaller, grown) region ──◄┴─────────────────┘
//! ```
//!
//! * **Reserved**: an ALLOC in progress owns it (a pooled region about to be
//!   handed out, a dirty one being cleared on the ALLOC path, a fresh one being
//!   committed). Scrubbers do not start pages of it.
//! * **Quarantined**: released by its client but maybe still mapped by it or
//!   by anyone it passed the fd to. It leaves quarantine only after a
//!   [`crate::daemon::quarantine::holders`] scan found no process but the
//!   daemon holding it and the proofs before reuse
//!   ([`crate::daemon::quarantine::reuse`]) passed — this gate is what makes
//!   "never scrub memory a live guest maps" true, and since the daemon never
//!   hands out a fd of a region it does not own in `InUse`, no process can
//!   gain access afterwards. With `pool.detach_pages` (the default) its pages
//!   were punched out and the holes reserved again: it is `Clean` at once,
//!   its holes zero-filled by the kernel, faulted in ahead by the scrubbers
//!   (`refault.rs`).
//! * **Back to the kernel** (`release.rs`): a released region over a limit
//!   (it never enters quarantine), a verdict that gives it up (broken by its
//!   tenant, pinned, short of pages after a detach), a scrub batch the tenant
//!   damaged, an idle clean region trimmed above the target.
//! * **Dirty** → **Clean**: scrubbers ([`super::scrub`]) claim pages through
//!   the region's [`guest_mem::PageStates`]; the entry turns Clean when every
//!   page is.
//!
//! The invariant "no VM receives a page that is not clean in eager mode" is
//! enforced at the last step before a reply: [`Pool::commit`] refuses a region
//! whose pages are not all `Clean` and moves them `Clean → Mapped`, the only
//! way into `Mapped` the page-state table allows.
//!
//! One `Mutex` guards the table. Critical sections are map lookups and a pass
//! over a few thousand atomics at most; no syscall and no clearing runs under
//! it. Scrubbers wait on a `Condvar` of the same mutex, which also wakes
//! ALLOC-path waiters when a scrubber finishes a page they need.
//!
//! **The API.** The pool is the one owner of region state; nothing outside
//! it moves an entry from one state to another. Its table is `table.rs`
//! ([`Pool`], the entries, the allocations, the lock); its public methods
//! are grouped by who calls them, one `impl Pool` block per group, each in
//! its own file:
//!
//! * **The ALLOC path** (`crate::daemon::alloc`, `crate::daemon::session`):
//!   [`Pool::take`] (`take.rs`) picks the regions that serve an ALLOC by the
//!   one rule (clean, grown, re-cleared, fresh, evicted for, waited for; lazy
//!   mode's own sources; per node, per page size, per backing) and leaves
//!   them `Reserved` — the only place that picks; `supply.rs` obtains each
//!   source and `reserve.rs` moves the entries, both private to the pool.
//!   [`Pool::commit`] hands them to a session (the clean-before-map check),
//!   [`Pool::put_back`] returns them when the ALLOC fails after the take
//!   (`commit.rs`).
//! * **A connection's allocations** (`crate::daemon::session`, `owners.rs`):
//!   ownership ([`Pool::regions_of`], [`Pool::region_ids_of`],
//!   [`Pool::allocations_of`], [`Pool::region`]), LOCK ([`Pool::set_locked`]),
//!   lazy mode's fallback ([`Pool::lazy_fallback`],
//!   [`Pool::set_lazy_fallback`]), re-attach tokens ([`Pool::token_of`],
//!   [`Pool::reattach`]) and [`Pool::orphan`], which stands for a restart in
//!   tests.
//! * **Release and quarantine**: FREE and disconnect ([`Pool::release`],
//!   [`Pool::release_session`], `release.rs`) put a freed allocation's
//!   regions into quarantine, or back to the kernel over a limit; the
//!   quarantine loop (`crate::daemon::quarantine`) asks for the
//!   [`Pool::quarantined`] regions, checks them off the lock and hands its
//!   verdicts to [`Pool::apply_scan`] (`quarantine.rs`), passing the
//!   detach's gate ([`Pool::reserve_gate`]); it also trims idle regions above
//!   the target ([`Pool::trim`]).
//! * **The scrubbers** (`crate::daemon::scrub`, `scrubbing.rs`):
//!   [`Pool::next_scrub`] (dirty pages, or a detached region's holes),
//!   [`Pool::scrub_done`], [`Pool::fill_done`]; [`Pool::stop`] stops them.
//! * **Takeover and restart** (`crate::daemon::takeover`,
//!   `crate::daemon::fdstore`, the restore at start, `persist.rs`):
//!   [`Pool::snapshot`], [`Pool::snapshot_partial`], [`Pool::import`],
//!   [`Pool::unkeep`], [`Pool::resume`], [`Pool::orphans`],
//!   [`Pool::release_orphans`].
//! * **REBALANCE** (`crate::daemon::rebalance`, `in_use.rs`): the in-use
//!   regions ([`Pool::in_use`], [`Pool::in_use_regions`], [`Pool::contains`])
//!   and their placement marks ([`Pool::mark_split`],
//!   [`Pool::set_whole_node`]).
//! * **STATS and the refill** (`stats.rs`, `held.rs`, `supply.rs`):
//!   [`Pool::stats`], [`Pool::pooled`], [`Pool::add_fresh`] (the refill's
//!   fresh region); [`Pool::new`] and [`Pool::config`] (`table.rs`).
//!
//! **Sizes.** Memfds are sealed against shrinking (`F_SEAL_SHRINK`, see
//! `guest_mem::region`) but not against growing. A request is served by an
//! exact-size clean or dirty region, or the largest smaller clean one grown
//! (see `take.rs`). A pooled region *larger* than the request is never used:
//! it cannot be truncated (the seal protects the daemon's own mapping from a
//! VMM), and handing out a larger file would give the VMM more memory than it
//! asked for.
//!
//! **Damaged files.** A tenant can change its file behind the daemon's
//! back: grow a memfd (the seals allow it), truncate a hugetlbfs file, punch
//! holes. Before a released region leaves quarantine, [`check_released`]
//! checks its size and populates every page (`MADV_POPULATE_WRITE`, which
//! errors where a store would `SIGBUS`); scrubbers populate each batch the
//! same way. A region that fails either is discarded (`release.rs`):
//! given back to the kernel, never scrubbed, never served.
//!
//! **Limits.** Per node, pooled bytes (clean + dirty + quarantined) never
//! exceed the limit, nor those of one page size its own limit
//! (`pool.limit_1g`, `limit_2m`, `limit_4k`; 4 KiB is 0 by default): a
//! released region that would is given back to the kernel at once (no scrub
//! needed: closing our fd and unmapping is enough, the kernel zeroes pages
//! before their next user). Above the target, clean regions idle for
//! `trim_after_secs` are given back, oldest first. The last regions given
//! back and why are kept for STATS (`given_back`).
//!
//! [`check_released`]: crate::daemon::quarantine::reuse::check_released

mod commit;
mod files;
mod given_back;
mod handoff;
mod held;
mod ids;
mod in_use;
mod owners;
mod persist;
mod quarantine;
mod refault;
mod release;
mod reserve;
mod scrubbing;
mod stats;
mod supply;
mod table;
mod take;
mod token;

pub use handoff::{HandedOff, HandoffError};
pub use held::{Held, HeldRegion, Why};
pub use ids::{AllocId, PoolKey, RegionId, SessionId};
pub use in_use::InUseRegion;
pub use owners::OwnershipError;
pub use persist::{
    Adopted, AllocRecord, AllocSnapshot, Life, RegionRecord, RegionSnapshot, SavedLife, Snapshot,
};
pub use refault::{FillTicket, FillWork};
pub use release::Released;
pub use reserve::Taken;
pub use scrubbing::{ScrubWork, Scrubbed, Work};
pub use stats::PoolPart;
pub use supply::{free_pages, Refusal};
pub use table::{ChangeGate, Pool, Sources};
pub use take::{shortage_note, Missing, Obtained, Part, Source};
pub use token::{AllocToken, TOKEN_SIZE};
// The table's private types, for `persist.rs` (`super::Entry` …).
use table::{Allocation, Entry, EntryState};
