//! A blocking client for the hugemem daemon: `connect → handshake → alloc`.
//!
//! Used by `hugemem launch`, `hugemem demo`, the tests, and rust-vmm VMMs:
//! `Client::connect → alloc →` [`Allocation::guest_memory`] gives a
//! `vm-memory` `GuestMemoryMmap` (see [`crate::guest_memory`]);
//! [`Allocation::into_parts`] gives the raw fds to a VMM that maps them itself.
//!
//! [`Allocation::guest_memory`]: crate::client::Allocation::guest_memory
//! [`Allocation::into_parts`]: crate::client::Allocation::into_parts
//! [`FEATURE_REATTACH`]: crate::proto::FEATURE_REATTACH
//! [`Allocation::token`]: crate::client::Allocation::token
//! [`Client::reconnect`]: crate::client::Client::reconnect
//! [`Client::reattach`]: crate::client::Client::reattach
//!
//! **After a daemon restart.** The ALLOC reply carries a secret token when
//! the daemon speaks [`FEATURE_REATTACH`] ([`Allocation::token`]). A restarted
//! daemon restores its allocations *orphaned*; the VMM, which keeps its
//! mappings, takes its allocation back on a new connection with
//! [`Client::reconnect`] (or [`Client::reattach`] on one it opened itself).
//! Until then the memory stays the VMM's: the daemon neither scrubs nor reuses
//! a region some process still maps (quarantine).
//!
//! **A VMM's successor.** A new VMM process (an update under a running
//! guest) takes the allocation over on its own connection with
//! [`Client::handoff`] and the current token: it gets its own fds of the
//! same memory and a new token; the old connection owns nothing from then on.
//!
//! [`Client::handoff`]: crate::client::Client::handoff

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::proto::{
    recv_message, send_message, AllocRequest, Code, Header, ProtoError, RegionInfo, Reply,
    ReplyBody, Request, Status, FEATURE_HANDOFF, FEATURE_LAZY, FEATURE_REATTACH, FEATURE_REBALANCE,
    PROTOCOL_VERSION, TOKEN_SIZE,
};

