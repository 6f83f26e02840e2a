//! cloud-hypervisor's park: its own offload snapshot, sent to the daemon.
//!
//! `hugemem park` listens on a socket in a private directory (mode 0700),
//! has the VM's cloud-hypervisor `send-migration
//! destination_url=unix:…,local=on` to it, checks that the process that
//! connected runs as this user, and hands the connection to the daemon
//! with PARK. The daemon takes the snapshot on it; cloud-hypervisor exits
//! once the daemon answered its last step.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hugemem_client::client::Client;
use hugemem_client::park::Parked;
use nix::sys::socket::{getsockopt, sockopt};

use super::api::ChApi;
use crate::launch::vmm::adapter::ParkError;

/// The VMM, in messages.
const NAME: &str = "cloud-hypervisor";

/// A private directory with a listening socket in it.
pub struct PrivateListener {
    _dir: tempfile::TempDir,
    path: PathBuf,
    listener: UnixListener,
}

impl PrivateListener {
    /// A socket `name` in a new directory of mode 0700 under the runtime
    /// directory (`$XDG_RUNTIME_DIR`, else the temporary directory).
    ///
    /// # Errors
    ///
    /// The directory or socket could not be made.
    pub fn new(name: &str) -> std::io::Result<Self> {
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|p| p.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        // tempfile makes the directory 0700.
        let dir = tempfile::Builder::new()
            .prefix("hugemem-")
            .tempdir_in(base)?;
        let path = dir.path().join(name);
        let listener = UnixListener::bind(&path)?;
        Ok(Self {
            _dir: dir,
            path,
            listener,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next connection of a process of this user's uid.
    ///
    /// # Errors
    ///
    /// [`ParkError::Intruder`] for another uid's process (root can enter
    /// a 0700 directory).
    pub fn accept_own(&self) -> Result<UnixStream, ParkError> {
        let (stream, _) = self.listener.accept()?;
        let cred =
            getsockopt(&stream, sockopt::PeerCredentials).map_err(|e| ParkError::Io(e.into()))?;
        if cred.uid() != nix::unistd::geteuid().as_raw() {
            return Err(ParkError::Intruder {
                uid: cred.uid(),
                vmm: NAME,
            });
        }
        Ok(stream)
    }
}

/// Parks the VM of the cloud-hypervisor whose API is at `api_socket`
/// under `name` in the daemon at `socket`.
///
/// # Errors
///
/// [`ParkError`]; when the daemon refused, the VM keeps running in its
/// cloud-hypervisor (it answered the last step with an error).
pub(super) fn park(
    socket: &Path,
    name: &str,
    api_socket: &Path,
    timeout: Duration,
) -> Result<Parked, ParkError> {
    let mut client = Client::connect(socket)?;
    let listener = PrivateListener::new("park.sock")?;
    let api = ChApi::new(api_socket);
    api.send_migration(listener.path(), true, timeout)
        .map_err(|e| ParkError::Api {
            vmm: NAME,
            source: Box::new(e),
        })?;
    let stream = listener.accept_own()?;
    Ok(client.park(name, &stream)?)
}
