//! Background work, none of it on a request's path: the scrubbers, the
//! quarantine (holder scans and proofs before reuse), refaulting detached
//! regions' holes, refilling the pool while idle, and the orphan loop.

pub(crate) mod orphans;
pub mod quarantine;
pub mod refault;
pub mod refill;
pub mod scrub;
