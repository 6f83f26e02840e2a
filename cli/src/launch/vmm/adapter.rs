//! The trait every VMM's adapter implements, and what its steps hand back.

use std::error::Error;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use hugemem_client::client::{Allocation, Client, ClientError};
use hugemem_client::park::Parked;
use hugemem_client::proto::CloneMode;

use crate::launch::command_line::{BuildError, BuildOptions, MemoryRegion, Vmm};
use crate::launch::config::LaunchConfig;
use crate::launch::error::{LaunchError, Unsupported};
use crate::launch::update::{UpdateReport, VmmSwitch};

/// What `hugemem` does with one kind of VMM: launch it on daemon memory,
/// update it under a running guest, park its VM in the daemon and restore
/// a parked VM into it. A step the VMM does not support (yet) answers
/// [`Unsupported`], never a silent no-op.
///
/// Clones (a VM started from a parked VM, its template, which stays
/// parked) are [`clone`](Self::clone), beside [`restore`](Self::restore).
pub trait VmmAdapter: Sync {
    /// Its kind.
    fn kind(&self) -> Vmm;

    /// Its name in messages and reports ("QEMU", "cloud-hypervisor").
    fn name(&self) -> &'static str;

    /// The name `--vmm` takes for it ("qemu", "cloud-hypervisor").
    fn id(&self) -> &'static str;

    // Launch.

    /// Checks the user's VMM arguments before anything is allocated, for
    /// an allocation of `regions` regions.
    ///
    /// # Errors
    ///
    /// [`BuildError::Conflict`] naming the first option that sets guest
    /// RAM, and what else the VMM cannot take with hugemem's memory.
    fn check_args(
        &self,
        args: &[OsString],
        opts: &BuildOptions,
        regions: usize,
    ) -> Result<(), BuildError>;

    /// The VMM's arguments (without the program) on `regions`: hugemem's
    /// memory options and the user's arguments.
    ///
    /// # Errors
    ///
    /// As [`check_args`](Self::check_args), plus [`BuildError::NoRegions`]
    /// and [`BuildError::BadPath`].
    fn build_args(
        &self,
        args: &[OsString],
        regions: &[MemoryRegion],
        opts: &BuildOptions,
    ) -> Result<Vec<OsString>, BuildError>;

    // Update.

    /// Sets live updates up for the VMM about to run `full` (program
    /// first) for `cfg`: adds the channels an update needs to `full`, and
    /// returns the switch that moves the guest to a successor and the
    /// descriptors the VMM inherits for those channels.
    ///
    /// # Errors
    ///
    /// [`LaunchError::Options`] when the channels cannot be set up or the
    /// user's command line rules them out.
    fn update_switch(
        &self,
        cfg: &LaunchConfig,
        full: &mut Vec<OsString>,
    ) -> Result<(Box<dyn VmmSwitch>, Vec<OwnedFd>), LaunchError>;

    /// One line for `hugemem update` to print about `report`.
    fn describe_update(&self, report: &UpdateReport) -> String;

    /// Whether an update's successor maps memory the daemon hands to it
    /// (HANDOFF), rather than the running VMM's own descriptors, which its
    /// migration passes on.
    fn successor_memory_by_handoff(&self) -> bool;

    // Park.

    /// Parks the VM whose VMM is reached at `vm_control` (its API or
    /// monitor socket) under `name` in the daemon at `daemon`.
    ///
    /// # Errors
    ///
    /// [`ParkError`]; [`ParkError::Unsupported`] for a VMM that cannot
    /// park yet.
    fn park(
        &self,
        daemon: &Path,
        name: &str,
        vm_control: &Path,
        timeout: Duration,
    ) -> Result<Parked, ParkError>;

    // Restore.

    /// How this VMM receives a parked VM (`launch --restore`).
    ///
    /// # Errors
    ///
    /// [`LaunchError::Unsupported`] for a VMM that cannot restore yet.
    fn restore(&self) -> Result<&dyn VmmRestore, LaunchError>;

    /// Whether it can take a parked VM's memory on demand (postcopy:
    /// `--restore --on-demand`, a copy clone filled as it runs). Without,
    /// a copy clone is filled before its guest runs.
    fn restores_on_demand(&self) -> bool;

    // Clone.

    /// How this VMM starts a clone of a parked VM (`launch --clone-of`).
    ///
    /// # Errors
    ///
    /// [`LaunchError::Unsupported`] for a VMM that cannot clone yet.
    fn clone(&self) -> Result<&dyn VmmClone, LaunchError>;

    // Guests (the benches and tests boot the project's micro-guest).

    /// The VMM's exit status once a guest ended with `code` on the debug
    /// exit port (QEMU's `isa-debug-exit`: `(code << 1) | 1`) or powered
    /// the VM off.
    fn exit_status_of_guest(&self, code: u8) -> i32;

