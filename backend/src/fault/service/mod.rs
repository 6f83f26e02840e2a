//! The fault service's runtime: an epoll reader thread, handler threads and
//! node-local scrubbers around one VMM's userfaultfd.
//!
//! ```text
//!   VMM uffd ──► hm-uffd-rd (epoll: uffd, stop EventFd, VMM pidfd)
//!                   │ page faults → queue      UNMAP/REMAP → range table
//!                   ▼
//!               hm-uffd-h0..N  policy::serve_fault → clear (daemon mapping) → UFFDIO_CONTINUE
//!                   │ read-ahead hints
//!                   ▼
//!               hm-uffd-sN-i   (pinned to node N) policy::scrub_page → UFFDIO_CONTINUE ahead
//! ```
//!
//! Mechanism only: what happens to a page is decided in [`super::policy`].

mod config;
mod handle;
mod shared;
mod threads;

pub use config::{FaultMapping, FaultReport, FaultServiceConfig, StopReason};
pub use handle::{live_services, FaultService, FaultServiceHandle};
