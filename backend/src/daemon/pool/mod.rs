//! The recycled, pre-zeroed pool: every region the daemon owns, in which
//! state, and who it belongs to. The pool is the one owner of region
//! state: nothing outside it moves an entry from one state to another.
//! Its states, its invariant (no VM receives a page that is not clean in
//! eager mode: [`Pool::commit`] checks it), its lock and its rules on
//! sizes, damaged files and limits are told in docs/architecture.md
//! ("The pool's states and rules").
//!
//! [`Pool`] holds the one lock and coordinates; each responsibility that a
//! group of callers uses is a type of its own, borrowed from the pool
//! ([`Pool::owners`] → [`Owners`], [`Pool::records`] → [`Records`],
//! [`Pool::scrubbing`] → [`Scrubbing`], [`Pool::placement`] →
//! [`Placement`], [`Pool::quarantine`] → [`QuarantineBook`]). Each of their
//! methods takes the pool's lock for its one step, as the pool's own
//! (`take`, `commit`, `release`, …) do: one lock, one order. The table in
//! docs/architecture.md names each group's methods. Which file owns what:
//!
//! | file | owns |
//! |---|---|
//! | `table.rs` | [`Pool`], its entries, the one lock |
//! | `allocation.rs` | an allocation's life: [`Owner`] and its moves, the allocation's record, the table of allocations and its snapshot, the change gate |
//! | `take.rs`, `supply.rs`, `reserve.rs` | the ALLOC path's take: the one rule that picks an ALLOC's regions, each source, the moves to `Reserved` |
//! | `commit.rs` | [`Pool::commit`] (the clean-before-map check), [`Pool::put_back`] |
//! | `owners.rs` | [`Owners`]: a connection's allocations: ownership, LOCK, lazy fallback, tokens, [`Owners::reattach`], [`Owners::orphan`] |
//! | `handoff.rs` | [`Owners`]' HANDOFF move: [`Owners::hand_off_gate`], [`Owners::hand_off`] |
//! | `parked.rs` | parked VMs: [`Parking::park`], [`Parking::unpark_to`], [`Pool::release_parked`], a file's owner by identity |
//! | `release.rs`, `quarantine.rs` | FREE and disconnect, back to the kernel, trim; [`QuarantineBook`]: the quarantine's [`Verdict`]s applied |
//! | `scrubbing.rs`, `refault.rs` | [`Scrubbing`]: the scrubbers' and the refault's work |
//! | `in_use.rs` | [`Placement`]: REBALANCE's view of in-use regions and their placement marks |
//! | `persist.rs` | [`Records`]: the pool's part of the state document (takeover, fd store) |
//! | `stats.rs`, `given_back.rs` | STATS: the pool's figures, the last regions given back and why |
//! | `reclaimable.rs` | what the daemon holds outside any allocation, for the take's rule |
//! | `files.rs` | [`Access`]: who may open a region's file again (its owner and mode: the tenant's, the daemon's, a template's) |
//! | `token.rs` | re-attach tokens (the ids are `crate::daemon::ids`, below every room) |
//! | `gate.rs` | [`ReserveGate`]: the one gate of every hugetlb reservation and punch |

mod allocation;
mod commit;
mod files;
mod gate;
mod given_back;
mod handoff;
mod in_use;
#[cfg(test)]
mod owner_tests;
mod owners;
mod parked;
mod parked_vm;
mod persist;
mod quarantine;
mod reclaimable;
mod refault;
mod release;
mod reserve;
mod scrubbing;
mod stats;
mod supply;
mod table;
mod take;
mod token;

pub use crate::daemon::ids::{AllocId, PoolKey, RegionId, SessionId};
pub use allocation::{AllocSnapshot, ChangeGate, Owner, OwnershipError};
pub use commit::CommitError;
pub use files::{set_access, set_access_all, Access};
pub use gate::ReserveGate;
pub use handoff::{HandedOff, HandoffError};
pub use in_use::{InUseRegion, Placement};
pub use owners::Owners;
pub use parked::{FileOwner, FoundParked, ParkError, ParkedSummary, Parking};
pub use parked_vm::{ParkedSlot, ParkedVm, ParkedVmm};
pub use persist::{
    AdoptError, Adopted, AllocRecord, Life, MalformedToken, Records, RegionRecord, RegionSnapshot,
    SavedLife, Snapshot, SnapshotError,
};
pub use quarantine::{QuarantineBook, Verdict};
pub use reclaimable::{Held, HeldRegion, Why};
pub use refault::{RefaultError, RefaultTicket, RefaultWork};
pub use release::Released;
pub use reserve::Taken;
pub use scrubbing::{ScrubWork, Scrubbed, Scrubbing, Work};
pub use stats::PoolPart;
pub use supply::{free_pages, Refusal};
pub use table::{Pool, Sources};
pub use take::{shortage_note, Missing, Obtained, Part, Source};
pub use token::{AllocToken, TokenError, TOKEN_SIZE};
