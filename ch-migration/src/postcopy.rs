//! A whole postcopy (on-demand) restore from the sending side: the
//! snapshot goes to a cloud-hypervisor's `receive-migration
//! …,memory_mode=postcopy` with memory fds whose pages are not filled yet,
//! the fault connection is opened after the configuration (before the
//! state, as cloud-hypervisor's reference offload daemon does: the
//! receiver waits for it when the state comes and restoring the devices
//! may already fault) and served on its own thread until the receiver has
//! every page and closes it.

use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Instant;

use super::fault::{
    announce_fault_connection, serve_page_faults, FaultRequest, FaultServeError, FaultServeStats,
};
use super::peer::send_snapshot_with;
use super::slots::SlotRange;
use super::ChMigrationError;

/// Connects to a receiving cloud-hypervisor's migration socket at `path`
/// and announces the connection as the fault connection.
///
/// # Errors
///
/// The connection or the announcement failed.
pub fn open_fault_connection(path: &Path) -> Result<UnixStream, ChMigrationError> {
    let sock = UnixStream::connect(path)?;
    announce_fault_connection(&sock)?;
    Ok(sock)
}

/// What a postcopy restore sends: the snapshot, with memory fds whose
/// pages the fault callback fills, and the slot table faults are mapped
/// through.
#[derive(Debug, Clone, Copy)]
pub struct PostcopySnapshot<'a> {
    /// The memory slots' fds (sized, not yet filled).
    pub memory: &'a [(u32, BorrowedFd<'a>)],
    /// The migration configuration (cloud-hypervisor's `VmMigrationConfig`).
    pub config: &'a [u8],
    /// The VM's state.
    pub state: &'a [u8],
    /// End with `CompletePaused` (the VM stays paused) instead of `Complete`.
    pub paused: bool,
    /// The slots, as the configuration's `guest_ram_mappings` say.
    pub slots: &'a [SlotRange],
}

/// What a postcopy restore did.
#[derive(Debug, Clone, Copy)]
pub struct PostcopyReport {
    /// When the receiver answered `Complete` (its VM runs from then on).
    pub completed: Instant,
    /// What the fault connection served, and how it ended.
    pub faults: FaultServeStats,
}

/// Why a postcopy restore failed.
#[derive(Debug, thiserror::Error)]
pub enum PostcopyError<E: std::error::Error + 'static> {
    /// The main connection's exchange failed.
    #[error("postcopy restore: {0}")]
    Send(#[source] ChMigrationError),
    /// Serving the fault connection failed.
    #[error("postcopy restore: {0}")]
    Serve(#[source] FaultServeError<E>),
    /// The fault thread panicked (the callback did).
    #[error("postcopy restore: the fault thread panicked")]
    ServePanicked,
}

/// Restores `snapshot` into the cloud-hypervisor on the other end of
/// `sock`, on demand: `open_fault` makes the second connection to the
/// same receiver (for a path, [`open_fault_connection`]; it must come
/// announced), and `on_fault` fills each page asked for on it. Returns
/// once the receiver closed the fault connection (it had every page) or
/// abandoned it.
///
/// # Errors
///
/// [`PostcopyError`]: the main exchange or the fault connection failed
/// (when both did, the fault connection's error, the likelier cause);
/// when the main exchange fails, the fault connection is shut down so its
/// thread ends.
pub fn restore_postcopy<E, F>(
    sock: &UnixStream,
    open_fault: impl FnOnce() -> Result<UnixStream, ChMigrationError>,
    snapshot: PostcopySnapshot<'_>,
    on_fault: F,
) -> Result<PostcopyReport, PostcopyError<E>>
where
    E: std::error::Error + Send + 'static,
    F: FnMut(FaultRequest) -> Result<(), E> + Send,
{
    std::thread::scope(|scope| {
        let mut serving = None;
        let mut fault_sock = None;
        let sent = send_snapshot_with(
            sock,
            snapshot.memory,
            snapshot.config,
            snapshot.state,
            snapshot.paused,
            || {
                let fault = open_fault()?;
                fault_sock = Some(fault.try_clone()?);
                let slots = snapshot.slots;
                serving = Some(scope.spawn(move || serve_page_faults(&fault, slots, on_fault)));
                Ok(())
            },
        );
        let completed = Instant::now();
        if let Err(e) = sent {
            if let Some(fault) = &fault_sock {
                // The receiver may hold the connection open; the thread must end.
                let _ = fault.shutdown(std::net::Shutdown::Both);
            }
            // A refused fault ends the receiver, and with it the main
            // exchange: the fault connection's error says why.
            if let Some(Ok(Err(serve))) = serving.map(|t| t.join()) {
                return Err(PostcopyError::Serve(serve));
            }
            return Err(PostcopyError::Send(e));
        }
        let thread = serving.ok_or(PostcopyError::Send(ChMigrationError::Closed(
            "before the fault connection was opened",
        )))?;
        let faults = thread
            .join()
            .map_err(|_| PostcopyError::ServePanicked)?
            .map_err(PostcopyError::Serve)?;
        Ok(PostcopyReport { completed, faults })
    })
}
