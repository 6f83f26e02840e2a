//! NUMA rebalancing of guest memory at huge-page granularity.
//!
//! Moves a region, or a guest-physical range of it, to another NUMA node with
//! `move_pages` one huge page per entry, in batches with progress, cancellation
//! and a rate limit, then verifies placement. (Built in the migration issue; the
//! foundation only reserves the crate.)
