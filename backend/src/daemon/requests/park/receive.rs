//! PARK: a VM's snapshot taken from a cloud-hypervisor's local migration,
//! checked, and its memory moved (it is one of the tenant's allocations)
//! or copied (it came from elsewhere) into a parked record. See the room's
//! docs ([`super`]).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use ch_migration::peer::{answer_complete, receive_until_complete};
use ch_migration::Limits;
use tracing::{info, warn};

use super::refusal::{refuse, Asker};
use super::snapshot::{check, invalid, now_secs, Checked, ParkRequest, ParkedOk, Refusal};
use super::socket::migration_socket;
use super::verify::read_manifest;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::pool::{AllocId, FileOwner, ParkedSlot, ParkedVm, ParkedVmm, SessionId};
use crate::daemon::requests::outcome::Outcome;
use crate::daemon::requests::rooms::Rooms;
use crate::proto::messages::{Reply, ReplyBody};
use crate::proto::Status;
use hugemem_client::saved_vm::manifest::Manifest;

/// Where a snapshot's memory is.
#[derive(Debug)]
enum Origin {
    /// In one allocation of the tenant's, owned by `session`; each slot's
    /// region index.
    Allocation {
        alloc: AllocId,
        session: Option<SessionId>,
        slots: Vec<ParkedSlot>,
    },
    /// Nowhere in the pool: copied.
    Elsewhere,
}

fn origin(rooms: &Rooms, uid: u32, checked: &Checked) -> Result<Origin, Refusal> {
    let parking = rooms.pool.parking();
    let mut found: BTreeMap<u32, FileOwner> = BTreeMap::new();
    for f in &checked.memory {
        if let Some(owner) = parking.owner_of_file(f.identity.0, f.identity.1) {
            found.insert(f.slot, owner);
        }
    }
    if found.is_empty() {
        return Ok(Origin::Elsewhere);
    }
    if found.len() != checked.memory.len() {
        return Err(invalid(
            "some memory slots are a hugemem allocation's and some are not: park refuses a mix",
        ));
    }
    let mut alloc_seen: Option<(AllocId, Option<SessionId>)> = None;
    let mut slots = Vec::new();
    for (slot, owner) in found {
        let FileOwner::Allocation {
            alloc,
            region,
            tenant,
            session,
        } = owner
        else {
            return Err(invalid(format!(
                "memory fd of slot {slot} is pool memory that no allocation of yours holds"
            )));
        };
        if tenant != uid {
            return Err(invalid(format!(
                "memory fd of slot {slot} is pool memory that no allocation of yours holds"
            )));
        }
        match alloc_seen {
            Some((a, _)) if a != alloc => {
                return Err(invalid("the memory slots are in more than one allocation"));
            }
            _ => alloc_seen = Some((alloc, session)),
        }
        slots.push(ParkedSlot { slot, region });
    }
    let Some((alloc, session)) = alloc_seen else {
        return Ok(Origin::Elsewhere);
    };
    // In the order the slots came (a restore sends them so).
    slots.sort_by_key(|s| {
        checked
            .memory
            .iter()
            .position(|f| f.slot == s.slot)
            .unwrap_or(usize::MAX)
    });
    Ok(Origin::Allocation {
        alloc,
        session,
        slots,
    })
}

/// Parks a snapshot whose memory is allocation `alloc` of the tenant's:
/// the allocation's change gate is taken (the owner's moves cancelled
/// first) and it moves into the record in one step.
async fn move_in(
    rooms: &Rooms,
    req: &ParkRequest,
    checked: &Checked,
    (alloc, session, slots): (AllocId, Option<SessionId>, Vec<ParkedSlot>),
) -> Result<ParkedOk, Refusal> {
    let gone = || {
        (
            Status::NotFound,
            format!("allocation {alloc} changed hands while it was being parked"),
        )
    };
    let gate = rooms.pool.parking().gate_of(alloc).ok_or_else(gone)?;
    if let Some(owner) = session {
        rooms.rebalance.cancel_client_moves(alloc, owner);
    }
    let _held = gate.lock_owned().await;
    let n = u32::try_from(slots.len()).unwrap_or(u32::MAX);
    let vm = ParkedVm {
        name: req.name.clone(),
        slots,
        config: checked.config.clone(),
        state: checked.state.clone(),
        copied_bytes: 0,
        parked_at: now_secs(),
        vmm: Some(ParkedVmm::of_config(&checked.config)),
    };
    let bytes = rooms
        .pool
        .parking()
        .park(alloc, req.uid, session, vm, false)
        .map_err(|e| (Status::Invalid, e.to_string()))?;
    Ok(ParkedOk {
        alloc,
        bytes,
        copied: 0,
        slots: n,
    })
}

/// A PARK with VERIFY that does not carry its two fds.
#[derive(Debug, thiserror::Error)]
#[error("a PARK with VERIFY carries 2 fds, the migration socket and the manifest (got {0})")]
pub struct WrongFdCount(usize);

