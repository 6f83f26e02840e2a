//! What every bench needs around what it measures, in one place: its
//! private daemon, in process (`daemon`) or as a `hugemem serve` process of
//! its own (`serve`), and the waits on that daemon's pool (`pool`).
//! The floors (`crate::floor`), the repetitions' statistics
//! (`crate::stats`) and the machine a run describes (`crate::run_info`)
//! are each shared already; each VMM's command lines are in
//! `crate::vmm_side`.

pub(crate) mod daemon;
pub(crate) mod pool;
pub mod serve;
pub(crate) mod vmm;
