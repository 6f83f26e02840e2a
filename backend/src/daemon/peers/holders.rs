//! Who else can still touch a region: a scan of `/proc/*/fd` and `/proc/*/maps`.
//!
//! A region may be scrubbed (and later handed to another tenant) only when no
//! process but the daemon can read or write it. Two things keep a memfd's
//! pages reachable: an open fd (`/proc/PID/fd/N` links to it), and a mapping,
//! which survives closing the fd it was made from (`/proc/PID/maps` names the
//! file's device and inode). Both are checked; checking only fds would scrub
//! under a VMM that closed its fd after `mmap`, which every VMM does.
//!
//! Files are matched by `(st_dev, st_ino)` — memfd names are not unique and
//! `(deleted)` suffixes make paths useless. `fd` links are `stat`ed (which
//! follows them to the file); `maps` lines carry `major:minor inode` of the
//! file's superblock, compared with the `major`/`minor` of `st_dev`.
//!
//! The daemon's own process is scanned too, minus exactly what the pool owns:
//! the region's own fd number and its own mapping's address range. Anything
//! else in the daemon's process is a holder — which keeps in-process clients
//! (the tests, an embedding VMM) honest.
//!
//! A process whose `fd` directory cannot be read (`EACCES` for a daemon that
//! does not run as root) counts as a holder of everything: "unknown" must
//! never mean "free". Processes that exit mid-scan (`ENOENT`) are skipped.
//!
//! The alternative, `/proc/PID/map_files/`, needs `CAP_SYS_ADMIN` and gives
//! the same answer with a `stat` per mapping; `maps` is one read per process.
//!
//! The scan is blocking file I/O over every process; callers run it on a
//! blocking thread, never on the async executor.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A file's identity: `st_dev` and `st_ino`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    /// Device of the file's superblock.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
}

impl FileId {
    /// `fstat` of an open fd.
    ///
    /// # Errors
    ///
    /// The `fstat` error.
    pub fn of(fd: BorrowedFd<'_>) -> io::Result<Self> {
        let st = nix::sys::stat::fstat(fd).map_err(io::Error::from)?;
        // st_dev and st_ino are u64 on every Linux target we build for.
        #[allow(clippy::useless_conversion)]
        Ok(Self {
            dev: u64::from(st.st_dev),
            ino: u64::from(st.st_ino),
        })
    }

    fn major_minor(&self) -> (u64, u64) {
        // The kernel's new_encode_dev layout, as glibc's gnu_dev_major/minor.
        let major = ((self.dev >> 8) & 0xfff) | ((self.dev >> 32) & !0xfff);
        let minor = (self.dev & 0xff) | ((self.dev >> 12) & !0xff);
        (major, minor)
    }
}

/// What the daemon itself holds of one file: exempt from the scan.
#[derive(Debug, Clone)]
pub struct Owned {
    /// The file.
    pub id: FileId,
    /// The daemon's own fd number for it.
    pub fd: RawFd,
    /// The daemon's own mapping of it.
    pub map: Range<usize>,
}

impl Owned {
    /// The exemption for a region: its fd and its mapping.
    ///
    /// # Errors
    ///
    /// `fstat` errors.
    pub fn region(fd: BorrowedFd<'_>, addr: usize, len: usize) -> io::Result<Self> {
        Ok(Self {
            id: FileId::of(fd)?,
            fd: fd.as_raw_fd(),
            map: addr..addr.saturating_add(len),
        })
    }
}

/// How a process holds a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hold {
    /// An open fd with this number.
    Fd(i32),
    /// A mapping at this address range.
    Map(Range<usize>),
    /// The process could not be inspected; counted as a holder.
    Unknown,
}

/// One process that still holds a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Process id.
    pub pid: i32,
    /// How.
    pub hold: Hold,
}

/// The outcome of one scan.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    /// Per target, in the order given: the first holder found, if any.
    pub holders: Vec<Option<Holder>>,
    /// Processes looked at.
    pub processes: usize,
}