/// The request's fds: the migration socket, and with VERIFY the manifest.
fn split_fds(
    mut fds: Vec<OwnedFd>,
    req: &ParkRequest,
) -> Result<(Vec<OwnedFd>, Option<OwnedFd>), WrongFdCount> {
    if !req.verify {
        // `migration_socket` says what is wrong with the count.
        return Ok((fds, None));
    }
    if fds.len() != 2 {
        return Err(WrongFdCount(fds.len()));
    }
    let manifest = fds.pop();
    Ok((fds, manifest))
}

/// PARK (see the module docs).
pub async fn park(rooms: &Arc<Rooms>, req: ParkRequest, fds: Vec<OwnedFd>) -> Outcome {
    let (socket, manifest) = match split_fds(fds, &req) {
        Ok(f) => f,
        Err(e) => return refused(rooms, &req, Status::Invalid, e.to_string()),
    };
    let stream = match migration_socket(socket, req.uid) {
        Ok(s) => s,
        Err(e) => return refused(rooms, &req, Status::Invalid, e.to_string()),
    };
    if rooms
        .pool
        .parking()
        .find_parked(req.uid, &req.name)
        .is_some()
    {
        let msg = format!(
            "a VM named {:?} is parked already (UNPARK it, or choose another name)",
            req.name
        );
        return refused(rooms, &req, Status::Invalid, msg);
    }
    let limits = Limits::default();
    let started = std::time::Instant::now();
    let step = |what: &'static str| {
        tracing::debug!(
            ms = started.elapsed().as_secs_f64() * 1e3,
            "PARK step: {what}"
        );
    };
    let received = tokio::task::spawn_blocking(move || {
        let snapshot = receive_until_complete(&stream, limits);
        (stream, snapshot)
    })
    .await;
    let (stream, snapshot) = match received {
        Ok(r) => r,
        Err(e) => return Outcome::error(Status::Internal, e.to_string()),
    };
    step("snapshot received");
    let result = match snapshot {
        Err(e) => Err(invalid(format!("the VM's snapshot was refused: {e}"))),
        Ok(snapshot) => match check(snapshot, &limits) {
            Err(e) => Err(e),
            Ok(checked) => match manifest.map(|fd| read_manifest(fd, &checked)).transpose() {
                Err(e) => Err(e),
                Ok(manifest) => take_in(rooms, &req, checked, manifest).await,
            },
        },
    };
    step("checked and taken in");
    if result.is_ok() {
        // Under systemd, the parked VM is in the fd store before its
        // sender retires it: a crash from now on keeps it.
        rooms.sync_now("PARK").await;
        step("fd store synced");
        rooms.note_parked().await;
        step("note of parked VMs written");
    }
    let outcome = finish(rooms, &req, &stream, result);
    step("answered");
    outcome
}

async fn take_in(
    rooms: &Arc<Rooms>,
    req: &ParkRequest,
    checked: Checked,
    manifest: Option<Manifest>,
) -> Result<ParkedOk, Refusal> {
    match origin(rooms, req.uid, &checked)? {
        Origin::Allocation { .. } if manifest.is_some() => Err(invalid(
            "a park with a manifest checks files it reads; this memory is an allocation of yours, \
             which moves without being read",
        )),
        Origin::Allocation {
            alloc,
            session,
            slots,
        } => move_in(rooms, req, &checked, (alloc, session, slots)).await,
        Origin::Elsewhere => super::copy::copy_in(rooms, req, checked, manifest, now_secs()).await,
    }
}

/// Answers the sender's last step (OK only when the VM is parked: the
/// sender then retires its VM) and the requester.
fn finish(
    rooms: &Rooms,
    req: &ParkRequest,
    stream: &UnixStream,
    result: Result<ParkedOk, Refusal>,
) -> Outcome {
    let answered = answer_complete(stream, result.is_ok());
    match result {
        Ok(p) => {
            if let Err(e) = answered {
                warn!(uid = req.uid, name = %req.name, error = %e, "PARK: the sender did not take the last answer; the VM is parked all the same");
            }
            let kind = if p.copied > 0 { "copied" } else { "moved" };
            Metrics::add(&rooms.metrics.parks, 1);
            info!(
                session = req.session,
                uid = req.uid,
                name = %req.name,
                alloc = p.alloc,
                bytes = p.bytes,
                copied = p.copied,
                slots = p.slots,
                kind,
                "PARK: VM parked"
            );
            Outcome::reply(Reply::ok(ReplyBody::Parked {
                alloc_id: p.alloc,
                bytes: p.bytes,
                copied_bytes: p.copied,
                slots: p.slots,
            }))
        }
        Err((status, msg)) => refused(rooms, req, status, msg),
    }
}

/// A refused PARK, counted and logged (rate-limited per uid) whether the
/// socket, the name or the snapshot was wrong.
fn refused(rooms: &Rooms, req: &ParkRequest, status: Status, msg: String) -> Outcome {
    let asker = Asker {
        what: "PARK",
        session: req.session,
        uid: req.uid,
        name: &req.name,
    };
    refuse(&rooms.metrics.parks_refused, asker, status, msg)
}
