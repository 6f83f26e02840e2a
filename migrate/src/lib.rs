//! NUMA rebalancing of guest memory at huge-page granularity.
//!
//! Moves a region, or a byte range of it, to another NUMA node while the
//! guest runs: `move_pages` with one entry per huge page (the kernel
//! migrates a hugetlb page whole), in batches with progress, cancellation
//! and an optional rate limit so the guest keeps its memory bandwidth, after
//! binding the range to the target with `mbind` so later faults land there
//! too. Before moving it says exactly how many pages the target can take
//! ([`MovePlan`]); afterwards it checks where every page is and reports the
//! pages that did not move and why ([`MoveReport`]).
//!
//! # Why `move_pages` per page and not `mbind(MPOL_MF_MOVE)`
//!
//! `mbind` with `MPOL_MF_MOVE` would move the whole range in one call: no
//! progress, no cancellation, no pacing, and no per-page result (only
//! `EIO` with `MPOL_MF_STRICT`). `move_pages` takes a list of addresses, so
//! the range can be cut into batches, and returns a status per page. The
//! cost is one `move_pages` entry per page, which at huge-page granularity
//! is 512 entries per GiB of 2 MiB pages, one for 1 GiB pages.
//!
//! # Layout
//!
//! * [`plan`]: request validation and the pure [`MovePlan`].
//! * [`mover`]: [`move_range`], [`move_region`], [`plan_move`],
//!   [`placement`]; the kernel calls go through `numa` and `guest_mem` (this
//!   crate makes none itself).
//! * [`report`]: [`MoveReport`] and [`FailReason`].
//! * [`policy`]: the vCPU-affinity watcher (off by default).
//!
//! ```
//! use migrate::{move_region, MoveOptions, PlanError, MigrateError};
//! use guest_mem::{PagePolicy, PageSize, Region, RegionSpec};
//!
//! let topology = numa::Topology::detect()?;
//! let node = topology.nodes()[0].id;
//! let spec = RegionSpec::new("doc", 8 << 20, Some(node))
//!     .with_policy(PagePolicy::Strict(PageSize::Base4K));
//! let (region, _) = Region::allocate(&topology, &spec, &clearing::RunOptions::default())?;
//! // Every page is on `node` already: nothing is copied.
//! let report = move_region(&topology, &region, node, &MoveOptions::default(), None, None)?;
//! assert_eq!(report.already_there, report.pages_total);
//! assert!(report.complete());
//! // A node that does not exist is refused before any syscall.
//! let err = move_region(&topology, &region, 999, &MoveOptions::default(), None, None)
//!     .expect_err("no node 999");
//! assert!(matches!(err, MigrateError::Plan(PlanError::UnknownNode { node: 999, .. })));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

mod mm;
/// Moving pages: validation, planning, batches, pacing, verification.
pub mod mover;
mod pace;
pub mod pattern;
/// Request validation and the pure move plan.
pub mod plan;
/// The vCPU-affinity policy (off by default).
pub mod policy;
/// What a move did, and why pages did not move.
pub mod report;

pub use mm::capacity as target_capacity;
pub use mover::{
    move_range, move_region, placement, plan_move, MigrateError, MoveOptions, MoveSpan, Placement,
    AUTO_BATCH_BYTES,
};
pub use plan::{
    memory_nodes, validate_range, validate_target, ByteRange, Capacity, MovePlan, PageSpan,
    PlanError,
};
pub use policy::{
    is_vcpu_name, parse_stat, read_threads, sample, CpuNodes, Decision, PolicyConfig, Sample,
    TaskStat, VcpuFilter, WatchError, Watcher,
};
pub use report::{FailReason, FailedPage, MoveReport, StrayPage};