/// Errors talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be reached.
    #[error("cannot connect to the hugemem daemon at {path}")]
    Connect {
        /// Socket path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A transport or decoding error.
    #[error("protocol error")]
    Proto(#[from] ProtoError),
    /// The daemon refused the request; `message` says why.
    #[error("the daemon refused the request ({status:?}): {message}")]
    Refused {
        /// Status.
        status: Status,
        /// The daemon's reason.
        message: String,
    },
    /// The reply did not match the request.
    #[error("unexpected reply: {0}")]
    Unexpected(String),
}

/// An allocation: region table and one memfd per region.
#[derive(Debug)]
pub struct Allocation {
    /// Allocation id (for FREE, LOCK, UNLOCK).
    pub id: u64,
    /// Regions, in guest-physical order.
    pub regions: Vec<RegionInfo>,
    /// The regions' memfds (or hugetlbfs files), same order.
    pub fds: Vec<OwnedFd>,
    /// Empty, or (for an ALLOC with `want_paths`) each region's hugetlbfs
    /// file path, same order.
    pub paths: Vec<String>,
    /// The daemon's note on success (the reply's message): empty, or why
    /// the memory is not what was hoped for, e.g. a `best` ALLOC served on
    /// a smaller page size and which pages were missing.
    pub note: String,
    /// The re-attach token, when the daemon speaks [`FEATURE_REATTACH`].
    token: Option<[u8; TOKEN_SIZE]>,
}

impl Allocation {
    /// The secret that takes this allocation back after a daemon restart
    /// ([`Client::reattach`], [`Client::reconnect`]); `None` when the daemon
    /// does not speak [`FEATURE_REATTACH`]. Whoever has it (and the
    /// allocation's uid) can take the allocation over: keep it like the fds.
    pub fn token(&self) -> Option<[u8; TOKEN_SIZE]> {
        self.token
    }

    /// The same allocation with duplicates of its descriptors (`dup`, still
    /// close-on-exec): for a second process that maps the same memory (a
    /// VMM's successor) while this one keeps its own. The duplicates share
    /// the open file descriptions; the daemon sees no difference.
    ///
    /// # Errors
    ///
    /// `dup`'s error (EMFILE: too many open files).
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(Self {
            id: self.id,
            regions: self.regions.clone(),
            fds: self
                .fds
                .iter()
                .map(OwnedFd::try_clone)
                .collect::<Result<_, _>>()?,
            paths: self.paths.clone(),
            note: self.note.clone(),
            token: self.token,
        })
    }

    /// Total bytes.
    pub fn size(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    /// Maps every region into this process as a rust-vmm guest memory, each
    /// at its `guest_phys` (`MAP_SHARED`, read-write, no `MAP_NORESERVE`).
    /// The mappings hold their own duplicates of the fds; this allocation
    /// can be dropped afterwards.
    ///
    /// # Errors
    ///
    /// See [`crate::guest_memory::GuestMemoryError`].
    pub fn guest_memory(
        &self,
    ) -> Result<guest_mem::vm_memory::GuestMemoryMmap, crate::guest_memory::GuestMemoryError> {
        let fds: Vec<_> = self.fds.iter().map(AsFd::as_fd).collect();
        crate::guest_memory::guest_memory_from_fds(&self.regions, &fds)
    }

    /// Region table and fds, for a VMM that maps them itself.
    pub fn into_parts(self) -> (u64, Vec<(RegionInfo, OwnedFd)>) {
        (self.id, self.regions.into_iter().zip(self.fds).collect())
    }
}

/// A connection to the daemon, after the handshake.
#[derive(Debug)]
pub struct Client {
    sock: UnixStream,
    next_id: u32,
    features: u64,
    alloc_wait: Option<u32>,
}

impl Client {
    /// Connects and performs the handshake.
    pub fn connect(path: &Path) -> Result<Self, ClientError> {
        let sock = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_stream(sock)
    }

    /// Handshake over an already connected socket.
    pub fn from_stream(sock: UnixStream) -> Result<Self, ClientError> {
        let mut c = Self {
            sock,
            next_id: 1,
            features: 0,
            alloc_wait: None,
        };
        let wanted = FEATURE_LAZY
            | FEATURE_REBALANCE
            | FEATURE_REATTACH
            | FEATURE_HANDOFF
            | crate::proto::FEATURE_PARK
            | crate::proto::FEATURE_CLONE;
        match c.call(&Request::Handshake {
            min_version: PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
            features: wanted,
        })? {
            (ReplyBody::Handshake { features, .. }, _) => c.features = features,
            (other, _) => return Err(ClientError::Unexpected(format!("{other:?} to HANDSHAKE"))),
        }
        Ok(c)
    }

    /// The connection's socket, e.g. to notice (`POLLRDHUP`) that the daemon
    /// went away.
    pub fn socket(&self) -> std::os::fd::BorrowedFd<'_> {
        self.sock.as_fd()
    }

    /// Features both sides support.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Bounds every later call's wait for a reply.
    pub fn set_timeout(&self, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.sock
            .set_read_timeout(timeout)
            .map_err(ProtoError::Io)?;
        Ok(())
    }

    /// How long each later ALLOC of [`Client::alloc`] lets the daemon wait
    /// for pages it holds but cannot hand out yet (quarantined, being
    /// scrubbed, on their way back to the kernel); `None`: the daemon's
    /// default (`pool.alloc_wait_ms`). Saturates at `u32::MAX` ms. The
    /// caller's own reply timeout ([`Client::set_timeout`]) must be longer.
    pub fn set_alloc_wait(&mut self, wait: Option<Duration>) {
        self.alloc_wait = wait.map(|d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX));
    }

    /// Sends one request and waits for its reply; fds that came with it are returned.
    pub fn call(&mut self, req: &Request) -> Result<(ReplyBody, Vec<OwnedFd>), ClientError> {
        self.call_with_fds(req, &[])
    }

    /// [`Client::call`] with fds attached to the request (UFFD carries one).
    pub fn call_with_fds(
        &mut self,
        req: &Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(ReplyBody, Vec<OwnedFd>), ClientError> {
        self.exchange(req, fds)
            .map(|(reply, fds)| (reply.body, fds))
    }

    /// One request, its whole reply (status Ok) and fds.
    pub(crate) fn exchange(
        &mut self,
        req: &Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(Reply, Vec<OwnedFd>), ClientError> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let payload = req.encode();
        let header = Header::request(req.code(), id, payload.len())?;
        send_message(&self.sock.as_fd(), &header, &payload, fds)?;
        let frame = recv_message(&self.sock.as_fd())?;
        if !frame.header.is_reply() || frame.header.id != id || frame.header.code != req.code() {
            return Err(ClientError::Unexpected(format!(
                "reply header {:?} for request {id}",
                frame.header
            )));
        }
        let reply = Reply::decode(frame.header.code, &frame.payload)?;
        if reply.status != Status::Ok {
            return Err(ClientError::Refused {
                status: reply.status,
                message: reply.message,
            });
        }
        Ok((reply, frame.fds))
    }

    /// ALLOC: the region table and one fd per region.
    pub fn alloc(&mut self, req: AllocRequest) -> Result<Allocation, ClientError> {
        let want_paths = req.want_paths;
        let (reply, fds) = self.exchange(
            &Request::Alloc {
                req,
                wait_ms: self.alloc_wait,
            },
            &[],
        )?;
        allocation_from(reply, fds, want_paths, "ALLOC")
    }

    /// HANDOFF: takes allocation `alloc_id` over from the connection that
    /// owns it (this VMM's predecessor process, or an earlier connection of
    /// this one) with its current `token`. Returns it as ALLOC would: the
    /// region table, this process's own fds (and the hugetlbfs paths when
    /// `want_paths` and the regions are files), and a **new** token: the
    /// one shown stops working. From then on the allocation belongs to this
    /// connection (FREE, LOCK, release on disconnect); the old connection's
    /// requests on it are refused and its close releases nothing.
    ///
    /// The memory is the guest's as the predecessor left it: nothing is
    /// cleared (`FLAG_CLEAN` says no other tenant's data is in it).
    ///
    /// # Errors
    ///
    /// [`ClientError::Refused`]: `NotFound` for an unknown id, another
    /// uid's allocation or a wrong token (one message for all; they count
    /// toward the 8 refusals after which the daemon closes the connection);
    /// `Invalid` for an allocation this connection owns already or one
    /// whose lazy clearing has not finished; `Unsupported` when the daemon
    /// does not speak [`FEATURE_HANDOFF`].
    pub fn handoff(
        &mut self,
        alloc_id: u64,
        token: [u8; TOKEN_SIZE],
        want_paths: bool,
    ) -> Result<Allocation, ClientError> {
        if self.features & FEATURE_HANDOFF == 0 {
            return Err(ClientError::Refused {
                status: Status::Unsupported,
                message: "the daemon does not speak HANDOFF (feature bit 3)".into(),
            });
        }
        let (reply, fds) = self.exchange(
            &Request::Handoff {
                alloc_id,
                token,
                want_paths,
            },
            &[],
        )?;
        let alloc = allocation_from(reply, fds, want_paths, "HANDOFF")?;
        if alloc.id != alloc_id {
            return Err(ClientError::Unexpected(format!(
                "HANDOFF of allocation {alloc_id} answered for allocation {}",
                alloc.id
            )));
        }
        if alloc.token.is_none() {
            return Err(ClientError::Unexpected(
                "a HANDOFF reply without the allocation's new token".into(),
            ));
        }
        Ok(alloc)
    }

    /// REATTACH: takes back allocation `alloc_id`, which a restarted daemon
    /// restored orphaned, with the token of its ALLOC reply. Returns its
    /// region table as the daemon has it now (no fds: the caller still has
    /// them), for the caller to check against what it mapped. From then on
    /// it belongs to this connection (FREE, LOCK, release on disconnect).
    ///
    /// # Errors
    ///
    /// [`ClientError::Refused`] with `NotFound` for an id that is unknown,
    /// live on another connection, another uid's, or a wrong token (one
    /// message for all; after 8 refusals the daemon closes the connection).
    pub fn reattach(
        &mut self,
        alloc_id: u64,
        token: [u8; TOKEN_SIZE],
    ) -> Result<Vec<RegionInfo>, ClientError> {
        match self.call(&Request::Reattach { alloc_id, token })? {
            (
                ReplyBody::Reattach {
                    alloc_id: id,
                    regions,
                },
                _,
            ) if id == alloc_id => Ok(regions),
            (other, _) => Err(ClientError::Unexpected(format!(
                "{} to REATTACH of allocation {alloc_id}",
                body_name(&other)
            ))),
        }
    }

    /// Connects to the daemon at `path` again (after the old connection
    /// closed: a daemon restart) and re-attaches every `(alloc_id, token)`
    /// of `allocs` in order; returns the new connection.
    ///
    /// Connect and handshake are retried with a short backoff (10 ms,
    /// doubling to 200 ms) until `deadline`, while the socket is missing or
    /// refuses or the handshake fails (a daemon that is still starting).
    /// Re-attaching is not retried: a refusal is final.
    ///
    /// # Errors
    ///
    /// The last connect or handshake error once `deadline` has passed;
    /// the first REATTACH refusal (the new connection is then closed, which
    /// releases the allocations re-attached before it).
    pub fn reconnect(
        path: &Path,
        allocs: &[(u64, [u8; TOKEN_SIZE])],
        deadline: Instant,
    ) -> Result<Client, ClientError> {
        let mut backoff = Duration::from_millis(10);
        let mut client = loop {
            match Self::connect_until(path, deadline) {
                Ok(c) => break c,
                Err(e) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(e);
                    }
                    std::thread::sleep(backoff.min(deadline - now));
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
            }
        };
        for &(alloc_id, token) in allocs {
            client.reattach(alloc_id, token)?;
        }
        // Like a fresh connection: no reply timeout unless the caller sets one.
        client.set_timeout(None)?;
        Ok(client)
    }

    /// [`Client::connect`] whose replies (handshake and what follows) wait
    /// at most until `deadline`: a daemon that accepts but is not serving
    /// yet must not hold a reconnect past it.
    fn connect_until(path: &Path, deadline: Instant) -> Result<Self, ClientError> {
        let sock = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        // A zero timeout is refused by the socket call: at least 10 ms.
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10));
        sock.set_read_timeout(Some(left)).map_err(ProtoError::Io)?;
        Self::from_stream(sock)
    }

    /// Ends the connection and returns once the daemon has closed its side:
    /// by then it has ended the session (what the connection held is
    /// released: its allocations freed, a saver's hold on a parked VM
    /// gone). Dropping a client closes the connection without waiting, so
    /// a request on another connection right after may still find the
    /// session alive.
    ///
    /// # Errors
    ///
    /// The socket's shutdown or read failed (the connection is closed
    /// anyway when `self` drops).
    pub fn close(self) -> Result<(), ClientError> {
        self.sock
            .shutdown(std::net::Shutdown::Write)
            .map_err(ProtoError::Io)?;
        let mut sink = [0u8; 512];
        loop {
            match std::io::Read::read(&mut &self.sock, &mut sink) {
                Ok(0) => return Ok(()),
                // Nothing is sent unasked; a stray reply is read and dropped.
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ProtoError::Io(e).into()),
            }
        }
    }

    /// FREE.
    pub fn free(&mut self, alloc_id: u64) -> Result<(), ClientError> {
        self.call(&Request::Free { alloc_id }).map(|_| ())
    }

    /// LOCK (batched in the daemon); returns bytes and microseconds.
    pub fn lock(&mut self, alloc_id: u64, chunk: u64) -> Result<(u64, u64), ClientError> {
        self.lock_call(Request::Lock { alloc_id, chunk })
    }

    /// UNLOCK; returns bytes and microseconds.
    pub fn unlock(&mut self, alloc_id: u64, chunk: u64) -> Result<(u64, u64), ClientError> {
        self.lock_call(Request::Unlock { alloc_id, chunk })
    }

    fn lock_call(&mut self, req: Request) -> Result<(u64, u64), ClientError> {
        match self.call(&req)? {
            (ReplyBody::Lock { bytes, micros }, _) => Ok((bytes, micros)),
            (other, _) => Err(ClientError::Unexpected(format!(
                "{other:?} to {:?}",
                req.code()
            ))),
        }
    }

    /// REBALANCE; returns pages moved and pages that could not move.
    pub fn rebalance(
        &mut self,
        region_id: u64,
        offset: u64,
        len: u64,
        node: u32,
    ) -> Result<(u64, u64), ClientError> {
        match self.call(&Request::Rebalance {
            region_id,
            offset,
            len,
            node,
        })? {
            (
                ReplyBody::Rebalance {
                    pages_moved,
                    pages_failed,
                },
                _,
            ) => Ok((pages_moved, pages_failed)),
            (other, _) => Err(ClientError::Unexpected(format!("{other:?} to REBALANCE"))),
        }
    }

    /// STATS, typed ([`crate::stats::Stats`]; fields this build does not
    /// know are ignored, fields the daemon did not send take their default).
    pub fn stats(&mut self) -> Result<crate::stats::Stats, ClientError> {
        let json = self.stats_text()?;
        serde_json::from_str(&json).map_err(|e| ClientError::Unexpected(format!("STATS json: {e}")))
    }

    /// STATS as a JSON value, every key the daemon sent (for `hugemem status
    /// --json` and readers of fields this build does not know).
    pub fn stats_json(&mut self) -> Result<serde_json::Value, ClientError> {
        let json = self.stats_text()?;
        serde_json::from_str(&json).map_err(|e| ClientError::Unexpected(format!("STATS json: {e}")))
    }

    fn stats_text(&mut self) -> Result<String, ClientError> {
        match self.call(&Request::Stats)? {
            (ReplyBody::Stats { json }, _) => Ok(json),
            (other, _) => Err(ClientError::Unexpected(format!("{other:?} to STATS"))),
        }
    }
}

