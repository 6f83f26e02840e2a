//! hugemem's benchmarks and demo: the library half of the `hugemem-bench`
//! binary (`hugemem-bench X …`, which `hugemem bench X …` and `hugemem demo`
//! run where it is installed beside `hugemem`). Kept out of the shipped
//! daemon binary: the micro-guest and the measuring code are here, and this
//! crate uses `hugemem`'s library (the launchers), never the other way.
//!
//! Each bench reports ratios against a baseline measured in the same run:
//! absolute times on shared machines are noise.
//!
//! [`demo`]: daemon, 1 GiB pages, micro-guest, scrub and pool reuse, as a
//! timeline. The benches: [`alloc`], [`churn`], [`clear`], [`clone`], [`compare`],
//! [`fill`], [`migrate`], [`mlock`], [`offload`], [`refault`], [`takeover`], [`vmstart`]; [`report`] regenerates
//! docs/benchmarks.md from their `--json`, which [`run_info`] makes
//! self-describing.

#![deny(missing_docs)]

pub mod alloc;
/// `hugemem bench churn`: back-to-back launches against one daemon, stale reads, downgrades.
pub mod churn;
pub mod clear;
/// `hugemem bench clone`: clones of a parked VM against restores from the park and cloud-hypervisor's own restore.
pub mod clone;
pub mod compare;
/// `hugemem demo`: daemon, 1 GiB pages, micro-guest, scrub and pool reuse, as a timeline.
pub mod demo;
pub mod error;
pub mod fill;
pub mod floor;
/// What every bench needs around what it measures: its private daemon and the waits on its pool.
pub mod harness;
/// `hugemem bench migrate`: throughput per page size and runner locality.
pub mod migrate;
pub mod mlock;
pub mod offload;
mod private_dir;
pub mod refault;
pub mod report;
pub mod run_info;
mod stats;
/// `hugemem bench takeover`: `serve --takeover` against a plain stop and start.
pub mod takeover;
/// The benches' side of each VMM (command lines of the micro-guest), and the one place that picks a VMM's.
pub mod vmm_side;
pub mod vmm_update;
/// `hugemem bench vmstart`: ALLOC to the guest's first instruction and to all pages touched, eager and lazy.
pub mod vmstart;
/// `hugemem bench vmstart`'s report as a table and as JSON.
mod vmstart_table;

pub use error::BenchError;
