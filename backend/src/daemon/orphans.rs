//! The orphan loop: allocations restored orphaned (from systemd's fd
//! store) that nobody re-attached in time go to quarantine.

use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use super::context::Shared;
use super::session;

/// Releases allocations restored orphaned (from systemd's fd store) that no
/// VMM re-attached within `limits.reattach_timeout_secs`: into quarantine,
/// where they stay until their VMM lets go.
pub(super) async fn orphans_loop(shared: Arc<Shared>) {
    if shared.pool.orphans() == 0 {
        return;
    }
    let wait = Duration::from_secs(shared.cfg.limits.reattach_timeout_secs);
    shared
        .lifecycle
        .after(wait, async {
            let released = shared.pool.release_orphans();
            if !released.is_empty() {
                warn!(
                    allocations = released.len(),
                    secs = wait.as_secs(),
                    "restored allocations nobody re-attached; released into quarantine"
                );
                session::settle_released(&shared, released);
            }
        })
        .await;
}
