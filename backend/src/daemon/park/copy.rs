//! PARK of memory that did not come from this daemon (a cloud-hypervisor
//! started on its own with `shared=on`, a snapshot read from disk): its
//! bytes are copied into a fresh allocation of pool memory, on the
//! largest pages its size allows (1 GiB when it is a multiple of 1 GiB), so
//! a VM that lived on 4 KiB pages comes back on huge pages.
//!
//! The copy reads each mapping with `pread` into the daemon's own mapping
//! of the new region, never through a mapping of the peer's file: a peer
//! can truncate its file at any moment, and a read then comes back short
//! (an error here), where a mapping would fault the daemon. Holes of the
//! peer's file (`SEEK_DATA`/`SEEK_HOLE`) are skipped: the allocation is
//! clean (zero) already.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use tracing::info;

use super::snapshot::{Checked, ParkRequest, ParkedOk, Refusal};
use crate::daemon::alloc::{self, Requester};
use crate::daemon::metrics::Metrics;
use crate::daemon::pool::{ParkedSlot, ParkedVm};
use crate::daemon::rooms::{settle_released, Rooms};
use crate::proto::messages::{AllocRequest, ReplyBody};
use crate::proto::{ClearMode, PagePolicy, Status};

const GIB: u64 = 1 << 30;
const TWO_MIB: u64 = 2 << 20;

/// Where each distinct file of the snapshot goes in the new region: its
/// base offset there (files after the first start on a 1 GiB boundary,
/// valid for every page size), and the bytes it needs.
#[derive(Debug, Clone, Copy)]
struct Placed {
    identity: (u64, u64),
    base: u64,
    need: u64,
}

fn place(checked: &Checked) -> Result<(Vec<Placed>, u64), Refusal> {
    let mut placed: Vec<Placed> = Vec::new();
    for f in &checked.memory {
        let need = checked
            .mappings
            .iter()
            .filter(|m| m.slot == f.slot)
            .map(|m| m.file_offset + m.size)
            .max()
            .unwrap_or(0);
        match placed.iter_mut().find(|p| p.identity == f.identity) {
            Some(p) => p.need = p.need.max(need),
            None => placed.push(Placed {
                identity: f.identity,
                base: 0,
                need,
            }),
        }
    }
    // Each file fits a u64 (its mappings were checked), but files of a
    // peer's making placed one after the other need not.
    let too_large = || {
        (
            Status::Invalid,
            "no pool memory to copy the VM into: its memory files together claim more bytes than a u64 counts"
                .to_string(),
        )
    };
    let mut end = 0u64;
    for p in &mut placed {
        p.base = end.checked_next_multiple_of(GIB).ok_or_else(too_large)?;
        end = p.base.checked_add(p.need).ok_or_else(too_large)?;
    }
    let total = if end.is_multiple_of(GIB) {
        end
    } else {
        end.checked_next_multiple_of(TWO_MIB)
            .ok_or_else(too_large)?
    };
    Ok((placed, total))
}

/// One range to copy: `len` bytes of `fd` from `offset` to the region at `dest`.
struct Range<'a> {
    fd: BorrowedFd<'a>,
    offset: u64,
    dest: u64,
    len: u64,
}

