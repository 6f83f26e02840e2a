//! The randomized soak of issues 11 and 43: several hostile tenant
//! processes (forked; every other one as uid 65534 when run as root) run
//! seeded random sequences of every request against one live in-process
//! daemon for a bounded time, while the parent takes the daemon over now
//! and then.
//!
//! What the tenants do:
//! - ALLOC eager or lazy, with and without paths; FREE (keeping the fd now
//!   and then); LOCK/UNLOCK; REBALANCE (of a foreign region too); UFFD
//!   (root tenants attach the dirty regions they are handed lazily; every
//!   tenant sends UFFD requests that must be refused); disconnects without
//!   FREE; fds left in flight; grown, punched and truncated files;
//!   malformed frames;
//! - HANDOFF of a live allocation to a second connection, or to a child
//!   process that checks and releases it; the predecessor's FREE and the
//!   old token are refused;
//! - REATTACH: the parent orphans an allocation on the tenant's request
//!   (`DaemonHandle::orphan_for_tests`, the stand-in for a restart), the
//!   tenant takes it back with its token; wrong tokens, foreign ids and
//!   live allocations are refused as unknown ids, 8 refusals close a
//!   connection;
//! - PARK, as the sending cloud-hypervisor (`ch_migration::peer`): of its
//!   own allocation (moved), of a memfd or a file (copied, or on demand:
//!   the file read at restore time), of one or two slots; senders that
//!   hang up, a mix of an allocation and a memfd, a name in use, a file
//!   kept after FREE;
//! - RESTORE, as the receiving cloud-hypervisor: paused or not, postcopy
//!   (every page asked for on the fault connection), a receiver that
//!   refuses a step or hangs up (the VM stays parked);
//! - UNPARK; saves to a directory (EXPORT: the VM stays parked while it
//!   is written), dropped after it (UNPARK `--save`) or kept parked, and a
//!   PARK from the directory, copied or on demand (PARK with VERIFY), of a
//!   save whose memory file the tenant damaged too (`soak::saved`, the one
//!   place that calls that API);
//! - RESTORE and UNPARK of another uid's names.
//!
//! A tenant that has not done one of the requests in [`REQUIRED`] yet does
//! it at every fourth step, and a run of at least [`MIN_SECS_FOR_ALL`]
//! fails when one of them (or a takeover) never happened.
//!
//! Invariants, in each tenant after every step: a fresh ALLOC reads zero
//! in every byte; a live region holds exactly the tenant's own marker,
//! and so do the fds a HANDOFF hands over and a REATTACH gives back;
//! memory reached through a kept or in-flight fd holds only zeros or the
//! tenant's own marker; every RESTORE gives back exactly the VM parked
//! under its name (its state, its slots, each byte of each slot; a moved
//! VM the same file; a saved and reloaded VM the same bytes), or is
//! refused only where it must be (a receiver that refused, an on-demand
//! file cut short or a damaged save, on-demand files a takeover dropped);
//! a damaged save is never parked eagerly; a failed save leaves the VM
//! parked and nothing in its directory; the tenant's
//! STATS list exactly its parked VMs, and a tenant that is not an
//! operator sees no other uid's. In the parent, while the tenants run: the
//! daemon answers STATS (in process and over its socket) and its books
//! balance (allocations made − released == active, bytes created −
//! released == held, parked VMs within the allocations and the bytes in
//! use; exactly in each frozen predecessor at a takeover, at most
//! [`MAX_UNBALANCED_SAMPLES`] samples in a row off while requests move).
//! At the end: no parked VM, no active allocation, the quarantine and the
//! pool drain to empty, the books balance, the daemon's fd table is back at
//! its baseline, and after shutdown the host's free 2 MiB pages are back
//! where they were.
//!
//! `HUGEMEM_SOAK_SECS` (default 15) bounds the run; `HUGEMEM_SOAK_SEED`
//! replays one (the seed is always printed: the tenants' choices replay,
//! their timing against each other and the takeovers does not);
//! `HUGEMEM_SOAK_LOG=FILE` writes the daemon's log there.

mod park_peer;
mod soak;

use test_support::prelude::{
    hugepages_2m, map_raw as map, open_fds, reserve_2m, serial, unmap_raw as unmap, wait_until,
};

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend::client::{Client, ClientError};
use backend::lazy::{GuestMapping, LazyGuest, LazyOptions};
use backend::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};
use soak::daemon::SoakDaemon;
use soak::migration::Receiver;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;
/// The uid the unprivileged tenants run as.
const NOBODY: u32 = 65534;
/// Tenant processes.
const TENANTS: usize = 4;
/// 2 MiB pages reserved for the run: per tenant at most 2 live allocations
/// of up to 4 pages (+1 when grown), 2 kept or in-flight files of up to
/// 5 pages, 3 parked VMs of up to 4 pages and one VM on its way through a
/// save or a copy; plus the pool's limit.
const PAGES: u64 = TENANTS as u64 * (2 * 5 + 2 * 5 + 3 * 4 + 4) + 16 + 8;

/// Tenant `i`'s marker byte: distinct, non-zero.
fn marker(i: usize) -> u8 {
    0xA1 + i as u8
}

/// The operations (and outcomes) counted in the summary.
#[derive(Clone, Copy)]
#[repr(usize)]
enum Op {
    Alloc,
    AllocRefused,
    Free,
    FreeKeepFd,
    KeptFdChecked,
    Lock,
    LockRefused,
    Rebalance,
    RebalanceRefused,
    RebalanceForeignRefused,
    Disconnect,
    FdInFlight,
    InFlightReceived,
    InFlightDropped,
    Grow,
    Punch,
    Truncate0,
    Truncate0Refused,
    Malformed,
    BadAllocRefused,
    Verify,
    Stats,
    PopulateFailed,
    /// Regions scanned for the zero / own-marker invariants.
    Checks,
    /// Lazy ALLOCs handed a dirty region, attached with UFFD, every page
    /// faulted in through the registered mapping (root tenants only).
    LazyServed,
    /// UFFD requests that must fail: for an eager allocation, with an fd
    /// that is not a userfaultfd, for an allocation id not the tenant's.
    UffdRefused,
    /// HANDOFF to a second connection of the tenant's.
    Handoff,
    /// HANDOFF to a child process of the tenant's, which releases it.
    HandoffProcess,
    /// HANDOFF refused as it must be (PATHS of memfds, pages to clear).
    HandoffRefused,
    /// The predecessor's (or the orphaned allocation's old connection's)
    /// FREE refused, and the old token's HANDOFF.
    PredecessorRefused,
    /// An orphaned allocation taken back with its token.
    Reattach,
    /// Tokens and ids not the tenant's: refused as unknown ids.
    TokenRefused,
    /// 8 refused REATTACH on one connection: the daemon closed it.
    TokenLimitClosed,
    /// PARK of the tenant's own allocation: moved.
    ParkMoved,
    /// PARK of memory from elsewhere: copied.
    ParkCopied,
    /// PARK on demand: the files kept, read at restore time.
    ParkOnDemand,
    /// PARK refused as it must be (a sender that hangs up, a mix, a name
    /// in use, a kept file, no memory for a copy).
    ParkRefused,
    /// RESTORE to a receiver that resumes the VM.
    Restore,
    /// RESTORE with PAUSED.
    RestorePaused,
    /// RESTORE with POSTCOPY: every page asked for on the fault connection.
    RestorePostcopy,
    /// RESTORE refused by the receiver (the VM stays parked), or of a VM
    /// whose on-demand file was cut short (never restored).
    RestoreRefused,
    /// RESTORE (or save) of an on-demand VM refused after a takeover
    /// dropped its files.
    RestoreGone,
    /// UNPARK.
    Unpark,
    /// UNPARK --save: written to a directory and dropped.
    UnparkSave,
    /// PARK from a saved directory.
    ParkFromDir,
    /// RESTORE and UNPARK of another uid's name: not found.
    ForeignNameRefused,
    /// The tenant's STATS list exactly its parked VMs.
    ParkedChecked,
    /// An allocation whose file the tenant grew, gone after a takeover
    /// (the successor's checks refuse the region).
    GrownDropped,
    /// A save that keeps the VM parked (EXPORT, no UNPARK).
    SaveKept,
    /// A PARK from a save whose memory file the tenant damaged: refused.
    DamagedSaveRefused,
}

