//! What every bench needs around what it measures, in one place: its
//! private daemon, in process (`daemon`) or as a `hugemem serve` process of
//! its own (`serve`), the waits on that daemon's pool (`pool`), the
//! repetitions (`rounds`: an untimed warm-up, then timed rounds with the
//! compared sides interleaved) and the VMM processes (`vmm`).
//! The floors (`crate::floor`), the repetitions' statistics
//! (`crate::stats`) and the machine a run describes (`crate::run_info`)
//! are each shared already; each VMM's command lines are in
//! `crate::vmm_side`.

pub(crate) mod daemon;
pub(crate) mod pool;
pub(crate) mod rounds;
pub mod serve;
pub(crate) mod vmm;