/// Copies the snapshot's mapped bytes into a fresh allocation and parks
/// it (see the module docs).
pub async fn copy_in(
    rooms: &Arc<Rooms>,
    req: &ParkRequest,
    checked: Checked,
    parked_at: u64,
) -> Result<ParkedOk, Refusal> {
    let (placed, total) = place(&checked)?;
    let requester = Requester {
        session: req.session,
        uid: req.uid,
        gid: req.gid,
        reattach: true,
    };
    let alloc_req = AllocRequest {
        total_size: total,
        page_policy: PagePolicy::Best,
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: Vec::new(),
        want_paths: false,
    };
    let served = alloc::serve(&rooms.alloc, requester, &alloc_req, None).await;
    let reply = served.outcome.reply;
    let alloc = match reply.body {
        ReplyBody::Alloc { alloc_id, .. } => alloc_id,
        _ => {
            return Err((
                reply.status,
                format!("no pool memory to copy the VM into: {}", reply.message),
            ))
        }
    };
    let release = |rooms: &Arc<Rooms>| {
        if let Ok(r) = rooms.pool.release(alloc, req.session) {
            settle_released(rooms, vec![r]);
        }
    };
    let region = match rooms.pool.owners().regions_of(alloc, req.session) {
        Ok((regions, _)) if regions.len() == 1 => Arc::clone(&regions[0]),
        _ => {
            release(rooms);
            return Err((
                Status::Internal,
                "the copy's allocation is not one region".into(),
            ));
        }
    };
    let started = std::time::Instant::now();
    let checked = Arc::new(checked);
    let job = {
        let (checked, placed, region) = (Arc::clone(&checked), placed.clone(), Arc::clone(&region));
        let threads = rooms
            .topology
            .nodes()
            .iter()
            .map(|n| n.cpus.len())
            .sum::<usize>()
            .max(1);
        tokio::task::spawn_blocking(move || copy_all(&checked, &placed, &region, threads))
    };
    let copied = match job.await {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            release(rooms);
            return Err((Status::Invalid, e));
        }
        Err(e) => {
            release(rooms);
            return Err((Status::Internal, e.to_string()));
        }
    };
    Metrics::add(&rooms.metrics.park_copied_bytes, copied);
    info!(uid = req.uid, name = %req.name, alloc, bytes = total, copied, page_size = region.page_size().bytes(), secs = started.elapsed().as_secs_f64(), "PARK: memory from elsewhere copied into pool memory");
    let config = rebase_config(&checked, &placed).inspect_err(|_| release(rooms))?;
    let slots: Vec<ParkedSlot> = checked
        .memory
        .iter()
        .map(|f| ParkedSlot {
            slot: f.slot,
            region: 0,
        })
        .collect();
    let n = u32::try_from(slots.len()).unwrap_or(u32::MAX);
    let vm = ParkedVm {
        name: req.name.clone(),
        slots,
        config,
        state: checked.state.clone(),
        copied_bytes: copied,
        parked_at,
    };
    match rooms
        .pool
        .owners()
        .park(alloc, req.uid, Some(req.session), vm)
    {
        Ok(bytes) => Ok(ParkedOk {
            alloc,
            bytes,
            copied,
            slots: n,
        }),
        Err(e) => {
            release(rooms);
            Err((Status::Invalid, e.to_string()))
        }
    }
}

/// The configuration with each mapping's `file_offset` moved by its
/// file's base in the new region (unchanged when every base is 0: one file).
fn rebase_config(checked: &Checked, placed: &[Placed]) -> Result<String, Refusal> {
    if placed.iter().all(|p| p.base == 0) {
        return Ok(checked.config.clone());
    }
    let base_of = |slot: u64| -> u64 {
        checked
            .memory
            .iter()
            .find(|f| u64::from(f.slot) == slot)
            .and_then(|f| placed.iter().find(|p| p.identity == f.identity))
            .map_or(0, |p| p.base)
    };
    let mut v: serde_json::Value =
        serde_json::from_str(&checked.config).map_err(|e| (Status::Invalid, e.to_string()))?;
    if let Some(list) = v
        .pointer_mut("/memory_manager_data/guest_ram_mappings")
        .and_then(serde_json::Value::as_array_mut)
    {
        for m in list {
            let slot = m
                .get("slot")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0);
            let offset = m
                .get("file_offset")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0);
            m["file_offset"] = (offset + base_of(slot)).into();
        }
    }
    serde_json::to_string(&v).map_err(|e| (Status::Internal, e.to_string()))
}