const OP_NAMES: [&str; 50] = [
    "alloc",
    "alloc_refused",
    "free",
    "free_keep_fd",
    "kept_fd_checked",
    "lock_unlock",
    "lock_refused",
    "rebalance",
    "rebalance_refused",
    "rebalance_foreign_refused",
    "disconnect",
    "fd_in_flight",
    "in_flight_received",
    "in_flight_dropped",
    "grow",
    "punch",
    "truncate0",
    "truncate0_refused",
    "malformed",
    "bad_alloc_refused",
    "verify",
    "stats",
    "populate_failed",
    "region_checks",
    "lazy_uffd_served",
    "uffd_refused",
    "handoff",
    "handoff_process",
    "handoff_refused",
    "predecessor_refused",
    "reattach",
    "token_refused",
    "token_limit_closed",
    "park_moved",
    "park_copied",
    "park_on_demand",
    "park_refused",
    "restore",
    "restore_paused",
    "restore_postcopy",
    "restore_refused",
    "restore_gone",
    "unpark",
    "unpark_save",
    "park_from_dir",
    "foreign_name_refused",
    "parked_checked",
    "grown_dropped",
    "save_kept",
    "damaged_save_refused",
];

/// The requests every run long enough must drive (`MIN_SECS_FOR_ALL`):
/// a tenant that has not done one yet does it at every fourth step, so
/// the soak cannot silently stop driving a request.
const REQUIRED: [Op; 18] = [
    Op::Handoff,
    Op::HandoffProcess,
    Op::Reattach,
    Op::TokenRefused,
    Op::ParkMoved,
    Op::ParkCopied,
    Op::ParkOnDemand,
    Op::ParkRefused,
    Op::Restore,
    Op::RestorePaused,
    Op::RestorePostcopy,
    Op::RestoreRefused,
    Op::Unpark,
    Op::UnparkSave,
    Op::SaveKept,
    Op::ParkFromDir,
    Op::DamagedSaveRefused,
    Op::ForeignNameRefused,
];

/// Runs at least this long must have driven every [`REQUIRED`] request
/// and a takeover.
const MIN_SECS_FOR_ALL: u64 = 10;

/// STATS samples in a row (about 0.1 s apart) whose books may be off
/// while tenants run: a counter moves a moment before or after the pool's
/// table (a release, a region on its way back from a refault); a drift
/// stays. Each frozen predecessor and the end state must balance exactly.
const MAX_UNBALANCED_SAMPLES: u64 = 30;

/// xorshift64*: a small seeded generator, so that a seed replays a run.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// What each open fd of this process (the daemon's) points at.
fn fd_targets() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| e.ok())
        .map(|e| {
            let target = std::fs::read_link(e.path()).unwrap_or_default();
            format!(
                "{} -> {}",
                e.file_name().to_string_lossy(),
                target.display()
            )
        })
        .collect()
}

