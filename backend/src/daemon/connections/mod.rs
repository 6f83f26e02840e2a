//! A client's connection: the accept loop and its handlers, the session that
//! dispatches each request to its room, who the peer is, what a peer may
//! make the daemon log, and the requests refused for their id, uid or token.

pub mod outcome;
pub mod peer;
pub mod peer_log;
pub mod refusals;
pub mod rooms;
pub mod server;
pub mod session;
