//! cloud-hypervisor's side of `hugemem launch --clone-of NAME`: a new
//! cloud-hypervisor that runs a clone of the VM parked as NAME (its
//! template), which stays parked.
//!
//! Shared mode, before the process starts: the launcher asks the daemon
//! for the template (CLONE) on one end of a socket pair and plays the
//! receiving cloud-hypervisor on the other (`ch_migration::peer`): it
//! gets each memory slot as a read-only fd, the configuration and the
//! state. The fds are the new process's inherited descriptors, named
//! `/dev/fd/N` in the configuration with `shared` off
//! (`ch_migration::clone`), so cloud-hypervisor opens each read-only and
//! maps it privately: a page is copied only when the clone writes it.
//! Once the process runs (its API and event monitor bound first, as for a
//! restore), it `receive-migration`s and the launcher sends it `Start →
//! Config → State → Complete`, and no memory. What a second process
//! cannot hold gets the clone's own (`ch_migration::clone::clone_identity`:
//! a new tap per net, a vsock socket of its own), each said.

use std::collections::BTreeMap;
use std::error::Error;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use ch_migration::peer::{receive_snapshot, send_snapshot};
use ch_migration::Limits;
use hugemem_client::client::{Client, ClientError};
use hugemem_client::proto::CloneMode;

use super::api::{ChApi, ChApiError};
use super::events::{ChEvents, ChEventsError, RECEIVE_READY};
use super::restore::command_line;
use crate::launch::config::LaunchConfig;
use crate::launch::error::LaunchError;
use crate::launch::vmm::adapter::{CloneLaunch, CloneReceiver, VmmClone};

/// cloud-hypervisor runs clones of parked VMs.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct ChClone;