/// Straight to fd 2: libtest captures `eprintln!`, and the children share it.
fn say(line: &str) {
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// What a scan of a tenant's view of memory found.
enum Scan {
    /// Every byte allowed.
    Ok,
    /// The pages could not be faulted in (no free huge page): not read.
    NoMemory,
    /// Could not map.
    MapFailed,
    /// The first byte that is not allowed, and its offset.
    Bad { offset: usize, byte: u8 },
}

/// Maps `len` bytes of `fd`, faults every page in with
/// `MADV_POPULATE_WRITE` (an error, not SIGBUS, when no page is left),
/// checks that every byte is `a` or `b`, then (when `fill`) writes `fill`
/// over all of it.
fn scan(fd: RawFd, len: u64, a: u8, b: u8, fill: Option<u8>) -> Scan {
    let p = map(fd, len);
    if p.is_null() {
        return Scan::MapFailed;
    }
    let result = scan_at(p, len, a, b, fill);
    unmap(p, len);
    result
}

/// [`scan`] of a mapping the caller owns (`len` bytes at `p`).
fn scan_at(p: *mut u8, len: u64, a: u8, b: u8, fill: Option<u8>) -> Scan {
    let n = len as usize;
    if backend::sys::populate_write(p, n).is_err() {
        return Scan::NoMemory;
    }
    // SAFETY: our live mapping of `n` bytes, every page faulted in above;
    // only this process touches it while the slice lives.
    let bytes = unsafe { std::slice::from_raw_parts(p, n) };
    let wa = u64::from_ne_bytes([a; 8]);
    let wb = u64::from_ne_bytes([b; 8]);
    let mut result = Scan::Ok;
    for (i, w) in bytes.chunks_exact(8).enumerate() {
        let v = u64::from_ne_bytes(w.try_into().unwrap_or([0xFF; 8]));
        if v != wa && v != wb {
            if let Some((j, &byte)) = w.iter().enumerate().find(|(_, &x)| x != a && x != b) {
                result = Scan::Bad {
                    offset: i * 8 + j,
                    byte,
                };
                break;
            }
        }
    }
    if let (Scan::Ok, Some(f)) = (&result, fill) {
        // SAFETY: the same live read-write mapping of `n` bytes; the shared
        // slice above is no longer used.
        unsafe { std::ptr::write_bytes(p, f, n) };
    }
    result
}

/// A lazy allocation's guest view: the mapping registered with the uffd the
/// daemon serves. Unmapped before the uffd is closed (a VMM's order).
struct LazyView {
    addr: *mut u8,
    len: u64,
    _guest: LazyGuest,
}

impl Drop for LazyView {
    fn drop(&mut self) {
        unmap(self.addr, self.len);
    }
}

/// One allocation a tenant holds.
struct Live {
    id: u64,
    fd: OwnedFd,
    region_id: u64,
    size: u64,
    paths: bool,
    /// Grown, punched or truncated: its contents are no longer checked.
    damaged: bool,
    /// Its file's size was changed (grown, or cut to 0 in path mode), when
    /// STATS counted this many takeovers: a takeover since drops it (the
    /// successor refuses the region).
    grown: Option<u64>,
    /// Its current token (ALLOC's, or the last HANDOFF's or RESTORE's).
    token: Option<[u8; backend::proto::TOKEN_SIZE]>,
    /// The connection that owns it, when not the tenant's main one (a
    /// HANDOFF's successor, a REATTACH or RESTORE on a new connection).
    conn: Option<Client>,
    /// Allocated eager (a lazy one may have pages to clear).
    eager: bool,
    /// The daemon counts it lazy (a lazy ALLOC; a PARK copy's memory).
    lazy_alloc: bool,
    /// Its owning connection keeps a lazy record of it (a dirty lazy
    /// handout; a REATTACH of a lazy allocation): not grown, since a
    /// takeover that refuses its region then closes that connection (the
    /// VMM's fallback serves it), with whatever else it owns.
    lazy_record: bool,
    /// What happened to it (for a violation's message).
    how: String,
    /// Lazy on dirty memory: the uffd-registered mapping.
    _lazy: Option<LazyView>,
}

/// A file kept after FREE or disconnect, or sent to itself and in flight.
enum Held {
    Kept {
        fd: OwnedFd,
        size: u64,
    },
    InFlight {
        tx: UnixStream,
        rx: UnixStream,
        size: u64,
    },
}

struct Tenant {
    index: usize,
    own: u8,
    /// Its uid (set once it runs as it).
    uid: u32,
    unprivileged: bool,
    socket: std::path::PathBuf,
    rng: Rng,
    counts: [u64; OP_NAMES.len()],
    steps: u64,
    client: Option<Client>,
    live: Vec<Live>,
    held: Vec<Held>,
    /// The parent's orphaning service (`soak::daemon::serve_orphans`).
    ctl: UnixStream,
    /// What it parked, by name.
    parked: Vec<soak::parking::ParkedVm>,
    /// What it saved to a directory and has not parked again.
    saved: Vec<soak::saved::SavedVm>,
    /// VMs it made (their states are numbered).
    serial: u64,
    /// The state of the last PARK it sent.
    last_state: Vec<u8>,
    /// Names other uids' tenants park under.
    foreign_names: Vec<String>,
    /// Its directory for files and saves (made once it runs as its uid).
    work: Option<tempfile::TempDir>,
}

/// A broken invariant or an unexpected answer: ends the tenant.
type Step = Result<(), String>;

fn refused<T>(r: &Result<T, ClientError>) -> bool {
    matches!(r, Err(ClientError::Refused { .. }))
}

/// A NOT_FOUND refusal.
fn not_found(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Refused {
            status: backend::proto::Status::NotFound,
            ..
        }
    )
}

impl Tenant {
    fn count(&mut self, op: Op) {
        self.counts[op as usize] += 1;
    }

