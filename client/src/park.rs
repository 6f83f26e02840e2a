//! Parking a cloud-hypervisor VM in the daemon and restoring it: the
//! requests a VMM's launcher (or `hugemem park`) makes. The daemon plays
//! cloud-hypervisor's offload daemon on a migration socket this side hands
//! it: a stream socket connected to the cloud-hypervisor that sends
//! (`send-migration destination_url=unix:…,local=on`, for PARK) or
//! receives (`receive-migration`, for RESTORE) the VM. The daemon never
//! binds or connects a path a tenant names: the tenant brings the socket.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::client::{allocation_from, Allocation, Client, ClientError};
use crate::proto::{
    valid_park_name, CloneMode, ReplyBody, Request, Status, FEATURE_CLONE, FEATURE_PARK,
};

/// What EXPORT sent: the parked VM, which stays parked, held for the
/// connection that asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exported {
    /// The allocation that holds its memory.
    pub alloc_id: u64,
    /// Bytes of guest memory.
    pub bytes: u64,
    /// The page size of that memory, bytes.
    pub page_size: u64,
    /// When it was parked (seconds since the epoch).
    pub parked_at: u64,
    /// Memory slots.
    pub slots: u32,
}

/// How a RESTORE runs ([`Client::restore_with`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct RestoreOptions<'a> {
    /// End with `CompletePaused`: the VM stays paused in its receiver.
    pub paused: bool,
    /// Postcopy (on demand): a second connection to the same receiver,
    /// which runs `receive-migration …,memory_mode=postcopy` (not announced
    /// yet: the daemon announces it), for its page faults. The VM runs from
    /// the receiver's `Complete`; memory not filled yet is filled as the
    /// receiver asks for it and in the background, and the reply comes once
    /// every page is.
    pub fault: Option<&'a UnixStream>,
    /// A copy clone (COPY): the parked VM is a template and stays parked;
    /// the receiver gets fresh pool memory filled from it (before the VM
    /// runs, or with `fault`, as it runs).
    pub copy: bool,
}

/// What PARK parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parked {
    /// The allocation that holds the parked VM's memory now.
    pub alloc_id: u64,
    /// Bytes of guest memory parked.
    pub bytes: u64,
    /// Of them, bytes copied into pool memory (0: the memory came from
    /// this daemon and was moved, nothing copied).
    pub copied_bytes: u64,
    /// Memory slots.
    pub slots: u32,
}

impl Client {
    fn park_feature(&self, request: &str) -> Result<(), ClientError> {
        if self.features() & FEATURE_PARK == 0 {
            return Err(ClientError::Refused {
                status: Status::Unsupported,
                message: format!("the daemon does not speak {request} (feature bit 4)"),
            });
        }
        Ok(())
    }

    /// PARK: the daemon receives a VM's snapshot on `migration` (connected
    /// to a cloud-hypervisor that runs `send-migration …,local=on` to this
    /// side's listener) and keeps it under `name`. Memory that one of this
    /// uid's allocations holds moves into the parked VM (no byte copied);
    /// other memory is copied into pool memory. The reply comes when the
    /// snapshot was taken whole (the sender's `CompletePaused` answered).
    ///
    /// # Errors
    ///
    /// [`ClientError::Refused`] with the daemon's reason (a name in use, a
    /// snapshot refused, too little memory for a copy).
    pub fn park(&mut self, name: &str, migration: &UnixStream) -> Result<Parked, ClientError> {
        self.park_with(name, migration, false)
    }

    /// [`Client::park`]; with `on_demand`, memory from elsewhere is not
    /// copied now: the daemon keeps the sender's files (a directory's, for
    /// `hugemem park --from-dir --on-demand`) and fills the memory when the
    /// VM is restored, as the receiver asks for it in a postcopy RESTORE
    /// ([`Client::restore_postcopy`]) and in the background.
    ///
    /// # Errors
    ///
    /// As [`Client::park`].
    pub fn park_with(
        &mut self,
        name: &str,
        migration: &UnixStream,
        on_demand: bool,
    ) -> Result<Parked, ClientError> {
        self.park_on(name, &[migration.as_fd()], on_demand)
    }

