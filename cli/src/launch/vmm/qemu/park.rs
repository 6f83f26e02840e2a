//! QEMU's park, run by the launcher that owns its monitor (asked on the
//! control socket by `hugemem park NAME`).
//!
//! QEMU migrates its device state with `x-ignore-shared` (the guest RAM,
//! on shared memory, is left out) into one end of a socket pair
//! (`getfd`, `migrate fd:hm-park`); the launcher reads the stream to its
//! end, at most [`MAX_STREAM`] bytes, and waits for QEMU's MIGRATION
//! `completed` (QEMU is paused from then on). Then it plays the sender of
//! a local migration to the daemon with PARK: a `MemoryFd` per region (the
//! launcher's descriptors of its allocation, which the daemon recognises
//! as the tenant's own and moves, nothing copied), the configuration and
//! the state of `parked.rs`, `Complete`. The caller has QEMU quit only
//! once the daemon answered OK (and answers its requester without waiting
//! for QEMU's reply to `quit`: the VM is parked); on any error it has QEMU
//! go on (`migrate_cancel`, `cont`): nothing was parked.
//!
//! Every step waits on an event, none on a timer: QMP replies, the
//! stream's end, QEMU's MIGRATION event, the daemon's answer. Commands
//! whose replies nothing waits for are sent ahead (`getfd` with
//! `migrate-set-capabilities`; `query-migrate`, whose figures are read
//! after the PARK), and `park` logs each step's time at debug level
//! (`QEMU park step: …`).

use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use hugemem_client::client::{Allocation, Client};
use hugemem_client::park::Parked;
use serde_json::{json, Value};

use super::parked::{ParkedConfig, ParkedRegion, ParkedState, MAX_STREAM};
use super::qmp::{is_event, ram_bytes_sent, Qmp};
use crate::launch::update::UpdateError;

/// What a park did.
#[derive(Debug)]
pub(crate) struct QemuParked {
    /// The daemon's reply.
    pub(crate) parked: Parked,
    /// Bytes of QEMU's migration stream (its device state).
    pub(crate) state_bytes: u64,
    /// RAM bytes QEMU's stream carried (`ram.transferred`; the stream's
    /// length, a bound, when QEMU ended before it could be asked).
    pub(crate) ram_transferred_bytes: u64,
    /// From `migrate` to QEMU's `completed`.
    pub(crate) migrate_time: Duration,
}

fn qmp_err(what: &'static str) -> impl FnOnce(super::qmp::QmpError) -> UpdateError {
    move |source| UpdateError::Control {
        what: what.to_owned(),
        source: Box::new(source),
    }
}

fn failed(status: &str, detail: impl Into<String>) -> UpdateError {
    UpdateError::Migration {
        status: status.to_owned(),
        detail: detail.into(),
    }
}