    fn client(&mut self) -> Result<&mut Client, String> {
        if self.client.is_none() {
            // A dropped connection may not be accounted yet (per-uid caps).
            let deadline = Instant::now() + Duration::from_secs(10);
            let c = loop {
                match Client::connect(&self.socket) {
                    Ok(c) => break c,
                    Err(e) if Instant::now() > deadline => {
                        return Err(format!("cannot connect: {e}"))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            let _ = c.set_timeout(Some(Duration::from_secs(60)));
            self.client = Some(c);
        }
        self.client.as_mut().ok_or_else(|| "no client".to_string())
    }

    /// Checks a scan of memory from the daemon; `what` names the step.
    fn checked(&mut self, s: Scan, what: &str) -> Step {
        match s {
            Scan::Ok => {
                self.count(Op::Checks);
                Ok(())
            }
            Scan::NoMemory => {
                self.count(Op::PopulateFailed);
                Ok(())
            }
            Scan::MapFailed => Err(format!("{what}: mmap failed")),
            Scan::Bad { offset, byte } => {
                let whose = (0..TENANTS)
                    .find(|&t| marker(t) == byte)
                    .map_or("nobody's".to_string(), |t| format!("tenant {t}'s marker"));
                Err(format!(
                    "{what}: byte {byte:#04x} ({whose}) at offset {offset:#x}"
                ))
            }
        }
    }

    fn alloc(&mut self) -> Step {
        if self.live.len() >= 2 {
            return self.free(false);
        }
        let size = (2 + self.rng.below(3)) * PAGE;
        let lazy = self.rng.chance(30);
        let paths = self.rng.chance(30);
        let lock = !lazy && self.rng.chance(20);
        let req = AllocRequest {
            total_size: size,
            page_policy: PagePolicy::Huge2M,
            clear_mode: if lazy {
                ClearMode::Lazy
            } else {
                ClearMode::Eager
            },
            lock,
            parts: Vec::new(),
            want_paths: paths,
        };
        let r = self.client()?.alloc(req);
        let a = match r {
            Ok(a) => a,
            Err(ClientError::Refused { .. }) => {
                self.count(Op::AllocRefused);
                return Ok(());
            }
            Err(e) => return Err(format!("ALLOC {size} lazy={lazy} paths={paths}: {e}")),
        };
        self.count(Op::Alloc);
        let handed_dirty = a
            .regions
            .first()
            .is_some_and(|r| r.flags & RegionInfo::FLAG_LAZY != 0);
        if handed_dirty && self.unprivileged {
            return Err(format!(
                "uid {NOBODY} (not in lazy_dirty_uids) was handed dirty memory lazily"
            ));
        }
        let lazy_view = if handed_dirty {
            Some(self.attach(&a, size)?)
        } else {
            None
        };
        let (id, token) = (a.id, a.token());
        let (Some(info), Some(fd)) = (a.regions.first().copied(), a.fds.into_iter().next()) else {
            return Err("ALLOC reply without a region".into());
        };
        let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| format!("fstat: {e}"))?;
        if u64::try_from(st.st_size).ok() != Some(info.size) || info.size != size {
            return Err(format!(
                "fresh region: file size {} region {} asked {size}",
                st.st_size, info.size
            ));
        }
        // Every fresh byte reads zero; then the tenant's marker goes
        // everywhere. Dirty lazy memory is read only through the registered
        // mapping (each first touch a fault the daemon serves by clearing):
        // a second mapping would see the previous tenant's bytes, which is
        // why only uids the operator trusts get it.
        let own = self.own;
        let s = match &lazy_view {
            Some(v) => scan_at(v.addr, size, 0, 0, Some(own)),
            None => scan(fd.as_raw_fd(), size, 0, 0, Some(own)),
        };
        let nomem = matches!(s, Scan::NoMemory);
        self.checked(s, &format!("fresh ALLOC lazy={lazy} paths={paths}"))?;
        self.live.push(Live {
            id,
            fd,
            region_id: info.region_id,
            size,
            paths,
            // Not filled: its contents are not known to be the marker.
            damaged: nomem,
            grown: None,
            token,
            conn: None,
            eager: !lazy,
            lazy_alloc: lazy,
            lazy_record: handed_dirty,
            how: format!(
                "ALLOC {id} lazy {lazy} dirty {handed_dirty} paths {paths} (step {})",
                self.steps
            ),
            _lazy: lazy_view,
        });
        Ok(())
    }

    /// Maps a lazy allocation's region and hands its uffd to the daemon.
    fn attach(&mut self, a: &backend::client::Allocation, size: u64) -> Result<LazyView, String> {
        let (Some(info), Some(fd)) = (a.regions.first(), a.fds.first()) else {
            return Err("lazy ALLOC reply without a region".into());
        };
        let addr = map(fd.as_raw_fd(), size);
        if addr.is_null() {
            return Err("mmap of a lazy region failed".into());
        }
        let mapping = GuestMapping {
            region_id: info.region_id,
            region_offset: 0,
            addr: addr as u64,
            len: size,
        };
        let opts = LazyOptions {
            fallback: false,
            ..LazyOptions::default()
        };
        match LazyGuest::attach(self.client()?, a, &[mapping], opts) {
            Ok(guest) => {
                self.count(Op::LazyServed);
                Ok(LazyView {
                    addr,
                    len: size,
                    _guest: guest,
                })
            }
            Err(e) => {
                unmap(addr, size);
                Err(format!("UFFD for a dirty lazy region: {e}"))
            }
        }
    }

    /// UFFD requests a hostile VMM might send; each must be refused and
    /// leave the connection and the daemon serving.
    fn uffd_tricks(&mut self) -> Step {
        let Some(i) = self.pick_live(false) else {
            return Ok(());
        };
        let (id, region_id, size) = (self.live[i].id, self.live[i].region_id, self.live[i].size);
        let addr = map(self.live[i].fd.as_raw_fd(), size);
        if addr.is_null() {
            return Err("mmap for UFFD tricks failed".into());
        }
        let range = backend::proto::UffdRange {
            region_id,
            offset: 0,
            vmm_addr: addr as u64,
            len: size,
        };
        let (pipe_r, _pipe_w) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
        let trick = self.rng.below(2);
        let mine: Vec<u64> = self.live.iter().map(|l| l.id).collect();
        let foreign = (1..=64)
            .map(|k| id + k)
            .find(|x| !mine.contains(x))
            .unwrap_or(u64::MAX);
        let (alloc_id, what) = match trick {
            0 => (id, "with a pipe for a uffd"),
            _ => (foreign, "for an allocation not its own"),
        };
        let req = backend::proto::Request::Uffd {
            alloc_id,
            ranges: vec![range],
        };
        let c = if trick == 0 {
            self.owner_of(i)?
        } else {
            self.client()?
        };
        let r = c.call_with_fds(&req, &[pipe_r.as_fd()]);
        unmap(addr, size);
        if !refused(&r) {
            return Err(format!("UFFD {what} (alloc {alloc_id}): {r:?}"));
        }
        self.count(Op::UffdRefused);
        Ok(())
    }

    fn pick_live(&mut self, undamaged: bool) -> Option<usize> {
        let idx: Vec<usize> = (0..self.live.len())
            .filter(|&i| !undamaged || !self.live[i].damaged)
            .collect();
        if idx.is_empty() {
            None
        } else {
            Some(idx[self.rng.below(idx.len() as u64) as usize])
        }
    }

    /// FREE; with `keep`, the fd of an undamaged region stays open after it.
    fn free(&mut self, keep: bool) -> Step {
        let Some(i) = self.pick_live(keep) else {
            return Ok(());
        };
        let l = self.live.swap_remove(i);
        let (how, grown) = (l.how.clone(), l.grown);
        match self.free_owned(l.id, l.conn) {
            Ok(()) => {}
            Err(e) if not_found(&e) && self.dropped_since(grown)? => {
                self.count(Op::GrownDropped);
                return Ok(());
            }
            Err(e) => return Err(format!("FREE {}: {e}; it was: {how}", l.id)),
        }
        if keep && self.held.len() < 2 {
            self.count(Op::FreeKeepFd);
            self.held.push(Held::Kept {
                fd: l.fd,
                size: l.size,
            });
        } else {
            self.count(Op::Free);
        }
        Ok(())
    }

    /// Reads (and writes) a file kept after FREE, or receives one in flight.
    fn use_held(&mut self) -> Step {
        if self.held.is_empty() {
            return Ok(());
        }
        let i = self.rng.below(self.held.len() as u64) as usize;
        let own = self.own;
        match self.held.swap_remove(i) {
            Held::Kept { fd, size } => {
                self.count(Op::KeptFdChecked);
                let s = scan(fd.as_raw_fd(), size, own, 0, Some(own));
                self.checked(s, "fd kept after FREE")
            }
            Held::InFlight { tx, rx, size } => {
                if self.rng.chance(30) {
                    // Both ends closed with the fd still queued.
                    drop((tx, rx));
                    self.count(Op::InFlightDropped);
                    return Ok(());
                }
                let mut fds = Vec::new();
                let mut buf = [0u8; 1];
                backend::sys::recv_with_fds(rx.as_fd(), &mut buf, &mut fds, 1, false)
                    .map_err(|e| format!("receive the fd in flight: {e}"))?;
                let Some(fd) = fds.pop() else {
                    return Err("no fd was in flight".into());
                };
                self.count(Op::InFlightReceived);
                let s = scan(fd.as_raw_fd(), size, own, 0, Some(own));
                self.checked(s, "fd received from flight after FREE")
            }
        }
    }

    /// Sends a live region's fd to itself, leaves it unreceived, FREEs.
    fn fd_in_flight(&mut self) -> Step {
        if self.held.len() >= 2 {
            return self.use_held();
        }
        let Some(i) = self.pick_live(true) else {
            return Ok(());
        };
        let l = self.live.swap_remove(i);
        let (tx, rx) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
        let raw = [l.fd.as_raw_fd()];
        let iov = [IoSlice::new(b"x")];
        sendmsg::<()>(
            tx.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&raw)],
            MsgFlags::empty(),
            None,
        )
        .map_err(|e| format!("sendmsg: {e}"))?;
        let (id, size) = (l.id, l.size);
        drop(l.fd);
        self.free_owned(id, l.conn)
            .map_err(|e| format!("FREE {id} (fd in flight): {e}"))?;
        self.count(Op::FdInFlight);
        self.held.push(Held::InFlight { tx, rx, size });
        Ok(())
    }

