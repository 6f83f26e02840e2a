//! What the takeover bench is asked to run, the two ways of switching
//! daemons it compares, and the run with no switch (the floor).

use std::path::PathBuf;

use guest_mem::PageSize;

/// What to run.
#[derive(Debug, Clone)]
pub struct TakeoverConfig {
    /// Bytes of clean pool before the switch.
    pub pool_bytes: u64,
    /// Running allocations (tenants).
    pub allocations: usize,
    /// Bytes per allocation, and per pool region.
    pub alloc_bytes: u64,
    /// Huge page size: 2M or 1G.
    pub page_size: PageSize,
    /// Rounds; each runs both modes.
    pub rounds: usize,
    /// Connections that only send STATS, besides the tenants'.
    pub idle_clients: usize,
    /// The `hugemem` binary whose `serve` runs the daemons.
    pub launcher: PathBuf,
}

/// How the daemon is switched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `hugemem serve --takeover`.
    Takeover,
    /// SIGTERM, then a fresh `hugemem serve`.
    StopStart,
    /// No switch: the same setup, clients and ALLOCs on the steady daemon,
    /// the floor both switches are measured against.
    Floor,
}

impl Mode {
    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Takeover => "takeover",
            Self::StopStart => "stop-start",
            Self::Floor => "floor",
        }
    }
}