/// Why a clone did not start.
#[derive(Debug, thiserror::Error)]
pub enum CloneError {
    /// The daemon refused or failed CLONE.
    #[error("{}", hugemem_client::diag::chain(.0))]
    Daemon(ClientError),
    /// The template did not arrive whole.
    #[error("receiving the template from the daemon: {0}")]
    Template(ch_migration::ChMigrationError),
    /// The receiving thread could not run.
    #[error("the thread receiving the template failed")]
    Thread,
    /// The socket pair.
    #[error("cannot make a socket pair: {0}")]
    Pair(std::io::Error),
    /// A template memory descriptor could not be examined.
    #[error("cannot examine the template's memory descriptors: {0}")]
    MemoryFd(std::io::Error),
    /// The template's configuration cannot be a clone's.
    #[error(transparent)]
    Config(#[from] ch_migration::clone::CloneConfigError),
    /// No `migration-receive-ready` event in time.
    #[error("cloud-hypervisor did not listen for the clone ({0}): is it cloud-hypervisor?")]
    NotListening(ChEventsError),
    /// The migration socket could not be reached.
    #[error("cannot reach cloud-hypervisor's migration socket: {0}")]
    Connect(std::io::Error),
    /// cloud-hypervisor refused the clone's snapshot.
    #[error("cloud-hypervisor refused the clone: {0}")]
    Send(ch_migration::ChMigrationError),
    /// `receive-migration` failed.
    #[error("cloud-hypervisor's receive-migration: {0}")]
    Receive(ChApiError),
    /// `receive-migration` did not answer in time.
    #[error("cloud-hypervisor did not run the clone within {0:?}")]
    NotRunning(Duration),
}

/// The template as CLONE sent it: its memory fds by slot, configuration
/// and state, and our end of the socket it came on. The daemon keeps the
/// clone's huge pages promised until that end closes: the launcher keeps
/// it open until its cloud-hypervisor has mapped the template (so the
/// kernel's reservation shows), then drops it.
fn take_template(
    client: &mut Client,
    name: &str,
    mode: CloneMode,
) -> Result<
    (
        hugemem_client::park::Exported,
        ch_migration::peer::Snapshot,
        UnixStream,
    ),
    CloneError,
> {
    let (ours, theirs) = UnixStream::pair().map_err(CloneError::Pair)?;
    let (template, snapshot) = std::thread::scope(|s| {
        let receiver = s.spawn(|| receive_snapshot(&ours, Limits::default()));
        let sent = client.clone_parked(name, mode, &theirs);
        // A refusal sends nothing: the receiver sees the end of the stream.
        drop(theirs);
        let received = receiver.join().map_err(|_| CloneError::Thread)?;
        let template = sent.map_err(CloneError::Daemon)?;
        Ok::<_, CloneError>((template, received.map_err(CloneError::Template)?))
    })?;
    Ok((template, snapshot, ours))
}

/// The path each memory slot's file has in the new process
/// (`/dev/fd/N`). Slots of one file (a zone of over 3 GiB has a slot below
/// and one above the 32-bit PCI hole, each sent with its own descriptor)
/// get the first one's path, so that the zone names one file.
fn slot_paths(memory: &[(u32, OwnedFd)]) -> std::io::Result<BTreeMap<u32, String>> {
    let mut by_file: Vec<((u64, u64), String)> = Vec::new();
    let mut paths = BTreeMap::new();
    for (slot, fd) in memory {
        let raw = fd.as_raw_fd();
        let meta = std::fs::metadata(format!("/proc/self/fd/{raw}"))?;
        let file = (meta.dev(), meta.ino());
        let path = match by_file.iter().find(|(f, _)| *f == file) {
            Some((_, path)) => path.clone(),
            None => {
                let path = format!("/dev/fd/{raw}");
                by_file.push((file, path.clone()));
                path
            }
        };
        paths.insert(*slot, path);
    }
    Ok(paths)
}

impl VmmClone for ChClone {
    fn prepare(
        &self,
        cfg: &LaunchConfig,
        private: &Path,
        client: &mut Client,
        (name, mode): (&str, CloneMode),
    ) -> Result<CloneLaunch, LaunchError> {
        let failed = |e: CloneError| LaunchError::Clone {
            name: name.to_string(),
            source: Box::new(e),
        };
        let s = command_line(cfg, private)?;
        let (template, snapshot, promise) = take_template(client, name, mode).map_err(failed)?;
        let files = slot_paths(&snapshot.memory).map_err(|e| failed(CloneError::MemoryFd(e)))?;
        let config = ch_migration::clone::shared_clone_config(&snapshot.config, &files)
            .map_err(|e| failed(e.into()))?;
        // What a second process cannot hold (a tap, a vsock's socket) gets
        // its own; the launcher's pid tells this clone's apart.
        let (config, replaced) = ch_migration::clone::clone_identity(
            &config,
            std::process::id(),
            &ch_migration::clone::ThisHost,
        )
        .map_err(|e| failed(e.into()))?;
        let mut inherit = vec![OwnedFd::from(s.api_listener), s.events_write];
        inherit.extend(snapshot.memory.into_iter().map(|(_, fd)| fd));
        let receiver = ChCloneReceiver {
            api: ChApi::new(&s.api_path),
            events: Some(s.events_read),
            receive_path: private.join("clone.sock"),
            deadline: cfg.update_timeout,
            config,
            state: snapshot.state,
            promise: Some(promise),
        };
        Ok(CloneLaunch {
            argv: s.argv,
            inherit,
            receiver: Box::new(receiver),
            bytes: template.bytes,
            page_size: template.page_size,
            replaced: replaced.iter().map(ToString::to_string).collect(),
        })
    }
}

/// The receiving half: the new process's API and events, and what it is
/// sent.
struct ChCloneReceiver {
    api: ChApi,
    events: Option<std::os::fd::OwnedFd>,
    receive_path: PathBuf,
    deadline: Duration,
    config: Vec<u8>,
    state: Vec<u8>,
    /// Our end of the socket CLONE came on, closed once the clone runs
    /// (its memory mapped): the daemon's promise of its pages ends then.
    promise: Option<UnixStream>,
}

impl ChCloneReceiver {
    fn start_clone(&mut self) -> Result<(), CloneError> {
        let deadline = self.deadline;
        let (done_tx, done_rx) = mpsc::channel();
        let receiver = self.api.clone();
        let listen = self.receive_path.clone();
        std::thread::spawn(move || {
            let _ = done_tx.send(receiver.receive_migration(&listen, deadline));
        });
        let events = self
            .events
            .take()
            .ok_or(CloneError::NotListening(ChEventsError::Closed))?;
        let mut events = ChEvents::new(events);
        events
            .wait_for(RECEIVE_READY, deadline)
            .map_err(CloneError::NotListening)?;
        let stream = UnixStream::connect(&self.receive_path).map_err(CloneError::Connect)?;
        send_snapshot(&stream, &[], &self.config, &self.state, false).map_err(CloneError::Send)?;
        match done_rx.recv_timeout(deadline) {
            // Mapped and reserved: the daemon's promise may end.
            Ok(Ok(())) => drop(self.promise.take()),
            Ok(Err(e)) => return Err(CloneError::Receive(e)),
            Err(_) => return Err(CloneError::NotRunning(deadline)),
        }
        events.drain_in_background();
        Ok(())
    }
}

impl CloneReceiver for ChCloneReceiver {
    fn start(&mut self) -> Result<(), Box<dyn Error + Send + Sync>> {
        Ok(self.start_clone()?)
    }

    fn stop(&self) {
        let _ = self.api.shutdown_vmm(self.deadline);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(name: &str) -> OwnedFd {
        nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .expect("memfd_create")
    }

    /// A zone over the 32-bit hole comes as two slots, each with its own
    /// descriptor of one file: both get the first one's path, so the zone
    /// names one file; another file keeps its own.
    #[test]
    fn slots_of_one_file_share_its_path() {
        let low = memfd("zone0");
        let high = low.try_clone().expect("dup");
        let other = memfd("zone1");
        let raw = |fd: &OwnedFd| fd.as_raw_fd();
        let expect = [
            (0, format!("/dev/fd/{}", raw(&low))),
            (1, format!("/dev/fd/{}", raw(&low))),
            (2, format!("/dev/fd/{}", raw(&other))),
        ];
        let memory = vec![(0, low), (1, high), (2, other)];
        let paths = slot_paths(&memory).expect("the descriptors");
        assert_eq!(paths, BTreeMap::from(expect));
    }
}
