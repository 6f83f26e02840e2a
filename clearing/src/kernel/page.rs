//! The base page size, which every kernel and the fault neighbourhood
//! count in (its own file: the platform modules use it, and the kernel
//! module uses them).

/// The base page size: the unit of
/// [`ClearKernel::PerPage4K`](crate::ClearKernel::PerPage4K) and of the
/// fault neighbourhood.
pub const PAGE_4K: usize = 4096;
