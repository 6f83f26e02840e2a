//! The hugemem daemon and CLI.
//!
//! For now this is the benchmark front end (`hugemem bench clear`); the daemon
//! (socket protocol, recycled pool, userfaultfd fault service, launch wrapper)
//! arrives with the backend issue.

#![deny(missing_docs)]

pub mod bench;
pub mod proto;
pub mod size;
