//! The VMM-independent part of an update: the successor's memory, starting
//! it, handing supervision over to it, reaping the VMM it replaced, the
//! report. What moves the guest is the VMM's [`VmmSwitch`].

use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hugemem_client::client::Allocation;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tracing::{info, warn};

use super::error::UpdateError;
use super::mailbox::SuccessorMailbox;
use super::request::{Reply, Request, UpdateReport};
use super::restored_memory::RestoredMemory;
use super::successor_memory::DaemonLink;
use super::switch::VmmSwitch;
use crate::launch::allocation::HeldAllocation;
use crate::launch::config::LaunchConfig;
use crate::launch::error::LaunchError;
use crate::launch::process::{pidfd, Spawner};

/// Where a restored VM's allocation is put once RESTORE handed it over
/// (`launch --restore --name`): the updater takes it at its first update
/// or park.
pub(crate) type MemorySlot = Arc<RestoredMemory>;

/// The launcher's side of live updates: the running VMM's switch, its
/// memory and the daemon link. Served on the thread that waits for the VMM
/// (the control socket calls [`Updater::answer`]).
pub(crate) struct Updater {
    switch: Box<dyn VmmSwitch>,
    daemon: DaemonLink,
    /// The running VMM's memory: the launcher's own descriptors of it
    /// (`None` until a restored VM's arrives in `later`).
    memory: Option<Allocation>,
    /// Where a restored VM's memory arrives once the daemon handed it over.
    later: Option<MemorySlot>,
    /// How long the replaced VMM may take to exit.
    deadline: Duration,
}

impl Updater {
    /// Sets live updates up for a VMM about to run on `alloc`, moved by
    /// `switch` (made by its adapter, which added what the VMM needs for
    /// updates to its command line).
    pub(crate) fn for_launch(
        cfg: &LaunchConfig,
        switch: Box<dyn VmmSwitch>,
        alloc: &Allocation,
        mailbox: &Arc<SuccessorMailbox>,
    ) -> Result<Self, LaunchError> {
        let daemon = DaemonLink {
            socket: cfg.socket.clone(),
            held: HeldAllocation::of(alloc),
            want_paths: cfg.hugetlbfs,
            mailbox: Arc::clone(mailbox),
        };
        let memory = alloc
            .try_clone()
            .map_err(|e| LaunchError::Options(format!("cannot set up live updates: {e}")))?;
        Ok(Self {
            switch,
            daemon,
            memory: Some(memory),
            later: None,
            deadline: cfg.update_timeout,
        })
    }

    /// Sets live updates up for a VMM that restores a parked VM (`launch
    /// --restore --name`), moved by `switch`: its memory comes in `later`
    /// once the daemon handed it over. A VMM whose update passes its own
    /// memory to its successor needs it for nothing but the report.
    pub(crate) fn for_restore(
        cfg: &LaunchConfig,
        switch: Box<dyn VmmSwitch>,
        mailbox: &Arc<SuccessorMailbox>,
        later: MemorySlot,
    ) -> Self {
        Self {
            switch,
            daemon: DaemonLink {
                socket: cfg.socket.clone(),
                held: HeldAllocation {
                    id: 0,
                    token: None,
                    regions: Vec::new(),
                },
                want_paths: false,
                mailbox: Arc::clone(mailbox),
            },
            memory: None,
            later: Some(later),
            deadline: cfg.update_timeout,
        }
    }

    /// The running VMM's memory, once it is known.
    fn memory(&mut self) -> Result<&Allocation, UpdateError> {
        if self.memory.is_none() {
            let arrived = self
                .later
                .as_ref()
                .and_then(|slot| slot.take(self.deadline));
            self.memory = arrived;
        }
        self.memory.as_ref().ok_or_else(|| UpdateError::Migration {
            status: "not started".into(),
            detail: "the VM is still being restored".into(),
        })
    }

    /// Serves one request: the update, or why it failed.
    pub(crate) fn answer(&mut self, request: Request, vmm: &mut Child, spawner: &Spawner) -> Reply {
        let qemu = match request {
            Request::Update { qemu } => qemu,
            Request::Park { name } => return self.park(&name, vmm),
        };
        match self.update(vmm, spawner, qemu) {
            Ok(report) => Reply::Ok(report),
            Err(e) => {
                let name = self.switch.name();
                let text = hugemem_client::diag::chain(&e).to_string();
                warn!(error = %text, "update failed; the running {name} keeps the guest");
                Reply::Error(format!("{text} (the running {name} keeps the guest)"))
            }
        }
    }

    /// Parks the running VM under `name` (the switch's `park`): the VMM
    /// exits once the daemon has it; on an error it runs the guest on,
    /// unless it ended during the park (killed, crashed): then nothing is
    /// parked, the reply says so, and the launcher, seeing it gone, frees
    /// the memory.
    fn park(&mut self, name: &str, running: &mut Child) -> Reply {
        let vmm = self.switch.name();
        let parked = self.switch.connect_running().and_then(|()| {
            self.memory()?;
            let memory = self.memory.as_ref().ok_or_else(|| UpdateError::Migration {
                status: "not started".into(),
                detail: "the VM is still being restored".into(),
            })?;
            self.switch.park(memory, &self.daemon.socket, name)
        });
        match parked {
            Ok(report) => {
                info!(?report, "parked as {name}; {vmm} exits");
                Reply::Parked(report)
            }
            Err(e) => {
                let text = hugemem_client::diag::chain(&e).to_string();
                if let Some(ended) = self.ended_during_park(running) {
                    warn!(error = %text, %ended, "{vmm} ended during the park; nothing parked");
                    return Reply::Error(format!(
                        "{text} (nothing parked: {vmm} ended during the park, {ended}; \
                         the launcher exits and frees the VM's memory)"
                    ));
                }
                warn!(error = %text, "park failed; the running {vmm} keeps the guest");
                Reply::Error(format!(
                    "{text} (nothing parked: the running {vmm} keeps the guest)"
                ))
            }
        }
    }