/// The pid of the daemon this one took over from while it still runs
/// (`crate::daemon::restart::takeover`): it holds every region until it exits, as
/// the daemon's own, so scans skip it. Cleared when it exits (a pidfd
/// watch), so a later process with a reused pid is scanned. The start
/// makes one and hands it to the pool and the lifecycle.
#[derive(Debug, Default)]
pub struct Predecessor(std::sync::atomic::AtomicI32);

impl Predecessor {
    /// Records the predecessor daemon's pid (scans skip it until it
    /// exits), or none.
    pub fn set(&self, pid: Option<i32>) {
        self.0
            .store(pid.unwrap_or(0), std::sync::atomic::Ordering::SeqCst);
    }

    /// The pid scans skip, if any.
    pub fn get(&self) -> Option<i32> {
        Some(self.0.load(std::sync::atomic::Ordering::SeqCst)).filter(|p| *p != 0)
    }
}

/// Scans every process for fds and mappings of `targets` other than the
/// daemon's own (see the module docs) and `predecessor`'s.
pub fn scan(targets: &[Owned], predecessor: Option<i32>) -> Scan {
    scan_root(Path::new("/proc"), std::process::id(), predecessor, targets)
}

/// [`scan`] of a clean region about to be handed out again: the daemon's
/// own fault helpers, which may still be faulting its holes in (they write
/// no data, `crate::fault_helpers`), are not holders here. (They are in
/// the quarantine's [`scan`]: a released region is never detached while
/// one still faults it.)
pub fn scan_for_reuse(targets: &[Owned], predecessor: Option<i32>) -> Scan {
    let skip = |pid| predecessor == Some(pid) || crate::fault_helpers::is_own_helper(pid);
    scan_root_skipping(Path::new("/proc"), std::process::id(), &skip, targets)
}

fn scan_root(proc_root: &Path, self_pid: u32, predecessor: Option<i32>, targets: &[Owned]) -> Scan {
    scan_root_skipping(
        proc_root,
        self_pid,
        &|pid| predecessor == Some(pid),
        targets,
    )
}

fn scan_root_skipping(
    proc_root: &Path,
    self_pid: u32,
    skip: &dyn Fn(i32) -> bool,
    targets: &[Owned],
) -> Scan {
    let mut out = Scan {
        holders: vec![None; targets.len()],
        processes: 0,
    };
    if targets.is_empty() {
        return out;
    }
    let by_id: HashMap<FileId, Vec<usize>> =
        targets
            .iter()
            .enumerate()
            .fold(HashMap::new(), |mut m, (i, t)| {
                m.entry(t.id).or_default().push(i);
                m
            });
    let by_dev_ino = maps_index(targets);
    let Ok(dir) = fs::read_dir(proc_root) else {
        // No /proc: nothing can be proven; everything is held.
        out.holders = vec![
            Some(Holder {
                pid: 0,
                hold: Hold::Unknown
            });
            targets.len()
        ];
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = process_id(&entry) else {
            continue;
        };
        out.processes += 1;
        if skip(pid) {
            continue;
        }
        let is_self = u32::try_from(pid).is_ok_and(|p| p == self_pid);
        let base = entry.path();
        scan_fds(&base, pid, is_self, targets, &by_id, &mut out.holders);
        scan_maps(&base, pid, is_self, targets, &by_dev_ino, &mut out.holders);
        if out.holders.iter().all(Option::is_some) {
            break;
        }
    }
    out
}

/// The targets' indices by the key a `/proc/PID/maps` line gives a file
/// (device major, minor and inode).
fn maps_index(targets: &[Owned]) -> HashMap<(u64, u64, u64), Vec<usize>> {
    targets
        .iter()
        .enumerate()
        .fold(HashMap::new(), |mut m, (i, t)| {
            let (maj, min) = t.id.major_minor();
            m.entry((maj, min, t.id.ino)).or_default().push(i);
            m
        })
}

/// The process a `/proc` entry is, if it is one.
fn process_id(entry: &fs::DirEntry) -> Option<i32> {
    entry.file_name().to_str()?.parse().ok()
}

fn mark(holders: &mut [Option<Holder>], i: usize, holder: Holder) {
    if holders[i].is_none() {
        holders[i] = Some(holder);
    }
}

