//! How to move: [`MoveOptions`] (batch size, rate limit, whether shared
//! and partial moves are allowed), with their defaults and validation.

use guest_mem::PageSize;
use serde::{Deserialize, Serialize};

use crate::plan::PlanError;

/// Bytes per batch when [`MoveOptions::batch_pages`] is 0.
pub const AUTO_BATCH_BYTES: u64 = 64 << 20;

/// How to move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MoveOptions {
    /// Pages per `move_pages` call; cancellation, progress and the rate limit
    /// act between calls. 0 (the default) means 64 MiB worth of pages, at
    /// least one: 1 page of 1 GiB, 32 of 2 MiB, 16384 of 4 KiB.
    pub batch_pages: usize,
    /// Average bytes per second to stay under, or `None` for no limit.
    pub rate_limit_bytes_per_s: Option<u64>,
    /// `MPOL_MF_MOVE_ALL`: also move pages other processes (the VMM) map.
    /// Needs `CAP_SYS_NICE`. Default on: guest RAM is always shared.
    pub move_all: bool,
    /// Move what can move when the target cannot take every page (default
    /// on). Off: refuse before changing anything
    /// ([`MigrateError::Insufficient`](super::MigrateError::Insufficient)).
    pub allow_partial: bool,
}

impl Default for MoveOptions {
    fn default() -> Self {
        Self {
            batch_pages: 0,
            rate_limit_bytes_per_s: None,
            move_all: true,
            allow_partial: true,
        }
    }
}

impl MoveOptions {
    /// Pages per batch for pages of `page_size`.
    pub fn batch_for(&self, page_size: PageSize) -> usize {
        if self.batch_pages > 0 {
            return self.batch_pages;
        }
        usize::try_from(AUTO_BATCH_BYTES / page_size.bytes())
            .unwrap_or(1)
            .max(1)
    }

    /// Checks the options.
    ///
    /// # Errors
    ///
    /// [`PlanError::ZeroRate`] for a rate limit of 0.
    pub fn validate(&self) -> std::result::Result<(), PlanError> {
        if self.rate_limit_bytes_per_s == Some(0) {
            return Err(PlanError::ZeroRate);
        }
        Ok(())
    }
}
