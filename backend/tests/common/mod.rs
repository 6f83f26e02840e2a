//! Helpers shared by the daemon-level test files (each test binary compiles
//! this module and uses a subset of it, hence the `dead_code` allowance).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use backend::client::{Client, ClientError};
use backend::daemon::{Config, Daemon, DaemonHandle};
use backend::proto::Status;
use backend::stats::{PoolStats, RegionStats, Stats};
use guest_mem::PageSize;

static SERIAL: Mutex<()> = Mutex::new(());

/// Serializes the tests of one binary: they share the host's huge-page pools.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reserves `n` free 2 MiB pages; `false` (after printing SKIP) when impossible.
pub fn reserve_2m(n: u64, test: &str) -> bool {
    match guest_mem::ensure_free(PageSize::Huge2M, n, None) {
        Ok(r) if r.met => true,
        Ok(r) => {
            test_support::skip!("{test}: only {} free 2 MiB pages, {n} needed", r.free);
            false
        }
        Err(e) => {
            test_support::skip!("{test}: cannot reserve 2 MiB pages: {e}");
            false
        }
    }
}

/// This process's open fds: the fd table of a daemon running in it.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// A host-wide count of the 2 MiB pool from sysfs (`free_hugepages`, ...).
pub fn hugepages_2m(what: &str) -> u64 {
    let path = format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{what}");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .expect("page count")
}

/// `field` summed over every pool in a STATS document.
pub fn pool_bytes(stats: &Stats, field: impl Fn(&PoolStats) -> u64) -> u64 {
    stats.pool_sum(field)
}

/// `mmap(MAP_SHARED)` of `len` bytes of `fd`, or null. Raw rather than a
/// [`Map`]: forked tenant children use it, and they report a failure through
/// their exit code instead of panicking.
pub fn map_raw(fd: RawFd, len: u64) -> *mut u8 {
    let Ok(n) = usize::try_from(len) else {
        return std::ptr::null_mut();
    };
    // SAFETY: a fresh shared mapping chosen by the kernel; aliases nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p.cast()
    }
}

/// Unmaps what [`map_raw`] mapped.
pub fn unmap_raw(p: *mut u8, len: u64) {
    let Ok(n) = usize::try_from(len) else {
        return;
    };
    // SAFETY: `p` is a mapping of `len` bytes made by `map_raw`, unmapped once.
    unsafe { libc::munmap(p.cast(), n) };
}

/// Polls `cond` until it holds, failing the test after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A daemon on a socket in its own temporary directory, shut down cleanly
/// by [`TestDaemon::shutdown`] (or on drop of the handle).
pub struct TestDaemon {
    handle: Option<DaemonHandle>,
    dir: tempfile::TempDir,
}

impl TestDaemon {
    /// Starts a daemon with quick quarantine re-checks, after `tweak`.
    pub fn start(tweak: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = Config {
            socket: dir.path().join("hugemem.sock"),
            ..Config::default()
        };
        cfg.pool.recheck_ms = 50;
        tweak(&mut cfg);
        let handle = Daemon::start(cfg).expect("daemon starts");
        Self {
            handle: Some(handle),
            dir,
        }
    }

    pub fn handle(&self) -> &DaemonHandle {
        self.handle.as_ref().expect("running")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn socket(&self) -> PathBuf {
        self.handle().socket_path().to_path_buf()
    }

    pub fn client(&self) -> Client {
        let c = Client::connect(&self.socket()).expect("connect");
        c.set_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        c
    }

    pub fn stats(&self) -> Stats {
        self.handle().stats()
    }

    pub fn shutdown(mut self) {
        self.handle
            .take()
            .expect("running")
            .shutdown()
            .expect("clean shutdown");
    }
}

/// A read-write mapping used as guest RAM or the daemon's view of it in the
/// userfaultfd and lazy-mode tests, unmapped on drop.
pub struct Map {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; accesses go
// through raw pointers with volatile or bulk reads and writes, and unmapping
// happens once, in drop, after every `Arc` holder is gone.
unsafe impl Send for Map {}
// SAFETY: as for Send; `&Map` only hands out the address and reads/writes
// through raw pointers.
unsafe impl Sync for Map {}

impl Map {
    fn mapped(p: *mut libc::c_void, len: usize) -> std::sync::Arc<Map> {
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        std::sync::Arc::new(Map { ptr: p.cast(), len })
    }

    /// `MAP_SHARED` read-write mapping of `len` bytes of `fd`.
    pub fn shared(fd: std::os::fd::BorrowedFd<'_>, len: usize) -> std::sync::Arc<Map> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh mapping chosen by the kernel (no MAP_FIXED), so it
        // aliases nothing; `fd` is open for the call.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        Self::mapped(p, len)
    }

    /// Private anonymous read-write mapping of `len` bytes.
    pub fn anon(len: usize) -> std::sync::Arc<Map> {
        // SAFETY: a fresh anonymous private mapping with no fd; aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        Self::mapped(p, len)
    }

    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Writes `byte` over `[off, off + len)`. Must not hit an unserved
    /// registered page (it would block the caller).
    pub fn fill(&self, off: usize, len: usize, byte: u8) {
        assert!(off + len <= self.len);
        // SAFETY: in bounds of this live read-write mapping (checked above).
        unsafe { std::ptr::write_bytes(self.ptr.wrapping_add(off), byte, len) };
    }

    pub fn read(&self, off: usize) -> u8 {
        assert!(off < self.len);
        // SAFETY: in bounds of this live mapping; volatile because another
        // mapping or process may change it.
        unsafe { self.ptr.wrapping_add(off).read_volatile() }
    }