fn scan_fds(
    base: &Path,
    pid: i32,
    is_self: bool,
    targets: &[Owned],
    by_id: &HashMap<FileId, Vec<usize>>,
    holders: &mut [Option<Holder>],
) {
    let dir = match fs::read_dir(base.join("fd")) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return,
        Err(_) => {
            for i in 0..targets.len() {
                mark(
                    holders,
                    i,
                    Holder {
                        pid,
                        hold: Hold::Unknown,
                    },
                );
            }
            return;
        }
    };
    for entry in dir.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        // `metadata` follows the magic link to the open file itself.
        let Ok(meta) = fs::metadata(entry.path()) else {
            continue;
        };
        let id = FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        };
        if let Some(idx) = by_id.get(&id) {
            for &i in idx {
                if is_self && targets[i].fd == fd {
                    continue;
                }
                // The daemon's own description, duplicated into systemd's
                // fd store or in flight to a successor: not a holder.
                if crate::sys::same_description(pid, fd, targets[i].fd) {
                    continue;
                }
                mark(
                    holders,
                    i,
                    Holder {
                        pid,
                        hold: Hold::Fd(fd),
                    },
                );
            }
        }
    }
}

fn scan_maps(
    base: &Path,
    pid: i32,
    is_self: bool,
    targets: &[Owned],
    by_dev_ino: &HashMap<(u64, u64, u64), Vec<usize>>,
    holders: &mut [Option<Holder>],
) {
    let text = match fs::read_to_string(base.join("maps")) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return,
        // ESRCH/EACCES on a process going away or a kernel thread: an
        // unreadable fd table was already counted above.
        Err(_) => return,
    };
    for line in text.lines() {
        let Some((range, key)) = parse_maps_line(line) else {
            continue;
        };
        if let Some(idx) = by_dev_ino.get(&key) {
            for &i in idx {
                let own = &targets[i].map;
                if is_self && range.start >= own.start && range.end <= own.end {
                    continue;
                }
                mark(
                    holders,
                    i,
                    Holder {
                        pid,
                        hold: Hold::Map(range.clone()),
                    },
                );
            }
        }
    }
}

/// Every process (at most 32, by pid) that maps any of `targets`, other
/// than the daemon's own mappings of them (see the module docs) and the
/// processes `skip` names: a full scan of `/proc/*/maps` (fds are not
/// looked at: an fd alone runs nothing on the memory). Blocking file I/O.
pub fn mappers(targets: &[Owned], skip: &dyn Fn(i32) -> bool) -> Vec<i32> {
    mappers_under(Path::new("/proc"), std::process::id(), skip, targets)
}

fn mappers_under(
    proc_root: &Path,
    self_pid: u32,
    skip: &dyn Fn(i32) -> bool,
    targets: &[Owned],
) -> Vec<i32> {
    let mut out = Vec::new();
    if targets.is_empty() {
        return out;
    }
    let by_dev_ino = maps_index(targets);
    let Ok(dir) = fs::read_dir(proc_root) else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = process_id(&entry) else {
            continue;
        };
        if skip(pid) {
            continue;
        }
        let is_self = u32::try_from(pid).is_ok_and(|p| p == self_pid);
        let mut found = vec![None; targets.len()];
        scan_maps(
            &entry.path(),
            pid,
            is_self,
            targets,
            &by_dev_ino,
            &mut found,
        );
        if found.iter().any(Option::is_some) {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out.truncate(32);
    out
}

/// Whether process `pid` maps any of `files` (its `/proc/PID/maps`); false
/// when it cannot be read (gone, or not ours to read).
pub fn maps_any(pid: u32, files: &[FileId]) -> bool {
    let Ok(text) = fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return false;
    };
    let keys: Vec<(u64, u64, u64)> = files
        .iter()
        .map(|f| {
            let (maj, min) = f.major_minor();
            (maj, min, f.ino)
        })
        .collect();
    text.lines()
        .filter_map(parse_maps_line)
        .any(|(_, key)| keys.contains(&key))
}

