//! Restart and upgrade: the takeover by a successor (`takeover`), systemd's
//! fd store (`fdstore`), and the listening sockets passed on (`listeners`).
//! What every component saves is in `crate::daemon::persist`.

pub mod fdstore;
pub mod listeners;
pub mod takeover;
