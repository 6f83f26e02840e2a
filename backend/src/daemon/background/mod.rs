//! Background work, none of it on a request's path: the scrubbers, the
//! quarantine (the loop and the proofs before reuse), refaulting detached
//! regions' holes, and refilling the pool while idle.

pub mod quarantine;
pub mod refault;
pub mod refill;
pub mod scrub;