/// Parks the VM of the QEMU behind `qmp` (running `program` with the
/// user's `args` on `memory`) under `name` in the daemon at `daemon`.
/// QEMU is paused when this returns, whatever the outcome.
pub(crate) fn park(
    qmp: &mut Qmp,
    memory: &Allocation,
    (program, args): (&std::ffi::OsString, &[std::ffi::OsString]),
    (daemon, name): (&Path, &str),
    deadline: Duration,
) -> Result<QemuParked, UpdateError> {
    let regions = memory
        .regions
        .iter()
        .map(|r| ParkedRegion {
            size: r.size,
            node: (r.node != hugemem_client::proto::ANY_NODE).then_some(r.node),
        })
        .collect();
    let config = ParkedConfig::new(program, args, regions)
        .map_err(|e| failed("not started", e.to_string()))?;
    // The daemon first: a daemon that cannot be reached costs the guest nothing.
    let started = Instant::now();
    let mut client = Client::connect(daemon).map_err(|e| failed("not started", e.to_string()))?;
    step(started, "connected to the daemon");
    let (stream, migrate_time) = device_state(qmp, deadline)?;
    tracing::debug!(
        bytes = stream.len(),
        "QEMU's device state read; parking it in the daemon"
    );
    // QEMU has handed its whole state over: from here on its end (killed,
    // crashed) costs the park nothing, the memory being the launcher's.
    let config = serde_json::to_vec(&config).map_err(|e| failed("completed", e.to_string()))?;
    let state = serde_json::to_vec(&ParkedState::new(&stream))
        .map_err(|e| failed("completed", e.to_string()))?;
    let (ours, daemons) = UnixStream::pair()?;
    ours.set_read_timeout(Some(deadline))?;
    let fds: Vec<(u32, BorrowedFd<'_>)> =
        (0u32..).zip(memory.fds.iter().map(AsFd::as_fd)).collect();
    // QEMU's figures are asked for now and read once the daemon answered:
    // QEMU's reply comes while the PARK runs.
    let asked = qmp.send_command("query-migrate", json!({}));
    let parked = std::thread::scope(|s| {
        let sender =
            s.spawn(|| ch_migration::peer::send_snapshot(&ours, &fds, &config, &state, false));
        let answer = client.park(name, &daemons);
        // Our copy goes, so that a sender waiting on a daemon that never
        // read ends too.
        drop(daemons);
        let _ = ours.shutdown(std::net::Shutdown::Both);
        let _ = sender.join();
        answer.map_err(|e| UpdateError::Control {
            what: "the daemon's PARK".into(),
            source: Box::new(e),
        })
    });
    step(started, "the daemon answered PARK");
    // The reply is read whatever the PARK's outcome: the next command's
    // reply must not be taken for it.
    let ram = match asked.and_then(|()| qmp.read_reply("query-migrate")) {
        Ok(stats) => ram_bytes_sent(&stats),
        Err(e) => {
            tracing::warn!(error = %e, "QEMU gave its state and cannot be asked for its figures; parking on");
            stream.len() as u64
        }
    };
    let parked = parked?;
    Ok(QemuParked {
        parked,
        state_bytes: stream.len() as u64,
        ram_transferred_bytes: ram,
        migrate_time,
    })
}

/// Logs (debug) one step of a park and the ms since `since`.
pub(super) fn step(since: Instant, what: &'static str) {
    tracing::debug!(
        ms = since.elapsed().as_secs_f64() * 1e3,
        "QEMU park step: {what}"
    );
}

/// QEMU's device state: `migrate` into a socket pair, read to its end (at
/// most [`MAX_STREAM`] bytes), QEMU's `completed` awaited.
fn device_state(qmp: &mut Qmp, deadline: Duration) -> Result<(Vec<u8>, Duration), UpdateError> {
    let caps = json!({"capabilities": [
        {"capability": "x-ignore-shared", "state": true},
        {"capability": "events", "state": true},
    ]});
    let begun = Instant::now();
    qmp.clear_events();
    let (ours, qemus) = UnixStream::pair()?;
    ours.set_read_timeout(Some(deadline))?;
    // Both sent before either reply is read (QEMU answers in order): one
    // round trip, not two. `migrate` waits for both.
    qmp.send_command("migrate-set-capabilities", caps)
        .map_err(qmp_err("migrate-set-capabilities"))?;
    let fd_sent = qmp.send_command_with_fd("getfd", json!({"fdname": "hm-park"}), qemus.as_fd());
    let caps_set = qmp.read_reply("migrate-set-capabilities");
    let fd_given = fd_sent.and_then(|()| qmp.read_reply("getfd"));
    caps_set.map_err(qmp_err("migrate-set-capabilities"))?;
    fd_given.map_err(qmp_err("getfd"))?;
    step(begun, "migrate-set-capabilities and getfd answered");
    drop(qemus);
    let started = Instant::now();
    qmp.execute("migrate", json!({"uri": "fd:hm-park"}))
        .map_err(qmp_err("migrate"))?;
    step(begun, "migrate answered");
    let mut stream = Vec::new();
    let read = (&ours).take(MAX_STREAM as u64 + 1).read_to_end(&mut stream);
    if let Err(e) = read {
        return Err(failed("reading", format!("QEMU's migration stream: {e}")));
    }
    step(begun, "QEMU's stream ended");
    if stream.len() > MAX_STREAM {
        return Err(failed(
            "refused",
            format!("QEMU's device state is over {MAX_STREAM} bytes: too large to park"),
        ));
    }
    let end = qmp
        .wait_event(|e| is_event(e, "MIGRATION", &["completed", "failed", "cancelled"]))
        .map_err(qmp_err("waiting for the migration to end"))?;
    step(begun, "MIGRATION event ended the migration");
    let status = end
        .pointer("/data/status")
        .and_then(Value::as_str)
        .unwrap_or("?");
    if status != "completed" {
        return Err(failed(status, "QEMU's migration of its device state"));
    }
    Ok((stream, started.elapsed()))
}
