//! Handing the daemon over to a successor without losing the pool, the
//! allocations or the connections (`hugemem serve --takeover`).
//!
//! # The running daemon's side
//!
//! A successor connects to the control socket ([`channel`]) as the
//! daemon's own uid. The daemon then **freezes**, in this order:
//!
//! 1. the listener stops accepting (connections wait in the backlog of the
//!    listening socket, which the successor inherits);
//! 2. every connection handler finishes the request it is serving (an
//!    ALLOC waiting for pages on their way back still gets them: the
//!    quarantine and the scrubbers still run) and parks between requests: a frame the peer had begun to send stays
//!    in its reader and travels as bytes; a lazy allocation's fault
//!    service stops, finishing the page it clears, and its userfaultfd
//!    travels (faults wait in the kernel meanwhile: the VMM's own copy of
//!    the uffd keeps them pending);
//! 3. the background loops (quarantine, refill, rebalance policy) finish
//!    their current round and pause
//!    ([`crate::daemon::lifecycle::Lifecycle::periodic`]);
//! 4. the scrubbers finish their batch and are joined;
//! 5. the pool's table is snapshot ([`crate::daemon::pool::Records::snapshot`]).
//!
//! It sends a versioned state document in a sealed memfd ([`state`]) and
//! the fds it names: the listening socket (and the metrics one), every
//! region, every connection, every frame fd and userfaultfd. If the
//! successor answers `OK` it has taken everything: this daemon drops its
//! copies without releasing anything (no allocation is freed, no socket
//! file removed, no hugetlbfs file unlinked) and exits. If it refuses, or
//! anything fails before its answer, this daemon **thaws**: scrubbers,
//! handlers, fault services and loops go on as before, and no request was
//! lost (requests that arrived meanwhile wait in their sockets).
//!
//! # The successor's side
//!
//! [`receive()`](crate::daemon::restart::takeover::receive::receive) checks the state document (its memfd's owner and seals, its
//! format and version: a newer document is refused whole) and every fd
//! against it. [`crate::daemon::Daemon::start_inherited`] then adopts each region
//! (`guest_mem::Region::adopt`: size, page size, seals, page states) and
//! verifies the pooled ones as at FREE: population (every page present,
//! or holes still to refault), holders (a `/proc` scan that skips only the
//! predecessor while it runs) and the write lease. A pooled region that
//! fails a check enters quarantine, where the usual proofs decide; one
//! whose fd is not what the document says goes back to the kernel. In-use
//! regions keep their allocation, connection and page states; a lazy
//! allocation's fault service restarts on its userfaultfd and wakes every
//! range, so faults whose events the predecessor read but did not answer
//! fault again.

//!
//! # Files
//!
//! The takeover only orchestrates; each component saves and restores its
//! own state ([`crate::daemon::pool::RegionRecord`],
//! [`crate::daemon::lifecycle::suspended::LazyRecord`],
//! [`crate::daemon::lifecycle::ConnectionRecord`],
//! [`crate::daemon::restart::listeners::Listeners`], the counters'
//! `Metrics::to_map`), and the trust checks of an adopted pooled region
//! are the quarantine's ([`crate::daemon::background::quarantine::reuse::judge_inherited`]).
//!
//! * [`parts`]: what a takeover freezes, saves and thaws;
//! * [`document`]: the state document built from the components' states;
//! * [`send`]: the running daemon's side (control socket, freeze, send);
//! * [`receive`]: the successor's side (receive, check, answer);
//! * [`adopt`]: the successor's import (regions, allocations, connections);
//! * [`state`], [`fds`], [`encoding`], [`channel`]: the document, its fds,
//!   its encodings, the control channel.
//!
//! [`parts`]: crate::daemon::restart::takeover::parts
//! [`document`]: crate::daemon::restart::takeover::document
//! [`send`]: crate::daemon::restart::takeover::send
//! [`receive`]: mod@crate::daemon::restart::takeover::receive
//! [`adopt`]: crate::daemon::restart::takeover::adopt
//! [`state`]: crate::daemon::restart::takeover::state
//! [`fds`]: crate::daemon::persist::fds
//! [`encoding`]: crate::daemon::persist::encoding
//! [`channel`]: crate::daemon::restart::takeover::channel

pub mod adopt;
pub mod channel;
pub mod document;
pub mod parts;
pub mod receive;
pub mod send;
pub mod state;

pub use adopt::{adopt_into, resume_connections};
pub use document::{build, Target};
pub use parts::{FreezeError, Parts};
pub use receive::{bind_control, receive, Inherited, TakeoverError};
pub use send::{control_loop, SendError, StoreSeq};
pub use state::{State, StateError};
