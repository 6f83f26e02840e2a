//! The orphan loop: allocations restored orphaned (from systemd's fd
//! store) that nobody re-attached in time go to quarantine.

use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::daemon::connections::session::{settle_released, Rooms};

/// Releases allocations restored orphaned (from systemd's fd store) that no
/// VMM re-attached within `wait` (`limits.reattach_timeout_secs`): into
/// quarantine, where they stay until their VMM lets go.
pub(crate) async fn orphans_loop(rooms: Arc<Rooms>, wait: Duration) {
    if rooms.pool.records().orphans() == 0 {
        return;
    }
    rooms
        .lifecycle
        .after(wait, async {
            let released = rooms.pool.records().release_orphans();
            if !released.is_empty() {
                warn!(
                    allocations = released.len(),
                    secs = wait.as_secs(),
                    "restored allocations nobody re-attached; released into quarantine"
                );
                settle_released(&rooms, released);
            }
        })
        .await;
}
