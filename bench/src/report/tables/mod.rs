//! The tables `hugemem bench report` generates for one results file, by its
//! `"bench"`: `clear`, `alloc`, `mlock`, `fill`, `vmstart`, `compare`, `demo`,
//! `takeover`, `vmm-update`, `offload` (a column per run) and `clone`; any other kind (or none)
//! gets its top-level figures as a key/value table. The
//! tables read the JSON as `--json` prints it; a missing figure shows as `-`.

mod alloc;
mod blocks;
mod cells;
mod clone;
mod clone_qemu;
mod launches;
mod memory;
mod offload;
mod takeover;
mod vmm_update;

pub use blocks::{block, blocks};
