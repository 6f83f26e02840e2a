//! Why `bench vmm-update` failed.

/// Errors of `bench vmm-update`.
#[derive(Debug, thiserror::Error)]
pub enum VmmUpdateError {
    /// Huge pages, the VMM or KVM missing.
    #[error("cannot run: {0}")]
    Setup(String),
    /// The private daemon.
    #[error(transparent)]
    Daemon(#[from] crate::harness::serve::ServeChildError),
    /// Talking to the daemon.
    #[error("daemon: {0}")]
    Client(#[from] backend::client::ClientError),
    /// A QEMU or its monitor.
    #[error("QEMU: {0}")]
    Qemu(String),
    /// A cloud-hypervisor or its API.
    #[error("cloud-hypervisor: {0}")]
    Ch(String),
    /// The launcher's update.
    #[error(transparent)]
    Update(#[from] hugemem::launch::ControlError),
    /// The guest's RAM or its spin block.
    #[error("guest: {0}")]
    Guest(String),
    /// Files, sockets, processes.
    #[error("{what}: {source}")]
    Io {
        /// What was done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Maps an I/O error to [`VmmUpdateError::Io`] with `what`.
pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmmUpdateError {
    let what = what.into();
    move |source| VmmUpdateError::Io { what, source }
}