    fn verify(&mut self) -> Step {
        let Some(i) = self.pick_live(true) else {
            return Ok(());
        };
        let (fd, size, own) = (self.live[i].fd.as_raw_fd(), self.live[i].size, self.own);
        self.count(Op::Verify);
        let s = scan(fd, size, own, own, None);
        if matches!(s, Scan::NoMemory) {
            // A page of a live region was missing: no longer known.
            self.live[i].damaged = true;
        }
        self.checked(s, "live region")
    }

    fn lock(&mut self) -> Step {
        let Some(i) = self.pick_live(false) else {
            return Ok(());
        };
        let id = self.live[i].id;
        let c = self.owner_of(i)?;
        let r = c.lock(id, 0);
        let u = if r.is_ok() {
            Some(c.unlock(id, 0))
        } else {
            None
        };
        match (&r, &u) {
            (Ok(_), Some(Ok(_))) => self.count(Op::Lock),
            _ if refused(&r) || u.as_ref().is_some_and(refused) => self.count(Op::LockRefused),
            _ => {
                return Err(format!(
                    "LOCK/UNLOCK {id}: {r:?} {u:?}; it was: {}",
                    self.live[i].how
                ))
            }
        }
        Ok(())
    }

    fn rebalance(&mut self) -> Step {
        let Some(i) = self.pick_live(false) else {
            return Ok(());
        };
        let rid = self.live[i].region_id;
        let r = self.owner_of(i)?.rebalance(rid, 0, 0, 0);
        match &r {
            Ok(_) => self.count(Op::Rebalance),
            _ if refused(&r) => self.count(Op::RebalanceRefused),
            Err(e) => return Err(format!("REBALANCE own region {rid}: {e}")),
        }
        if self.unprivileged {
            // Someone else's (or nobody's) region: always refused.
            let mine: Vec<u64> = self.live.iter().map(|l| l.region_id).collect();
            let other = (1..=16)
                .map(|k| rid + k)
                .find(|x| !mine.contains(x))
                .unwrap_or(u64::MAX);
            let r = self.client()?.rebalance(other, 0, 0, 0);
            if !refused(&r) {
                return Err(format!(
                    "REBALANCE of foreign region {other} by uid {NOBODY}: {r:?}"
                ));
            }
            self.count(Op::RebalanceForeignRefused);
        }
        Ok(())
    }

    /// Drops the connection without FREE; some fds stay open after it.
    /// Drops the main connection (what it owns is released), and now
    /// and then another connection that owns an allocation.
    fn disconnect(&mut self) -> Step {
        self.client = None;
        for l in std::mem::take(&mut self.live) {
            if l.conn.is_some() && self.rng.chance(70) {
                self.live.push(l);
                continue;
            }
            if !l.damaged && self.held.len() < 2 && self.rng.chance(50) {
                self.held.push(Held::Kept {
                    fd: l.fd,
                    size: l.size,
                });
            }
        }
        self.count(Op::Disconnect);
        Ok(())
    }

    /// Grows a live file past its region, punches a hole in it, or (path
    /// mode) truncates it to 0; the memfd's seals refuse the truncate.
    fn damage(&mut self) -> Step {
        let Some(i) = self.pick_live(false) else {
            return Ok(());
        };
        let (fd, size, paths) = (
            self.live[i].fd.as_raw_fd(),
            self.live[i].size,
            self.live[i].paths,
        );
        let own = self.own;
        match self.rng.below(3) {
            0 if !self.live[i].damaged && !self.live[i].lazy_record => {
                self.live[i].grown = Some(self.takeovers()?);
                let grown = size + PAGE;
                // SAFETY: ftruncate on the tenant's own fd.
                if unsafe { libc::ftruncate(fd, grown as libc::off_t) } != 0 {
                    return Err(format!("grow: {}", std::io::Error::last_os_error()));
                }
                self.live[i].damaged = true;
                self.count(Op::Grow);
                let s = scan(fd, grown, own, 0, Some(own));
                self.checked(s, "grown file")
            }
            1 => {
                let off = self.rng.below(size / PAGE) * PAGE;
                // SAFETY: fallocate on the tenant's own fd.
                let r = unsafe {
                    libc::fallocate(
                        fd,
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        off as libc::off_t,
                        PAGE as libc::off_t,
                    )
                };
                if r != 0 {
                    return Err(format!("punch: {}", std::io::Error::last_os_error()));
                }
                self.live[i].damaged = true;
                self.count(Op::Punch);
                Ok(())
            }
            _ => {
                let before = self.takeovers()?;
                // SAFETY: ftruncate on the tenant's own fd.
                let r = unsafe { libc::ftruncate(fd, 0) };
                if r == 0 {
                    self.live[i].grown.get_or_insert(before);
                    self.live[i].damaged = true;
                    self.count(Op::Truncate0);
                } else if paths {
                    return Err(format!(
                        "truncate a path-mode file: {}",
                        std::io::Error::last_os_error()
                    ));
                } else {
                    // F_SEAL_SHRINK on the memfd.
                    self.count(Op::Truncate0Refused);
                }
                Ok(())
            }
        }
    }

    /// Garbage on a fresh connection, or an ALLOC of nothing on another.
    fn malformed(&mut self) -> Step {
        if self.rng.chance(50) {
            let s = UnixStream::connect(&self.socket).map_err(|e| format!("connect: {e}"))?;
            let n = 1 + self.rng.below(96) as usize;
            let junk: Vec<u8> = (0..n).map(|_| self.rng.next() as u8).collect();
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = (&s).write_all(&junk);
            let mut sink = [0u8; 256];
            while let Ok(1..) = (&s).read(&mut sink) {}
            self.count(Op::Malformed);
        } else {
            // A malformed request closes its connection (after a clear
            // error): sent on a connection of its own.
            let mut c = Client::connect(&self.socket).map_err(|e| format!("connect: {e}"))?;
            let _ = c.set_timeout(Some(Duration::from_secs(60)));
            let r = c.alloc(AllocRequest {
                total_size: 0,
                page_policy: PagePolicy::Huge2M,
                clear_mode: ClearMode::Eager,
                lock: false,
                parts: Vec::new(),
                want_paths: false,
            });
            if !refused(&r) {
                return Err(format!("ALLOC of 0 bytes: {r:?}"));
            }
            self.count(Op::BadAllocRefused);
        }
        Ok(())
    }

    fn stats(&mut self) -> Step {
        let mine: Vec<u64> = self.live.iter().map(|l| l.region_id).collect();
        let unprivileged = self.unprivileged;
        let s = self
            .client()?
            .stats()
            .map_err(|e| format!("STATS: {}", hugemem_client::diag::chain(&e)))?;
        if unprivileged {
            // A non-operator sees its own regions only.
            let foreign: Vec<u64> = s
                .regions
                .iter()
                .flatten()
                .map(|r| r.id)
                .filter(|id| !mine.contains(id))
                .collect();
            if !foreign.is_empty() {
                return Err(format!("STATS shows foreign regions {foreign:?}"));
            }
        }
        self.count(Op::Stats);
        self.check_parked_view()
    }