/// `start-end perms offset maj:min inode path` → (range, (maj, min, inode)),
/// for lines that name a file (inode ≠ 0).
fn parse_maps_line(line: &str) -> Option<(Range<usize>, (u64, u64, u64))> {
    let mut f = line.split_whitespace();
    let range = f.next()?;
    let _perms = f.next()?;
    let _offset = f.next()?;
    let dev = f.next()?;
    let ino: u64 = f.next()?.parse().ok()?;
    if ino == 0 {
        return None;
    }
    let (start, end) = range.split_once('-')?;
    let (maj, min) = dev.split_once(':')?;
    Some((
        usize::from_str_radix(start, 16).ok()?..usize::from_str_radix(end, 16).ok()?,
        (
            u64::from_str_radix(maj, 16).ok()?,
            u64::from_str_radix(min, 16).ok()?,
            ino,
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn parses_maps_lines() {
        let l = "7f0000000000-7f0000200000 rw-s 00000000 00:0f 1234   /memfd:hugemem-r1 (deleted)";
        let (r, k) = parse_maps_line(l).expect("line");
        assert_eq!(r, 0x7f00_0000_0000..0x7f00_0020_0000);
        assert_eq!(k, (0, 0xf, 1234));
        assert!(parse_maps_line("7f0000000000-7f0000001000 r--p 00000000 00:00 0 ").is_none());
        assert!(parse_maps_line("garbage").is_none());
    }

    /// True once a scan finds no holder of `own`. Other tests of this
    /// binary fork (a daemon's fault helpers, a spawned process): a child
    /// holds a copy of every fd of this process until it closes them or
    /// execs, a real holder for that moment, so the scan may need to look
    /// again.
    fn no_holder_settles(own: &Owned) -> bool {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if scan(std::slice::from_ref(own), None).holders[0].is_none() {
                return true;
            }
            if std::time::Instant::now() > until {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn own_fd_is_exempt_and_a_second_fd_is_a_holder() {
        let file = tempfile::tempfile().expect("tempfile");
        let own = Owned::region(file.as_fd(), 0, 0).expect("owned");
        assert!(no_holder_settles(&own));
        // A duplicate of the daemon's own description (systemd's fd store,
        // a successor in flight) is not a holder (kcmp) ...
        let same = file.try_clone().expect("dup");
        assert!(no_holder_settles(&own));
        drop(same);
        // ... another description of the file (what a tenant has) is.
        let dup = crate::sys::reopen(file.as_fd()).expect("reopen");
        let s = scan(std::slice::from_ref(&own), None);
        let pid = i32::try_from(std::process::id()).expect("pid");
        assert_eq!(
            s.holders[0],
            Some(Holder {
                pid,
                hold: Hold::Fd(dup.as_raw_fd())
            })
        );
        drop(dup);
        assert!(no_holder_settles(&own));
    }

    #[test]
    fn mappers_are_the_processes_mapping_a_file_not_those_holding_an_fd() {
        // A child that maps its own executable; this process holds an fd
        // of that file too (not a mapping: not a mapper).
        let mut child = std::process::Command::new("sh")
            .args(["-c", "echo running; read end"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start sh");
        let mut said = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("its stdout")),
            &mut said,
        )
        .expect("its first line");
        let exe = fs::File::open(format!("/proc/{}/exe", child.id())).expect("open");
        let own = Owned::region(exe.as_fd(), 0, 0).expect("owned");
        let pid = i32::try_from(child.id()).expect("pid");
        let found = mappers(std::slice::from_ref(&own), &|_| false);
        let skipped = mappers(std::slice::from_ref(&own), &|p| p == pid);
        drop(child.stdin.take());
        let _ = child.wait();
        assert!(found.contains(&pid), "{found:?}");
        assert!(!skipped.contains(&pid), "{skipped:?}");
        let me = i32::try_from(std::process::id()).expect("pid");
        assert!(!found.contains(&me), "an fd is not a mapping: {found:?}");
    }

    #[test]
    fn device_numbers_split_like_glibc() {
        let id = FileId {
            dev: libc::makedev(259, 70000),
            ino: 1,
        };
        assert_eq!(id.major_minor(), (259, 70000));
        let id = FileId {
            dev: libc::makedev(0, 15),
            ino: 1,
        };
        assert_eq!(id.major_minor(), (0, 15));
    }
}
