//! Why a launch failed.

use std::ffi::OsString;

use hugemem_client::client::ClientError;

use super::command_line::BuildError;

/// Errors of `hugemem launch`.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The launch options are inconsistent.
    #[error("{0}")]
    Options(String),
    /// The VMM could not be recognised.
    #[error("cannot tell which VMM {0:?} is (expected cloud-hypervisor or qemu-system-*); name it with --vmm")]
    UnknownVmm(OsString),
    /// The VMM command line cannot carry hugemem's memory.
    #[error("cannot build the VMM command line")]
    Build(#[from] BuildError),
    /// Talking to the daemon failed.
    #[error("the hugemem daemon did not provide the memory")]
    Client(#[from] ClientError),
    /// The daemon's reply cannot be used.
    #[error("unusable allocation from the daemon: {0}")]
    Reply(String),
    /// Starting the VMM failed.
    #[error("cannot start {program:?}")]
    Spawn {
        /// The program.
        program: OsString,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A stop signal came before the VMM started: it was not started.
    #[error("stopped by {0} before the VMM started (nothing ran)")]
    Stopped(String),
    /// Waiting for the VMM or handling signals failed.
    #[error("cannot wait for the VMM")]
    Wait(#[source] std::io::Error),
    /// A clone could not be set up (`launch --clone-of`).
    #[error("cannot clone the VM parked as {name:?}: {}", hugemem_client::diag::chain(.source.as_ref()))]
    Clone {
        /// The template's name.
        name: String,
        /// The step that failed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The VMM's adapter does not do this (yet).
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
}

/// A step a VMM's adapter does not do (yet): `launch --restore` of QEMU,
/// for one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} is not supported for {vmm} yet")]
pub struct Unsupported {
    /// The VMM's name.
    pub vmm: &'static str,
    /// The step, as the user asked for it.
    pub what: &'static str,
}