    /// [`Client::park_with`] for a saved VM: `manifest` is its manifest
    /// file (`saved_vm::manifest`), and the daemon checks every piece of
    /// memory it reads from the sender's files against its checksums: a
    /// damaged file is refused (eager), or fails the restore at the piece
    /// (on demand), and never becomes the VM's memory.
    ///
    /// # Errors
    ///
    /// As [`Client::park`]; a manifest the daemon cannot read or that does
    /// not match the snapshot; a piece that does not match its checksum.
    pub fn park_verified(
        &mut self,
        name: &str,
        migration: &UnixStream,
        manifest: BorrowedFd<'_>,
        on_demand: bool,
    ) -> Result<Parked, ClientError> {
        self.park_on(name, &[migration.as_fd(), manifest], on_demand)
    }

    /// PARK with `fds`: the migration connection, then the manifest when
    /// there is one.
    fn park_on(
        &mut self,
        name: &str,
        fds: &[BorrowedFd<'_>],
        on_demand: bool,
    ) -> Result<Parked, ClientError> {
        self.park_feature("PARK")?;
        check_name(name)?;
        let (reply, _fds) = self.exchange(
            &Request::Park {
                name: name.to_string(),
                on_demand,
                verify: fds.len() > 1,
            },
            fds,
        )?;
        match reply.body {
            ReplyBody::Parked {
                alloc_id,
                bytes,
                copied_bytes,
                slots,
            } => Ok(Parked {
                alloc_id,
                bytes,
                copied_bytes,
                slots,
            }),
            other => Err(ClientError::Unexpected(format!("{other:?} to PARK"))),
        }
    }

    /// RESTORE: the daemon sends the VM parked under `name` on `migration`
    /// (connected to a cloud-hypervisor's `receive-migration` listener),
    /// ending with `CompletePaused` when `paused`, and hands its allocation
    /// to this connection, as ALLOC would (fds, table, token). The parked
    /// record is gone once the reply says OK. [`Client::restore_with`] with
    /// only `paused`.
    ///
    /// # Errors
    ///
    /// [`ClientError::Refused`]: `NotFound` for a name this uid has not
    /// parked; the receiver's refusal otherwise (the VM stays parked).
    pub fn restore(
        &mut self,
        name: &str,
        migration: &UnixStream,
        paused: bool,
    ) -> Result<Allocation, ClientError> {
        let how = RestoreOptions {
            paused,
            ..RestoreOptions::default()
        };
        self.restore_with(name, migration, how)
    }

    /// RESTORE on demand: [`Client::restore_with`] with `fault` as the
    /// fault connection (see [`RestoreOptions::fault`]).
    ///
    /// # Errors
    ///
    /// As [`Client::restore`].
    pub fn restore_postcopy(
        &mut self,
        name: &str,
        migration: &UnixStream,
        fault: &UnixStream,
        paused: bool,
    ) -> Result<Allocation, ClientError> {
        let how = RestoreOptions {
            paused,
            fault: Some(fault),
            copy: false,
        };
        self.restore_with(name, migration, how)
    }

    /// RESTORE as `how` says: the VM parked under `name` goes to the
    /// receiver on `migration` (plain, paused, postcopy, or as a copy
    /// clone of it, its template), and the allocation it runs on is handed
    /// to this connection (an ALLOC reply).
    ///
    /// # Errors
    ///
    /// As [`Client::restore`]; for a copy, `NoMemory` when the pool has no
    /// memory for it.
    pub fn restore_with(
        &mut self,
        name: &str,
        migration: &UnixStream,
        how: RestoreOptions<'_>,
    ) -> Result<Allocation, ClientError> {
        self.park_feature("RESTORE")?;
        check_name(name)?;
        let mut connections = vec![migration.as_fd()];
        connections.extend(how.fault.map(AsFd::as_fd));
        let (reply, fds): (_, Vec<OwnedFd>) = self.exchange(
            &Request::Restore {
                name: name.to_string(),
                paused: how.paused,
                postcopy: how.fault.is_some(),
                copy: how.copy,
            },
            &connections,
        )?;
        allocation_from(reply, fds, false, "RESTORE")
    }

    /// EXPORT: the daemon sends the VM parked under `name` on `migration`
    /// (this side plays the receiving cloud-hypervisor:
    /// `ch_migration::peer::receive_snapshot`) with read-only memory fds,
    /// for saving. The VM stays parked, held for this connection: no other
    /// connection restores, exports or unparks it until this one UNPARKs
    /// it ([`Client::unpark`]) or ends. A VM parked on demand is filled
    /// first.
    ///
    /// # Errors
    ///
    /// [`ClientError::Refused`]: `NotFound` for a name this uid has not
    /// parked; `Invalid` for a VM another connection holds or restores.
    pub fn export(&mut self, name: &str, migration: &UnixStream) -> Result<Exported, ClientError> {
        self.park_feature("EXPORT")?;
        check_name(name)?;
        let (reply, _fds) = self.exchange(
            &Request::Export {
                name: name.to_string(),
            },
            &[migration.as_fd()],
        )?;
        match reply.body {
            ReplyBody::Exported {
                alloc_id,
                bytes,
                page_size,
                parked_at,
                slots,
            } => Ok(Exported {
                alloc_id,
                bytes,
                page_size,
                parked_at,
                slots,
            }),
            other => Err(ClientError::Unexpected(format!("{other:?} to EXPORT"))),
        }
    }

    /// CLONE: the daemon sends the template parked under `name` on
    /// `migration` (this side plays the receiving cloud-hypervisor:
    /// `ch_migration::peer::receive_snapshot`), as EXPORT does; the
    /// template stays parked. In [`CloneMode::Shared`] the memory fds are
    /// read-only, for the clone's cloud-hypervisor to map privately, and
    /// the clone counts against the template (RESTORE and UNPARK of it are
    /// refused) until this connection ends.
    ///
    /// # Errors
    ///
    /// [`ClientError::Refused`]: `NotFound` for a name this uid has not
    /// parked; `NoMemory` when the free huge pages left after the clone
    /// would be below the daemon's headroom; `Invalid` for a VM that
    /// cannot be cloned in `mode` (the message says why); `Unsupported`
    /// for a mode the daemon does not serve.
    pub fn clone_parked(
        &mut self,
        name: &str,
        mode: CloneMode,
        migration: &UnixStream,
    ) -> Result<Exported, ClientError> {
        if self.features() & FEATURE_CLONE == 0 {
            return Err(ClientError::Refused {
                status: Status::Unsupported,
                message: "the daemon does not speak CLONE (feature bit 5)".into(),
            });
        }
        check_name(name)?;
        let (reply, _fds) = self.exchange(
            &Request::Clone {
                name: name.to_string(),
                mode,
            },
            &[migration.as_fd()],
        )?;
        match reply.body {
            ReplyBody::Exported {
                alloc_id,
                bytes,
                page_size,
                parked_at,
                slots,
            } => Ok(Exported {
                alloc_id,
                bytes,
                page_size,
                parked_at,
                slots,
            }),
            other => Err(ClientError::Unexpected(format!("{other:?} to CLONE"))),
        }
    }

    /// UNPARK: drops the VM parked under `name`; its memory goes back to
    /// the pool (scrubbed before anyone gets it).
    ///
    /// # Errors
    ///
    /// [`ClientError::Refused`]: `NotFound` for a name this uid has not parked.
    pub fn unpark(&mut self, name: &str) -> Result<(), ClientError> {
        self.park_feature("UNPARK")?;
        check_name(name)?;
        self.exchange(
            &Request::Unpark {
                name: name.to_string(),
            },
            &[],
        )?;
        Ok(())
    }
}

fn check_name(name: &str) -> Result<(), ClientError> {
    if valid_park_name(name) {
        Ok(())
    } else {
        Err(ClientError::Refused {
            status: Status::Invalid,
            message: format!(
                "{name:?} cannot name a parked VM: 1 to 64 ASCII letters, digits, '.', '_' and '-', \
                 starting with a letter or digit"
            ),
        })
    }
}
