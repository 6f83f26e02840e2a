//! What a launch reports when its VMM ended, and the last step of every
//! launch: the memory freed, or reported parked (`hugemem park`).

use std::time::Duration;

use hugemem_client::client::Client;
use tracing::{info, warn};

use super::process::VmmExit;

/// What a launch did.
#[derive(Debug, Clone)]
pub struct LaunchReport {
    /// How the VMM ended.
    pub exit: VmmExit,
    /// Connect + ALLOC, wall time.
    pub alloc: Duration,
    /// VMM start to VMM exit.
    pub vmm: Duration,
    /// Bytes given to the VMM.
    pub size: u64,
    /// Page size per region, bytes.
    pub page_sizes: Vec<u64>,
    /// The daemon's note on the ALLOC (empty, or e.g. which larger pages
    /// were missing when `best` served a smaller size).
    pub note: String,
    /// The VM was parked under this name (`hugemem park`) before its VMM
    /// exited: its memory stays with the daemon.
    pub parked_as: Option<String>,
    /// The memory came from the park (`--restore`), not from an ALLOC.
    pub restored: bool,
    /// The VM is a clone of a parked VM (`--clone-of`), in this mode.
    pub cloned: Option<hugemem_client::proto::CloneMode>,
    /// A copy clone's memory was filled before its guest ran (eager).
    pub filled_first: bool,
}

/// Says, on stderr and in the log, each part of the template's that the
/// clone of `name` holds its own of instead (a tap, a vsock's socket): a
/// new tap is to be attached where the template's was.
pub(crate) fn say_replaced<'a>(name: &str, replaced: impl IntoIterator<Item = &'a str>) {
    for line in replaced {
        info!(name, replaced = %line, "the clone holds its own in place of the template's");
        eprintln!("hugemem launch: clone of {name}: {line}");
    }
}

/// FREEs allocation `id` on `client` after the VMM ended; a VM that was
/// parked (`hugemem park`) left its memory with the daemon, and the
/// launcher says so instead: returns the name it was parked under.
pub(crate) fn free_or_report_parked(client: Option<Client>, id: u64) -> Option<String> {
    let Some(mut client) = client else {
        warn!(
            alloc = id,
            "no daemon connection holds the allocation any more; not freed by launch (the daemon releases it)"
        );
        return None;
    };
    match client.free(id) {
        Ok(()) => None,
        Err(hugemem_client::client::ClientError::Refused { message, .. })
            if message.contains(" was parked as ") =>
        {
            let name = message.rsplit(" was parked as ").next().unwrap_or_default();
            info!(
                alloc = id,
                name, "the VM was parked as {name}: its memory stays with the daemon"
            );
            Some(name.to_string())
        }
        Err(e) => {
            warn!(error = %e, "FREE failed; the daemon releases the memory when this connection closes");
            None
        }
    }
}
