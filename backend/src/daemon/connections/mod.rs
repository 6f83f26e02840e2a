//! A client's connection: the accept loop and its handlers (`server`), the
//! session that dispatches each request to its room (`session`), and the
//! orphan loop for allocations whose connection is gone (`orphans`).

pub(crate) mod orphans;
pub mod server;
pub mod session;
