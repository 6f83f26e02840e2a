//! The daemon as a process: its start (fresh or inherited) and the run of
//! `hugemem serve` to its signal, its handle and errors, its socket file,
//! the hugetlbfs mounts, systemd's readiness and socket activation, the
//! Prometheus endpoint, and a check to run inside a multi-node guest.

pub(crate) mod error;
pub mod exporter;
pub mod guest_check;
pub(crate) mod handle;
pub(crate) mod hugetlbfs;
pub(crate) mod serve;
pub(crate) mod socket;
pub mod start;
pub mod systemd;