/// Copies every mapping's bytes, split into chunks over `threads`
/// threads; returns the bytes read (holes skipped).
fn copy_all(
    checked: &Checked,
    placed: &[Placed],
    region: &guest_mem::Region,
    threads: usize,
) -> Result<u64, String> {
    const CHUNK: u64 = 64 << 20;
    let mut ranges = Vec::new();
    for m in &checked.mappings {
        let Some(f) = checked.memory.iter().find(|f| f.slot == m.slot) else {
            continue;
        };
        let base = placed
            .iter()
            .find(|p| p.identity == f.identity)
            .map_or(0, |p| p.base);
        let mut done = 0;
        while done < m.size {
            let len = CHUNK.min(m.size - done);
            ranges.push(Range {
                fd: f.fd.as_fd(),
                offset: m.file_offset + done,
                dest: base + m.file_offset + done,
                len,
            });
            done += len;
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let total = std::sync::atomic::AtomicU64::new(0);
    let failed = std::sync::Mutex::new(None::<String>);
    std::thread::scope(|s| {
        for _ in 0..threads.min(ranges.len()).max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(r) = ranges.get(i) else { break };
                match copy_range(r, region) {
                    Ok(n) => {
                        total.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(e) => {
                        if let Ok(mut f) = failed.lock() {
                            f.get_or_insert(e);
                        }
                        break;
                    }
                }
            });
        }
    });
    match failed.into_inner().ok().flatten() {
        Some(e) => Err(e),
        None => Ok(total.into_inner()),
    }
}

/// One range: its data extents read into the region, its holes skipped.
fn copy_range(r: &Range<'_>, region: &guest_mem::Region) -> Result<u64, String> {
    let end = r.offset + r.len;
    let mut at = r.offset;
    let mut read = 0;
    while at < end {
        let Some((data, hole)) =
            next_data(r.fd, at, end).map_err(|e| format!("memory file at offset {at}: {e}"))?
        else {
            break;
        };
        let dest = r.dest + (data - r.offset);
        read_into_region(r.fd, data, region, dest, hole - data)
            .map_err(|e| format!("memory file at offset {data}: {e}"))?;
        read += hole - data;
        at = hole;
    }
    Ok(read)
}

/// The next data extent of `fd` in `[from, end)`: `(data, hole)`, or
/// `None` when only holes are left. A file system without `SEEK_DATA`
/// reports the whole rest as data.
fn next_data(fd: BorrowedFd<'_>, from: u64, end: u64) -> std::io::Result<Option<(u64, u64)>> {
    use nix::unistd::{lseek, Whence};
    let offset = |v: u64| i64::try_from(v).map_err(|_| std::io::Error::other("offset over i64"));
    let data = match lseek(fd, offset(from)?, Whence::SeekData) {
        Ok(d) => u64::try_from(d).unwrap_or(end),
        Err(nix::errno::Errno::ENXIO) => return Ok(None),
        Err(nix::errno::Errno::EINVAL) => return Ok(Some((from, end))),
        Err(e) => return Err(e.into()),
    };
    if data >= end {
        return Ok(None);
    }
    let hole = match lseek(fd, offset(data)?, Whence::SeekHole) {
        Ok(h) => u64::try_from(h).unwrap_or(end).min(end),
        Err(e) => return Err(e.into()),
    };
    Ok(Some((data, hole.max(data))))
}

/// Reads `len` bytes of `fd` from `offset` into `region` at `dest`; a
/// short file is an error (the peer truncated it, or lied about it).
fn read_into_region(
    fd: BorrowedFd<'_>,
    offset: u64,
    region: &guest_mem::Region,
    dest: u64,
    len: u64,
) -> std::io::Result<()> {
    let end = dest.checked_add(len).filter(|e| *e <= region.len());
    let (Some(_), Ok(len), Ok(dest)) = (end, usize::try_from(len), usize::try_from(dest)) else {
        return Err(std::io::Error::other("a range outside the region"));
    };
    // SAFETY: `[dest, dest + len)` lies inside the region's mapping (checked
    // above), which lives as long as `region`; the region belongs to an
    // allocation no process has been handed yet, and each chunk of it is
    // written by one thread only (the ranges do not overlap).
    let start = region.as_ptr().wrapping_add(dest);
    // SAFETY: as above: `start..start + len` is inside the region's live
    // mapping and written by this thread only.
    let buf = unsafe { std::slice::from_raw_parts_mut(start, len) };
    let mut done = 0;
    while done < len {
        let at = i64::try_from(offset + done as u64).map_err(std::io::Error::other)?;
        match nix::sys::uio::pread(fd, &mut buf[done..], at) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the file ended {} bytes early (truncated?)", len - done),
                ))
            }
            Ok(n) => done += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
