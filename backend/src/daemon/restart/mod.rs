//! Restart and upgrade: the takeover by a successor, systemd's fd store,
//! what every component saves into the state document, and the listening
//! sockets passed on.

pub mod fdstore;
pub mod listeners;
pub mod persist;
pub mod takeover;