/// An [`Allocation`] from an ALLOC or HANDOFF reply and its fds: one fd
/// per region, and one path per region when they were asked for.
pub(crate) fn allocation_from(
    reply: Reply,
    fds: Vec<OwnedFd>,
    want_paths: bool,
    request: &str,
) -> Result<Allocation, ClientError> {
    let note = reply.message;
    match reply.body {
        ReplyBody::Alloc { regions, paths, .. } if want_paths && paths.len() != regions.len() => {
            Err(ClientError::Unexpected(format!(
                "{} regions but {} paths",
                regions.len(),
                paths.len()
            )))
        }
        ReplyBody::Alloc {
            alloc_id,
            regions,
            paths,
            token,
        } if fds.len() == regions.len() => Ok(Allocation {
            id: alloc_id,
            regions,
            fds,
            paths,
            note,
            token,
        }),
        ReplyBody::Alloc { regions, .. } => Err(ClientError::Unexpected(format!(
            "{} regions but {} fds",
            regions.len(),
            fds.len()
        ))),
        other => Err(ClientError::Unexpected(format!(
            "{} to {request}",
            body_name(&other)
        ))),
    }
}

/// The code of a request, for messages.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Handshake => "HANDSHAKE",
        Code::Alloc => "ALLOC",
        Code::Free => "FREE",
        Code::Lock => "LOCK",
        Code::Unlock => "UNLOCK",
        Code::Rebalance => "REBALANCE",
        Code::Stats => "STATS",
        Code::Uffd => "UFFD",
        Code::Reattach => "REATTACH",
        Code::Handoff => "HANDOFF",
        Code::Park => "PARK",
        Code::Restore => "RESTORE",
        Code::Unpark => "UNPARK",
        Code::Export => "EXPORT",
        Code::Clone => "CLONE",
    }
}

/// A reply body's kind, for messages (never its content: an ALLOC reply
/// carries the token).
fn body_name(body: &ReplyBody) -> &'static str {
    match body {
        ReplyBody::Handshake { .. } => "a HANDSHAKE reply",
        ReplyBody::Alloc { .. } => "an ALLOC reply",
        ReplyBody::Reattach { .. } => "a REATTACH reply with another id",
        ReplyBody::Lock { .. } => "a LOCK reply",
        ReplyBody::Rebalance { .. } => "a REBALANCE reply",
        ReplyBody::Stats { .. } => "a STATS reply",
        ReplyBody::Parked { .. } => "a PARK reply",
        ReplyBody::Exported { .. } => "an EXPORT reply",
        ReplyBody::Empty => "an empty reply",
    }
}