    fn step(&mut self) -> Step {
        self.steps += 1;
        if self.steps.is_multiple_of(4) {
            return self.least_done();
        }
        match self.rng.below(150) {
            0..=24 => self.alloc(),
            25..=36 => self.free(false),
            37..=42 => self.free(true),
            43..=50 => self.use_held(),
            51..=56 => self.lock(),
            57..=62 => self.rebalance(),
            63..=66 => self.disconnect(),
            67..=72 => self.fd_in_flight(),
            73..=78 => self.damage(),
            79..=81 => self.malformed(),
            82..=83 => self.uffd_tricks(),
            84..=94 => self.verify(),
            95..=99 => self.stats(),
            100..=105 => self.handoff(),
            106..=109 => self.reattach(),
            110..=111 => self.token_tricks(),
            112..=123 => self.park(),
            124..=133 => {
                let how = match self.rng.below(10) {
                    0..=5 => Receiver::Plain,
                    6..=7 => Receiver::Postcopy,
                    8 => Receiver::Refuse(self.rng.below(5) as usize),
                    _ => Receiver::HangUp,
                };
                let paused = self.rng.chance(40);
                self.restore(how, paused)
            }
            134..=136 => self.unpark(false),
            137..=138 => {
                let drop_after = self.rng.chance(60);
                self.save(drop_after)
            }
            139..=140 => {
                let damage = self.rng.chance(15);
                self.load(damage)
            }
            141..=142 => self.probe_names(),
            _ => self.verify(),
        }
    }

    /// The [`REQUIRED`] request this tenant has done least (the first
    /// such after a place that turns with its steps).
    fn least_done(&mut self) -> Step {
        let turn = (self.steps / 4) as usize + self.index;
        let op = (0..REQUIRED.len())
            .map(|k| REQUIRED[(k + turn) % REQUIRED.len()])
            .min_by_key(|op| self.counts[*op as usize])
            .unwrap_or(Op::Restore);
        match op {
            Op::Handoff => self.handoff(),
            Op::HandoffProcess => self.handoff_to_process(),
            Op::Reattach => self.reattach(),
            Op::TokenRefused => self.token_tricks(),
            Op::ParkMoved => self.park_moved(),
            Op::ParkCopied => self.park_copied(false),
            Op::ParkOnDemand => self.park_copied(true),
            Op::ParkRefused => self.park_hostile(),
            Op::RestorePaused => self.restore(Receiver::Plain, true),
            Op::RestorePostcopy => {
                let paused = self.rng.chance(50);
                self.restore(Receiver::Postcopy, paused)
            }
            Op::RestoreRefused if self.rng.chance(50) => self.restore(Receiver::HangUp, true),
            Op::RestoreRefused => {
                let k = self.rng.below(5) as usize;
                self.restore(Receiver::Refuse(k), true)
            }
            Op::Unpark if self.parked.is_empty() => self.park_copied(false),
            Op::Unpark => self.unpark(false),
            Op::UnparkSave => self.save(true),
            Op::SaveKept => self.save(false),
            Op::ParkFromDir => self.load(false),
            Op::DamagedSaveRefused => self.load(true),
            Op::ForeignNameRefused => self.probe_names(),
            _ => self.restore(Receiver::Plain, false),
        }
    }

    /// The connection that owns live allocation `i`.
    fn owner_of(&mut self, i: usize) -> Result<&mut Client, String> {
        if self.live[i].conn.is_some() {
            return self.live[i]
                .conn
                .as_mut()
                .ok_or_else(|| "no client".to_string());
        }
        self.client()
    }

    /// FREE of allocation `id` on `conn`, or on the main connection.
    fn free_owned(&mut self, id: u64, conn: Option<Client>) -> Result<(), ClientError> {
        match conn {
            Some(mut c) => c.free(id),
            None => self.client().map_err(ClientError::Unexpected)?.free(id),
        }
    }

    /// True when a takeover came after the tenant grew an allocation's
    /// file (`grown`): the successor refused the region and dropped the
    /// allocation (counted released), so NOT_FOUND is its answer now.
    fn dropped_since(&mut self, grown: Option<u64>) -> Result<bool, String> {
        match grown {
            Some(before) => Ok(self.takeovers()? > before),
            None => Ok(false),
        }
    }

    /// The tenant's own directory (made as its uid, removed at its end).
    fn work_dir(&mut self) -> Result<std::path::PathBuf, String> {
        if self.work.is_none() {
            let dir = tempfile::Builder::new()
                .prefix(&format!("hugemem-soak-t{}-", self.index))
                .tempdir()
                .map_err(|e| format!("the tenant's directory: {e}"))?;
            self.work = Some(dir);
        }
        self.work
            .as_ref()
            .map(|d| d.path().to_path_buf())
            .ok_or_else(|| "no directory".to_string())
    }

    /// At the end: every parked VM restored (and checked) or unparked,
    /// saved directories removed; what is live goes with the process.
    fn clean_up(&mut self) -> Step {
        while !self.parked.is_empty() {
            if self.rng.chance(50) {
                let paused = self.rng.chance(50);
                self.restore(Receiver::Plain, paused)?;
            } else {
                self.unpark(false)?;
            }
        }
        self.saved.clear();
        self.work = None;
        self.check_parked_view()
    }

    /// Runs until `deadline`, then cleans up; the report goes to `out`.
    /// Returns the exit code.
    fn run(&mut self, deadline: Instant, out: &OwnedFd) -> i32 {
        let mut err = None;
        let mut steps = 0u64;
        let step = |t: &mut Tenant, cleaning: bool| {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if cleaning {
                    t.clean_up()
                } else {
                    t.step()
                }
            }));
            match r {
                Ok(r) => r,
                Err(p) => Err(format!(
                    "panic: {}",
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                )),
            }
        };
        while Instant::now() < deadline {
            steps += 1;
            if let Err(e) = step(self, false) {
                err = Some(e);
                break;
            }
        }
        if err.is_none() {
            err = step(self, true).err().map(|e| format!("at the end: {e}"));
        }
        let mut report = format!("tenant {} steps {steps}", self.index);
        for (n, c) in OP_NAMES.iter().zip(self.counts) {
            report.push_str(&format!(" {n}={c}"));
        }
        if let Some(e) = &err {
            report.push_str(&format!(
                "\nVIOLATION tenant {} step {steps}: {e}",
                self.index
            ));
        }
        report.push('\n');
        let _ = nix::unistd::write(out, report.as_bytes());
        i32::from(err.is_some())
    }
}

