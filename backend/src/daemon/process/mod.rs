//! The daemon as a process: its start (fresh or inherited), its signal and
//! shutdown, its lifecycle (serving, frozen for a takeover, taken over), its
//! errors, its socket file, the hugetlbfs mounts and systemd's readiness
//! and socket activation.

pub(crate) mod error;
pub(crate) mod handle;
pub(crate) mod hugetlbfs;
pub mod lifecycle;
pub(crate) mod serve;
pub(crate) mod socket;
pub mod start;
pub mod systemd;