    /// The arguments that boot the PVH kernel at `kernel`.
    fn kernel_args(&self, kernel: &Path) -> Vec<OsString>;
}

/// A VMM's side of `launch --restore`.
pub trait VmmRestore: Sync {
    /// The command line of a VMM that waits to receive a parked VM, for
    /// `cfg` (its user arguments), with what it needs in `private` (a
    /// directory of the launcher's own).
    ///
    /// # Errors
    ///
    /// [`LaunchError::Options`] for user arguments the restore cannot take,
    /// and when its sockets cannot be made.
    fn prepare(&self, cfg: &LaunchConfig, private: &Path) -> Result<RestoreLaunch, LaunchError>;
}

/// A VMM about to start for a restore.
pub struct RestoreLaunch {
    /// Its full argument list, program first.
    pub argv: Vec<OsString>,
    /// Descriptors it inherits under their numbers; the launcher closes
    /// its copies once it started.
    pub inherit: Vec<OwnedFd>,
    /// What has it receive the VM, once it started.
    pub receiver: Box<dyn RestoreReceiver>,
    /// Its live-update switch, when the launch listens for updates.
    pub update: Option<Box<dyn VmmSwitch>>,
}

/// The receiving half of a restore, run on the launcher's watcher thread
/// once the VMM started.
pub trait RestoreReceiver: Send {
    /// Has the VMM receive the VM parked as `name` from the daemon on
    /// `client` (RESTORE, filled as it asks when `on_demand`) and returns
    /// the allocation once the VM runs.
    ///
    /// # Errors
    ///
    /// The step that failed; the VM stays parked.
    fn receive(
        &mut self,
        client: &mut Client,
        name: &str,
        on_demand: bool,
    ) -> Result<Allocation, Box<dyn Error + Send + Sync>>;

    /// After a failed [`receive`](Self::receive): stops the VMM.
    fn stop(&self);
}

/// A VMM's side of `launch --clone-of`.
pub trait VmmClone: Sync {
    /// Takes the template parked as `template.0` from the daemon on
    /// `client` (CLONE in mode `template.1`) and makes the command line of a VMM that will
    /// run the clone, for `cfg` (its user arguments), with what it needs
    /// in `private` (a directory of the launcher's own).
    ///
    /// # Errors
    ///
    /// [`LaunchError::Options`] for user arguments a clone cannot take;
    /// [`LaunchError::Clone`] for the daemon's refusal or a template that
    /// cannot be cloned in that mode.
    fn prepare(
        &self,
        cfg: &LaunchConfig,
        private: &Path,
        client: &mut Client,
        template: (&str, CloneMode),
    ) -> Result<CloneLaunch, LaunchError>;
}

/// A VMM about to start as a clone.
pub struct CloneLaunch {
    /// Its full argument list, program first.
    pub argv: Vec<OsString>,
    /// Descriptors it inherits under their numbers (its channels, and in
    /// shared mode the template's read-only memory); the launcher closes
    /// its copies once it started.
    pub inherit: Vec<OwnedFd>,
    /// What has it start the clone, once it started.
    pub receiver: Box<dyn CloneReceiver>,
    /// The template's memory, bytes.
    pub bytes: u64,
    /// Its page size, bytes.
    pub page_size: u64,
    /// What of the template's a second process cannot hold and the clone
    /// got in its place, one line a device (`net0: …`).
    pub replaced: Vec<String>,
}

/// The receiving half of a clone, run on the launcher's watcher thread
/// once the VMM started.
pub trait CloneReceiver: Send {
    /// Has the VMM take the clone's snapshot and run it.
    ///
    /// # Errors
    ///
    /// The step that failed.
    fn start(&mut self) -> Result<(), Box<dyn Error + Send + Sync>>;

    /// After a failed [`start`](Self::start): stops the VMM.
    fn stop(&self);
}

/// Why a park failed.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    /// The daemon refused or failed.
    #[error(transparent)]
    Daemon(#[from] ClientError),
    /// The VMM's control channel refused or failed.
    #[error("{vmm}'s API: {source}")]
    Api {
        /// The VMM.
        vmm: &'static str,
        /// The cause.
        #[source]
        source: Box<dyn Error + Send + Sync>,
    },
    /// The migration socket.
    #[error("the migration socket: {0}")]
    Io(#[from] std::io::Error),
    /// Another user's process connected to the migration socket.
    #[error("a process of uid {uid} connected to the migration socket, not {vmm}")]
    Intruder {
        /// Its uid.
        uid: u32,
        /// The VMM that should have.
        vmm: &'static str,
    },
    /// The VMM cannot park yet.
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
}