    /// After a failed park: how `running` ended, when its control channel
    /// is gone and it exits within the deadline (a VMM whose monitor
    /// closed is on its way out; one that lingers is left to the launcher's
    /// wait, not killed here).
    fn ended_during_park(&mut self, running: &mut Child) -> Option<String> {
        if let Ok(Some(status)) = running.try_wait() {
            return Some(status.to_string());
        }
        if self.switch.running_reachable() {
            return None;
        }
        let exited = i32::try_from(running.id())
            .ok()
            .and_then(|p| pidfd(nix::unistd::Pid::from_raw(p)).ok());
        if let Some(fd) = exited {
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
            let millis = u16::try_from(self.deadline.as_millis()).unwrap_or(u16::MAX);
            let _ = poll(&mut fds, PollTimeout::from(millis));
        }
        match running.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            _ => Some("its control channel closed".into()),
        }
    }

    /// One update of `vmm` to `program` (or the same program): on success
    /// `vmm` is the successor and the one it replaced is reaped.
    fn update(
        &mut self,
        vmm: &mut Child,
        spawner: &Spawner,
        program: Option<PathBuf>,
    ) -> Result<UpdateReport, UpdateError> {
        let started = Instant::now();
        let name = self.switch.name();
        self.switch.connect_running()?;
        let program = program.map_or_else(|| self.switch.program().clone(), OsString::from);
        // The successor's own memory, which it inherits; none for a VMM
        // whose migration passes the running one's to it.
        self.memory()?;
        let running = self.memory.as_ref().ok_or(UpdateError::Migration {
            status: "not started".into(),
            detail: "the VM is still being restored".into(),
        })?;
        let own_memory = if self.switch.memory_by_handoff() {
            Some(self.daemon.successor_memory(running)?)
        } else {
            None
        };
        let handoff = own_memory
            .as_ref()
            .is_some_and(|(_, by_handoff)| *by_handoff);
        let memory = own_memory.as_ref().map_or(running, |(m, _)| m);
        let command = self.switch.successor(&program, memory)?;
        let mut inherit: Vec<BorrowedFd<'_>> = own_memory
            .iter()
            .flat_map(|(m, _)| m.fds.iter().map(AsFd::as_fd))
            .collect();
        inherit.extend(command.inherit.iter().map(AsFd::as_fd));
        info!(command = ?command.argv, "starting the successor {name}");
        let mut successor = spawner.spawn(&command.argv, &inherit)?;
        drop(inherit);
        // The successor's ends of its channels are its own now.
        drop(command);
        let switched = match self.switch.switch(vmm, &mut successor) {
            Ok(switched) => switched,
            Err(e) => {
                let _ = successor.kill();
                let _ = successor.wait();
                self.switch.keep_old_running();
                return Err(e);
            }
        };
        // The old VMM has handed the guest over: supervise the successor
        // (the waiting thread sees the new pid) and let the old one go.
        let old_pid = vmm.id();
        let old = std::mem::replace(vmm, successor);
        self.switch.retire_old();
        self.reap(old, old_pid);
        self.switch.retired();
        if let Some((memory, _)) = own_memory {
            self.memory = Some(memory);
        }
        let figures = &switched.figures;
        let report = UpdateReport {
            vmm: name.to_owned(),
            old_pid,
            new_pid: vmm.id(),
            program: program.to_string_lossy().into_owned(),
            handoff,
            ram_transferred_bytes: figures.ram_transferred_bytes,
            ram_total_bytes: figures.ram_total_bytes,
            guest_ram_bytes: self.memory.as_ref().map_or(0, Allocation::size),
            qemu_downtime_ms: figures.downtime_ms,
            qemu_total_ms: figures.total_ms,
            update_ms: started.elapsed().as_secs_f64() * 1e3,
            switch_ms: switched.switch_time.as_secs_f64() * 1e3,
            migrate_at_ns: switched.migrate_at_ns,
            resumed_at_ns: switched.resumed_at_ns,
        };
        info!(?report, "{name} updated under the running guest");
        Ok(report)
    }

    /// Waits for the replaced VMM to exit (it was told to), killing it
    /// when it has not within the deadline.
    fn reap(&self, mut old: Child, pid: u32) {
        let name = self.switch.name();
        let exited = i32::try_from(pid)
            .ok()
            .and_then(|p| pidfd(nix::unistd::Pid::from_raw(p)).ok());
        if let Some(fd) = exited {
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
            let millis = u16::try_from(self.deadline.as_millis()).unwrap_or(u16::MAX);
            if !matches!(poll(&mut fds, PollTimeout::from(millis)), Ok(1)) {
                warn!(pid, "the old {name} did not quit in time; killing it");
                let _ = old.kill();
            }
        }
        match old.wait() {
            Ok(status) => info!(pid, %status, "the old {name} exited"),
            Err(e) => warn!(pid, error = %e, "cannot reap the old {name}"),
        }
    }
}
