// SPDX-License-Identifier: Apache-2.0

//! Page clearing kernels and the parallel, NUMA-local job runner.
//!
//! Guest RAM handed to a VM must be zero. For 1 GiB huge pages that is a lot
//! of memory to write, and how it is written matters:
//!
//! * **Multi-page string instructions rather than per-page loops.** The
//!   classic way to clear a huge page is a loop of `clear_page()` over its 4 KiB
//!   subpages. On CPUs with ERMS/FSRM one `rep stosb` over the whole run is
//!   faster: the microcode streams full cache lines without a
//!   read-for-ownership and does not restart its fast path every 4 KiB. Linux
//!   moved the same way (`clear_pages()`, `folio_zero_user`). For runs larger
//!   than the last-level cache, AVX-512/AVX2 streaming stores are faster still
//!   and leave the caches alone. The kernels are in [`kernel`];
//!   [`ClearKernel::default_kernel`] documents the measurements that picked
//!   the default on this hardware.
//! * **Cache-hot neighbourhood last.** When a page is cleared because the guest
//!   faulted on it, the guest resumes and touches the faulting address right
//!   away. [`clear_huge_page`] clears the rest of the page first and the
//!   faulting 4 KiB page with its neighbours last, with a temporal kernel, so
//!   those lines are in this core's cache when the guest comes back.
//! * **Many threads, on the right node.** One core cannot saturate a memory
//!   controller. The [`runner`] splits work into aligned chunks like the
//!   kernel's `padata_do_multithreaded`, and runs each job's workers pinned to
//!   the CPUs of the NUMA node that holds the memory, several nodes at once.
//!
//! ```
//! use clearing::{clear, clear_huge_page, ClearKernel};
//!
//! let mut page = vec![0xffu8; 2 << 20];
//! clear_huge_page(ClearKernel::default_kernel(), &mut page, 12345);
//! assert!(page.iter().all(|&b| b == 0));
//!
//! let mut buf = vec![1u8; 4097];
//! clear(ClearKernel::PerPage4K, &mut buf[1..]);
//! assert_eq!(buf[0], 1);
//! assert!(buf[1..].iter().all(|&b| b == 0));
//! ```

#![deny(missing_docs)]

/// Clearing kernels (`rep stosb`, non-temporal stores, per-4 KiB baseline) and
/// the huge-page clear with a cache-hot neighbourhood.
pub mod kernel;
pub use kernel::{
    clear, clear_huge_page, clear_huge_page_raw, clear_order, clear_raw, ClearKernel, MAX_RUN,
    NEIGHBOURHOOD_PAGES, PAGE_4K,
};

/// The parallel job runner: chunking, NUMA-pinned workers, cancellation and
/// progress.
pub mod runner;
pub use runner::{
    clear_jobs, clear_parallel, run_jobs, CancelToken, Chunk, Job, NodeStats, Progress, RunError,
    RunOptions, RunReport, CLEAR_ALIGN, CLEAR_MIN_CHUNK,
};
