//! Who is on the other end, and what a peer may cause: peer credentials and
//! pidfds (`peer`), which other processes still hold a region (`holders`),
//! the rate limits of the log lines a peer can cause (`peer_log`), and the
//! requests refused for their id, uid or token (`refusals`).

pub mod holders;
pub mod peer;
pub mod peer_log;
pub mod refusals;
