//! The recycled, pre-zeroed pool: every region the daemon owns, in which
//! state, and who it belongs to.
//!
//! # Design
//!
//! A region lives in exactly one entry state for its whole life in the daemon:
//!
//! ```text
//!  fresh ─► Reserved ─► InUse ─FREE/disconnect─► Quarantined ─no holder─► Dirty ─scrubbed─► Clean
//!              ▲  │                                   │ (over limit:                │             │
//!              │  └── failed ALLOC ───────► Clean/Dirty  back to kernel)            │             │
//!              └──────── ALLOC takes an exact-size (or a smaller, grown) region ◄───┴─────────────┘
//! ```
//!
//! * **Reserved**: an ALLOC in progress owns it (a pooled region about to be
//!   handed out, a dirty one being cleared on the ALLOC path, a fresh one being
//!   committed). Scrubbers do not start pages of it.
//! * **Quarantined**: released by its client but maybe still mapped by it or
//!   by anyone it passed the fd to. It leaves quarantine only after a
//!   [`crate::daemon::quarantine::holders`] scan found no process but the daemon holding it —
//!   this gate is what makes "never scrub memory a live guest maps" true, and
//!   since the daemon never hands out a fd of a region it does not own in
//!   `InUse`, no process can gain access afterwards.
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
//! it moves an entry from one state to another. Its verbs:
//!
//! * [`Pool::take`] (`take.rs`): the regions that serve an ALLOC, chosen
//!   here by the one rule (clean, grown, re-cleared, fresh, evicted for,
//!   waited for; lazy mode's own sources; per node, per page size, per
//!   backing), `Reserved`; [`Pool::commit`] hands them to a session (the
//!   clean-before-map check), [`Pool::put_back`] returns them when the ALLOC
//!   fails after the take. [`Pool::add_fresh`] is the refill's fresh region.
//! * [`Pool::release`], [`Pool::release_session`] (`release.rs`): a freed
//!   allocation's regions enter quarantine, or go back to the kernel over a
//!   limit.
//! * [`Pool::quarantined`] and [`Pool::apply_scan`]: what the quarantine
//!   loop checks and its verdicts (leave, stay held or withheld, discard).
//! * [`Pool::next_scrub`] and [`Pool::scrub_done`] (`scrubbing.rs`): the
//!   scrubbers' next dirty pages and how their batch ended (cleared, stopped,
//!   damaged: discarded).
//! * [`Pool::trim`]: idle regions given back above the target.
//! * Reads: [`Pool::stats`], [`Pool::pooled`], the allocations of a session
//!   ([`Pool::regions_of`] and its kin); for REBALANCE the in-use regions
//!   and their placement marks (`in_use.rs`).
//! * Owners (`owners.rs`): every allocation has a tenant uid and a secret
//!   re-attach token. [`Pool::orphan`] detaches an allocation from its
//!   session (a restarted daemon restores allocations that way);
//!   [`Pool::reattach`] gives an orphaned one to the session that shows its
//!   token; [`Pool::allocation_tokens`] is what the restore code saves.
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
//! same way. A region that fails either is discarded (`Pool::discard`):
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

mod files;
mod given_back;
mod handout;
mod handover;
mod held;
mod ids;
mod in_use;
mod owners;
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

pub use handover::{Adopted, AllocSnapshot, Life, RegionSnapshot, Snapshot};
pub use held::{Held, HeldRegion, Why};
pub use ids::{AllocId, PoolKey, RegionId, SessionId};
pub use in_use::InUseRegion;
pub use owners::OwnershipError;
pub use refault::FillWork;
pub use release::Released;
pub use reserve::Taken;
pub use scrubbing::{ScrubWork, Scrubbed, Work};
pub use stats::PoolPart;
pub use supply::{free_pages, Refusal};
pub use table::{Pool, Sources};
pub use take::{shortage_note, Missing, Obtained, Part, Source};
pub use token::{AllocToken, TOKEN_SIZE};
// The table's private types, for `handover.rs` (`super::Entry` …).
use table::{Allocation, Entry, EntryState};