    pub fn write(&self, off: usize, byte: u8) {
        assert!(off < self.len);
        // SAFETY: in bounds of this live read-write mapping.
        unsafe { self.ptr.wrapping_add(off).write_volatile(byte) }
    }

    /// True when every byte of `[off, off + len)` is `byte`.
    pub fn all(&self, off: usize, len: usize, byte: u8) -> bool {
        assert!(off + len <= self.len);
        // SAFETY: in bounds of this live mapping; read only while no one writes.
        let s = unsafe { std::slice::from_raw_parts(self.ptr.wrapping_add(off), len) };
        s.iter().all(|b| *b == byte)
    }

    /// True when no byte of `[off, off + len)` is `byte` (reads fault pages in).
    pub fn none_is(&self, off: usize, len: usize, byte: u8) -> bool {
        assert!(off + len <= self.len);
        // SAFETY: in bounds of this live mapping; nobody writes it meanwhile.
        let s = unsafe { std::slice::from_raw_parts(self.ptr.wrapping_add(off), len) };
        !s.contains(&byte)
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping this value created, and
        // this is its only unmap.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
/// The status and message of a request the daemon refused; panics on
/// anything else.
pub fn refused<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (Status, String) {
    match r {
        Err(ClientError::Refused { status, message }) => (status, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Region `id` in STATS's `regions` list.
pub fn region(stats: &Stats, id: u64) -> Option<RegionStats> {
    stats.region(id).cloned()
}

/// The `state` of region `id` in STATS.
pub fn region_state(stats: &Stats, id: u64) -> Option<String> {
    stats.region(id).map(|r| r.state.clone())
}

pub mod tenant;

/// One HTTP/1.1 exchange with the metrics endpoint: (status line, headers, body).
pub fn http_get(addr: std::net::SocketAddr, method: &str, path: &str) -> (String, String, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("response");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (
        status.to_string(),
        headers.to_ascii_lowercase(),
        body.to_string(),
    )
}

/// Parses OpenMetrics text strictly: every line is `# HELP`, `# TYPE`,
/// `# UNIT`, the final `# EOF`, or a sample `name{labels} value` of the
/// family most recently typed (a counter's samples end in `_total`); names
/// and label syntax as the format says; no family typed twice; no sample
/// twice. Returns `name{labels}` -> value, labels as written.
pub fn parse_openmetrics(text: &str) -> std::collections::BTreeMap<String, f64> {
    use std::collections::{BTreeMap, BTreeSet};
    let name_ok = |n: &str| {
        let mut c = n.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
            && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
    };
    let labels_ok = |l: &str| -> bool {
        // k="v",k="v" with \\, \" and \n escapes inside values.
        let mut rest = l;
        loop {
            let Some((k, after)) = rest.split_once("=\"") else {
                return false;
            };
            if !name_ok(k) {
                return false;
            }
            let mut chars = after.char_indices();
            let mut end = None;
            while let Some((i, ch)) = chars.next() {
                match ch {
                    '\\' if !matches!(chars.next(), Some((_, '\\' | '"' | 'n'))) => {
                        return false;
                    }
                    '"' => {
                        end = Some(i);
                        break;
                    }
                    '\n' => return false,
                    _ => {}
                }
            }
            let Some(end) = end else { return false };
            rest = &after[end + 1..];
            if rest.is_empty() {
                return true;
            }
            let Some(r) = rest.strip_prefix(',') else {
                return false;
            };
            rest = r;
        }
    };
    let lines: Vec<&str> = text.split_terminator('\n').collect();
    assert_eq!(lines.last(), Some(&"# EOF"), "ends with # EOF:\n{text}");
    let mut families = BTreeSet::new();
    let mut current: Option<(String, String)> = None;
    let mut samples = BTreeMap::new();
    for line in &lines[..lines.len() - 1] {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut f = rest.splitn(3, ' ');
            let (kw, name, arg) = (f.next(), f.next(), f.next());
            let name = name.unwrap_or_else(|| panic!("bad line {line:?}"));
            assert!(name_ok(name), "bad name in {line:?}");
            let arg = arg.unwrap_or_else(|| panic!("bad line {line:?}"));
            match kw {
                Some("HELP") => {}
                Some("UNIT") => assert!(name.ends_with(&format!("_{arg}")), "{line:?}"),
                Some("TYPE") => {
                    assert!(
                        [
                            "counter",
                            "gauge",
                            "histogram",
                            "summary",
                            "info",
                            "stateset",
                            "unknown",
                            "gaugehistogram"
                        ]
                        .contains(&arg),
                        "{line:?}"
                    );
                    assert!(families.insert(name.to_string()), "{name} typed twice");
                    current = Some((name.to_string(), arg.to_string()));
                }
                _ => panic!("bad line {line:?}"),
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name = match series.split_once('{') {
            Some((n, l)) => {
                let l = l
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("bad labels in {line:?}"));
                assert!(labels_ok(l), "bad labels in {line:?}");
                n
            }
            None => series,
        };
        assert!(name_ok(name), "bad name in {line:?}");
        let (family, kind) = current
            .as_ref()
            .unwrap_or_else(|| panic!("sample before any TYPE: {line:?}"));
        let want = match kind.as_str() {
            "counter" => format!("{family}_total"),
            _ => family.clone(),
        };
        assert_eq!(name, want, "sample of another family: {line:?}");
        assert!(
            samples.insert(series.to_string(), value).is_none(),
            "{series} twice"
        );
    }
    samples
}