/// Writes `byte` over `len` bytes of `fd` through a mapping; false when
/// its pages could not all be faulted in.
fn fill(fd: RawFd, len: u64, byte: u8) -> bool {
    let p = map(fd, len);
    if p.is_null() {
        return false;
    }
    let ok = backend::sys::populate_write(p, len as usize).is_ok();
    if ok {
        // SAFETY: our live read-write mapping of `len` bytes, every page
        // faulted in above.
        unsafe { std::ptr::write_bytes(p, byte, len as usize) };
    }
    unmap(p, len);
    ok
}

/// Forks tenant `index` (as `uid` when given); it runs until `deadline`.
#[allow(clippy::too_many_arguments)]
fn spawn_tenant(
    index: usize,
    uid: Option<u32>,
    seed: u64,
    socket: &Path,
    secs: u64,
    out: OwnedFd,
    ctl: UnixStream,
    foreign_names: Vec<String>,
) -> Pid {
    let mut t = Tenant {
        index,
        own: marker(index),
        uid: 0,
        unprivileged: uid.is_some(),
        socket: socket.to_path_buf(),
        rng: Rng::new(seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        counts: [0; OP_NAMES.len()],
        steps: 0,
        client: None,
        live: Vec::new(),
        held: Vec::new(),
        ctl,
        parked: Vec::new(),
        saved: Vec::new(),
        serial: 0,
        last_state: Vec::new(),
        foreign_names,
        work: None,
    };
    // SAFETY: the child runs the tenant (syscalls, the blocking client) on
    // data prepared before the fork and leaves with `_exit`, never returning
    // into the test harness or running its destructors.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            // A wedged tenant ends with SIGALRM instead of lingering.
            let alarm = u32::try_from(secs + 120).unwrap_or(u32::MAX);
            // SAFETY: alarm takes an integer and cannot fail.
            unsafe { libc::alarm(alarm) };
            let deadline = Instant::now() + Duration::from_secs(secs);
            let code = match uid {
                Some(uid) => {
                    // SAFETY: setgid is a plain syscall on an integer.
                    let gid_ok = unsafe { libc::setgid(uid) } == 0;
                    // SAFETY: setuid is a plain syscall on an integer.
                    if gid_ok && unsafe { libc::setuid(uid) } == 0 {
                        t.uid = uid;
                        t.run(deadline, &out)
                    } else {
                        90
                    }
                }
                None => {
                    // SAFETY: geteuid has no preconditions and cannot fail.
                    t.uid = unsafe { libc::geteuid() };
                    t.run(deadline, &out)
                }
            };
            // SAFETY: ends the forked child without unwinding into the
            // parent's copy of the test harness.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => child,
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// A running tenant: index, uid, pid, its report pipe, how it ended.
type Running = (usize, Option<u32>, Pid, OwnedFd, Option<WaitStatus>);

/// What the parent saw while the tenants ran.
#[derive(Default)]
struct Watch {
    checks: u64,
    takeovers: u64,
    /// STATS samples whose books balanced, and those that did not (a
    /// release or a creation between two of its counters).
    balanced: u64,
    unbalanced: u64,
    /// The most unbalanced samples in a row, and the last one's text.
    longest_unbalanced: u64,
    last_unbalanced: Option<String>,
    failures: Vec<String>,
}

/// While the tenants run: reaps them, checks that the daemon answers
/// (in process and over its socket), samples its books, and takes it
/// over now and then (each frozen predecessor's books must balance).
fn watch(d: &SoakDaemon, tenants: &mut [Running], seed: u64, secs: u64) -> Watch {
    let mut w = Watch::default();
    let mut rng = Rng::new(seed ^ 0x7A6E_0BE5_7A4E_0001);
    let gap = |rng: &mut Rng| Duration::from_millis(1500 + rng.below(3000));
    let started = Instant::now();
    let mut next_takeover = started + gap(&mut rng);
    let mut run = 0;
    let hard_deadline = started + Duration::from_secs(secs + 150);
    while tenants.iter().any(|t| t.4.is_none()) {
        for t in tenants.iter_mut().filter(|t| t.4.is_none()) {
            match waitpid(t.2, Some(WaitPidFlag::WNOHANG)).expect("waitpid") {
                WaitStatus::StillAlive => {}
                s => t.4 = Some(s),
            }
        }
        let s = d.stats();
        assert!(!s.version.is_empty(), "in-process STATS: {s}");
        match soak::daemon::unbalanced(&s) {
            None => {
                w.balanced += 1;
                run = 0;
            }
            Some(why) => {
                w.unbalanced += 1;
                run += 1;
                w.longest_unbalanced = w.longest_unbalanced.max(run);
                w.last_unbalanced = Some(why);
            }
        }
        let mut c = d.client();
        c.stats().expect("the daemon answers STATS over its socket");
        drop(c);
        w.checks += 1;
        if Instant::now() >= next_takeover && tenants.iter().any(|t| t.4.is_none()) {
            w.takeovers += 1;
            match d.takeover() {
                Ok(frozen) => {
                    if let Some(why) = soak::daemon::unbalanced(&frozen) {
                        w.failures.push(format!(
                            "takeover {}: the frozen predecessor's books: {why}",
                            w.takeovers
                        ));
                        break;
                    }
                }
                Err(e) => {
                    w.failures.push(format!("takeover {}: {e}", w.takeovers));
                    break;
                }
            }
            next_takeover = Instant::now() + gap(&mut rng);
        }
        if Instant::now() > hard_deadline {
            w.failures.push(format!(
                "tenants still running {secs} + 150 s after the start"
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if !w.failures.is_empty() {
        for t in tenants.iter_mut().filter(|t| t.4.is_none()) {
            let _ = nix::sys::signal::kill(t.2, nix::sys::signal::Signal::SIGKILL);
            t.4 = waitpid(t.2, None).ok();
        }
    }
    w
}

/// Reads each tenant's report, prints it, and sums the counts; the
/// failures (a tenant that did not end with 0) go to `failures`.
fn reports(tenants: Vec<Running>, failures: &mut Vec<String>) -> [u64; OP_NAMES.len()] {
    let mut totals = [0u64; OP_NAMES.len()];
    // (Consumed: the report pipes close, for the fd count after the run.)
    for (i, uid, _, r, status) in tenants {
        let mut text = String::new();
        let _ = std::fs::File::from(r).read_to_string(&mut text);
        say(&format!("hostile soak: uid {uid:?} {text}"));
        for line in text.lines().filter(|l| l.starts_with("tenant ")) {
            for kv in line.split(' ') {
                if let Some((k, v)) = kv.split_once('=') {
                    if let (Some(pos), Ok(v)) =
                        (OP_NAMES.iter().position(|n| *n == k), v.parse::<u64>())
                    {
                        totals[pos] += v;
                    }
                }
            }
        }
        if !matches!(status, Some(WaitStatus::Exited(_, 0))) {
            failures.push(format!("tenant {i} (uid {uid:?}) ended with {status:?}"));
        }
    }
    totals
}

#[test]
fn hostile_tenants_soak() {
    let test = "hostile_tenants_soak";
    let _g = serial();
    if let Ok(path) = std::env::var("HUGEMEM_SOAK_LOG") {
        let f = std::fs::File::create(path).expect("log");
        let _ = tracing_subscriber::fmt()
            .with_writer(std::sync::Mutex::new(f))
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .try_init();
    }
    assert_eq!(
        Op::DamagedSaveRefused as usize + 1,
        OP_NAMES.len(),
        "an Op without its name"
    );
    let secs = env_u64("HUGEMEM_SOAK_SECS").unwrap_or(15);
    let seed = env_u64("HUGEMEM_SOAK_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ u64::from(std::process::id()).rotate_left(32)
    });
    say(&format!(
        "hostile soak: seed {seed} ({secs} s, {TENANTS} tenants); replay with HUGEMEM_SOAK_SEED={seed} HUGEMEM_SOAK_SECS={secs}\n"
    ));
    // Odd seeds run without detaching: the pool then holds dirty memory
    // (lazy handouts of it, and PARK copies onto it).
    let detach = seed.is_multiple_of(2);
    say(&format!(
        "hostile soak: pool.detach_pages = {detach} (even seeds detach)\n"
    ));
    if !reserve_2m(PAGES, test) {
        return;
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        say("hostile soak: not root, every tenant runs as this uid (no setuid)\n");
    }
    let free_before = hugepages_2m("free_hugepages");
    let d = SoakDaemon::start(|c| {
        c.allowed_uids = vec![0, NOBODY];
        // A small pool that trims to empty: the end state is checkable.
        c.pool.limit = backend::daemon::ByteSize(16 * PAGE);
        c.pool.target = backend::daemon::ByteSize(0);
        c.pool.trim_after_secs = 1;
        // Root tenants may get dirty memory lazily (and must attach a uffd).
        c.pool.lazy_dirty_uids = vec![0];
        // Dirty pooled memory exists only without detaching (a detached
        // region is refaulted kernel-zeroed and goes straight to clean):
        // odd seeds run without it, so lazy dirty handouts and UFFD happen.
        c.pool.detach_pages = detach;
    });
    for (path, mode) in [(d.dir(), 0o755), (d.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    // Warm-up, so that lazily created daemon fds exist before the baseline.
    d.client().stats().expect("stats");
    std::thread::sleep(Duration::from_millis(200));
    let fds_baseline = open_fds();

    let uids: Vec<Option<u32>> = (0..TENANTS)
        .map(|i| (root && i % 2 == 1).then_some(NOBODY))
        .collect();
    let mut tenants = Vec::new();
    let mut services = Vec::new();
    for i in 0..TENANTS {
        let (r, w) = nix::unistd::pipe().expect("pipe");
        let (ctl, tenant_ctl) = UnixStream::pair().expect("socketpair");
        let foreign: Vec<String> = (0..TENANTS)
            .filter(|&j| uids[j] != uids[i])
            .flat_map(|j| (0..soak::parking::NAMES).map(move |k| format!("t{j}-{k}")))
            .collect();
        let pid = spawn_tenant(i, uids[i], seed, &d.socket(), secs, w, tenant_ctl, foreign);
        services.push(soak::daemon::serve_orphans(Arc::clone(&d), ctl));
        tenants.push((i, uids[i], pid, r, None::<WaitStatus>));
    }
    let mut w = watch(&d, &mut tenants, seed, secs);
    let totals = reports(tenants, &mut w.failures);
    let orphaned: u64 = services.into_iter().map(|s| s.join().unwrap_or(0)).sum();
    let mut summary = format!(
        "hostile soak: seed {seed}, {secs} s, {TENANTS} tenants, {} parent liveness checks, {} takeovers, {orphaned} allocations orphaned, books balanced in {} of {} samples (longest run unbalanced {}: {:?}), totals:",
        w.checks,
        w.takeovers,
        w.balanced,
        w.balanced + w.unbalanced,
        w.longest_unbalanced,
        w.last_unbalanced
    );
    for (n, c) in OP_NAMES.iter().zip(totals) {
        summary.push_str(&format!(" {n}={c}"));
    }
    say(&format!("{summary}\n"));
    assert!(
        w.failures.is_empty(),
        "seed {seed}: {:?} (reports above)",
        w.failures
    );
    assert!(
        w.longest_unbalanced < MAX_UNBALANCED_SAMPLES,
        "seed {seed}: the daemon's books stayed unbalanced for {} samples in a row: {:?}",
        w.longest_unbalanced,
        w.last_unbalanced
    );
    assert!(
        totals[Op::Alloc as usize] >= TENANTS as u64 && totals[Op::Checks as usize] > 0,
        "seed {seed}: the soak did too little to prove anything: {summary}"
    );
    if secs >= MIN_SECS_FOR_ALL {
        let mut missing: Vec<&str> = REQUIRED
            .iter()
            .filter(|op| totals[**op as usize] == 0)
            .map(|op| OP_NAMES[*op as usize])
            .collect();
        if w.takeovers == 0 {
            missing.push("takeover");
        }
        assert!(
            missing.is_empty(),
            "seed {seed}: a {secs} s run never drove {missing:?}"
        );
    }

    // The end state: no parked VM, nothing allocated, quarantine and pool
    // drained, the books balanced, the daemon's fd table back at its
    // baseline, the host's pages back.
    let s = d.stats();
    assert!(
        s.parked.is_empty(),
        "seed {seed}: parked VMs left: {:?}",
        s.parked
    );
    wait_until("no active allocation", Duration::from_secs(30), || {
        d.stats().allocations.active == 0
    });
    wait_until("the quarantine drains", Duration::from_secs(30), || {
        d.stats().pool_sum(|p| p.quarantined_bytes) == 0
    });
    wait_until("the pool trims to empty", Duration::from_secs(30), || {
        let s = d.stats();
        s.pool_sum(|p| p.clean_bytes) == 0 && s.pool_sum(|p| p.dirty_bytes) == 0
    });
    let end = d.client().stats().expect("STATS after the soak");
    if let Some(why) = soak::daemon::unbalanced(&end) {
        panic!("seed {seed}: the books after the soak: {why}");
    }
    let fds_deadline = Instant::now() + Duration::from_secs(30);
    while open_fds() > fds_baseline {
        assert!(
            Instant::now() < fds_deadline,
            "seed {seed}: the daemon's fd count stays above its baseline {fds_baseline}: {:?}",
            fd_targets()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    say(&format!("hostile soak: end counters {:?}\n", end.counters));
    d.shutdown();
    wait_until(
        &format!("HugePages_Free (2 MiB) returns to {free_before}"),
        Duration::from_secs(30),
        || hugepages_2m("free_hugepages") >= free_before,
    );
    say(&format!(
        "hostile soak: seed {seed} passed all invariants\n"
    ));
}
