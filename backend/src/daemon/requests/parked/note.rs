//! The daemon's note of its parked VMs, on disk, so that a start that
//! cannot bring them back says which were lost instead of forgetting them
//! silently (a restart without systemd's fd store, a stop that dropped
//! the store, a reboot when the note is on a persistent disk).
//!
//! The note (`park_record`, default `<socket>.parked`) lists each parked
//! VM's tenant, name, size and park time, and the VMs found lost and not
//! yet acknowledged. It is rewritten after every PARK, RESTORE and UNPARK
//! and at the start: a temporary file beside it, written and renamed over
//! it, so a daemon that ends leaves the old note or the new one, whole.
//! The note and its directory are then `fsync`ed; after a PARK, RESTORE
//! or UNPARK in a task the answer does not wait for (two `fsync`s on a
//! busy disk take tens to hundreds of ms), so a host crash in those ms
//! leaves the old note (ext4 writes a file renamed over another first) or,
//! on a file system that does not, an unusable one, which the start says.
//!
//! At the start the VMs it lists that are not parked now are **lost**:
//! STATS lists them (`lost_parked`, a tenant its own), `/metrics` counts
//! them (`hugemem_parked_lost_vms`), the log says so in one line, and
//! RESTORE or UNPARK of such a name says what happened; UNPARK clears the
//! note of it.
//!
//! **Bounded.** A tenant's parked VMs beyond [`MAX_PER_UID`] are counted,
//! not named; at most [`MAX_LOST`] lost VMs are kept (the oldest go
//! first); the note is read only up to [`MAX_BYTES`]. Nothing a tenant
//! does makes the daemon log: the one line is the start's.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use hugemem_client::stats::{LostParkedVm, ParkedVmStats};
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

/// Parked VMs named per tenant; more are counted.
pub const MAX_PER_UID: usize = 256;
/// Lost VMs kept until acknowledged.
pub const MAX_LOST: usize = 1024;
/// The largest note read.
pub const MAX_BYTES: u64 = 4 << 20;
const FORMAT: &str = "hugemem-parked";

/// One parked VM in the note.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    uid: u32,
    name: String,
    bytes: u64,
    parked_at: u64,
}

/// The note as it is on disk.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Note {
    format: String,
    version: u32,
    parked: Vec<Entry>,
    /// Parked VMs not named, by uid.
    #[serde(default)]
    unnamed: BTreeMap<u32, u64>,
    #[serde(default)]
    lost: Vec<LostParkedVm>,
}

/// The note and the lost VMs (see the module docs).
#[derive(Debug)]
pub struct ParkRecord {
    path: PathBuf,
    lost: Mutex<Vec<LostParkedVm>>,
    /// Held from the list's snapshot to the rename: writes land in order.
    writing: Mutex<bool>,
}

/// Seconds since the epoch.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub use hugemem_client::stats::utc_date as utc;

/// What a tenant reads about its lost VM.
pub fn describe(lost: &LostParkedVm) -> String {
    format!(
        "{:?} was lost: parked {} ({} bytes), gone when the daemon started at {}: {}",
        lost.name,
        utc(lost.parked_at),
        lost.bytes,
        utc(lost.lost_at),
        lost.reason
    )
}

impl ParkRecord {
    /// The note at `path`, read: the lost VMs it kept, and the VMs it
    /// lists as parked (for [`ParkRecord::reconcile`]).
    pub fn open(path: PathBuf) -> (Self, Vec<(u32, String, u64, u64)>) {
        let note = read(&path);
        let listed = note
            .parked
            .into_iter()
            .map(|e| (e.uid, e.name, e.bytes, e.parked_at))
            .collect();
        let record = Self {
            path,
            lost: Mutex::new(note.lost),
            writing: Mutex::new(false),
        };
        (record, listed)
    }

    /// The start: what the note listed as parked and `parked` (what this
    /// start brought back) does not have is lost, for `reason`; the note
    /// is rewritten. Logs one line when any was lost. Returns how many.
    pub fn reconcile(
        &self,
        listed: Vec<(u32, String, u64, u64)>,
        parked: &[ParkedVmStats],
        reason: &str,
    ) -> usize {
        let at = now();
        let gone: Vec<LostParkedVm> = listed
            .into_iter()
            .filter(|(uid, name, _, parked_at)| {
                !parked
                    .iter()
                    .any(|p| p.uid == *uid && &p.name == name && p.parked_at == *parked_at)
            })
            .map(|(uid, name, bytes, parked_at)| LostParkedVm {
                uid,
                name,
                bytes,
                parked_at,
                lost_at: at,
                reason: reason.to_string(),
            })
            .collect();
        let n = gone.len();
        if n > 0 {
            let names: Vec<String> = gone
                .iter()
                .take(16)
                .map(|l| format!("{} (uid {})", l.name, l.uid))
                .collect();
            warn!(
                lost = n,
                names = %names.join(", "),
                note = %self.path.display(),
                reason,
                "parked VMs lost: this start could not bring them back (STATS lost_parked; UNPARK of a name clears it)"
            );
            let mut lost = self.lock_lost();
            lost.extend(gone);
            let over = lost.len().saturating_sub(MAX_LOST);
            lost.drain(..over);
        }
        self.write(parked);
        n
    }

    fn lock_lost(&self) -> std::sync::MutexGuard<'_, Vec<LostParkedVm>> {
        self.lost
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lost VMs (of `uid` only, when given).
    pub fn lost(&self, uid: Option<u32>) -> Vec<LostParkedVm> {
        self.lock_lost()
            .iter()
            .filter(|l| uid.is_none_or(|u| l.uid == u))
            .cloned()
            .collect()
    }

    /// The lost VM `uid` named `name`, if any.
    pub fn find_lost(&self, uid: u32, name: &str) -> Option<LostParkedVm> {
        self.lock_lost()
            .iter()
            .find(|l| l.uid == uid && l.name == name)
            .cloned()
    }

    /// Clears the note of the lost VM `uid` named `name` (UNPARK of it);
    /// the caller rewrites the note.
    pub fn acknowledge(&self, uid: u32, name: &str) -> Option<LostParkedVm> {
        let mut lost = self.lock_lost();
        let i = lost.iter().position(|l| l.uid == uid && l.name == name)?;
        Some(lost.remove(i))
    }

    /// Rewrites the note: the VMs `parked` now and the lost ones.
    /// Blocking (a small write, a rename and two `fsync`s). A failure is
    /// logged once until a write succeeds again.
    pub fn write(&self, parked: &[ParkedVmStats]) {
        self.write_with(|| parked.to_vec());
    }

    /// [`ParkRecord::write`] of the list `parked()` gives, taken once no
    /// other write runs: writes land in the order of their lists.
    pub fn write_with(&self, parked: impl FnOnce() -> Vec<ParkedVmStats>) {
        if self.replace_with(parked) {
            self.sync();
        }
    }

    /// The note replaced by the list `parked()` gives (a temporary file
    /// written and renamed over it, in the order of the lists), not yet
    /// `fsync`ed: a daemon that ends from now on leaves this note (the
    /// page cache outlives it); [`ParkRecord::sync`] makes it outlive the
    /// host too. True when it was written.
    pub fn replace_with(&self, parked: impl FnOnce() -> Vec<ParkedVmStats>) -> bool {
        let mut warned = self
            .writing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let parked = parked();
        let mut note = Note {
            format: FORMAT.into(),
            version: 1,
            lost: self.lost(None),
            ..Note::default()
        };
        let mut per_uid: BTreeMap<u32, usize> = BTreeMap::new();
        for p in &parked {
            let n = per_uid.entry(p.uid).or_default();
            *n += 1;
            if *n > MAX_PER_UID {
                *note.unnamed.entry(p.uid).or_default() += 1;
                continue;
            }
            note.parked.push(Entry {
                uid: p.uid,
                name: p.name.clone(),
                bytes: p.bytes,
                parked_at: p.parked_at,
            });
        }
        match replace(&self.path, &note) {
            Ok(()) => {
                *warned = false;
                true
            }
            Err(e) if !*warned => {
                *warned = true;
                warn!(note = %self.path.display(), error = %e, "cannot write the note of parked VMs: a restart that loses them will not say which");
                false
            }
            Err(e) => {
                debug!(error = %e, "cannot write the note of parked VMs");
                false
            }
        }
    }

    /// `fsync`s the note and its directory (the last
    /// [`ParkRecord::replace_with`]'s note, or a later one).
    pub fn sync(&self) {
        if let Err(e) = sync(&self.path) {
            debug!(note = %self.path.display(), error = %e, "cannot fsync the note of parked VMs");
        }
    }
}

/// The note at `path`; empty when there is none or it cannot be used
/// (said in the log).
fn read(path: &Path) -> Note {
    let bytes = match std::fs::File::open(path) {
        Ok(f) => {
            let mut buf = Vec::new();
            match std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_BYTES + 1), &mut buf) {
                Ok(_) if buf.len() as u64 <= MAX_BYTES => buf,
                Ok(_) => {
                    warn!(note = %path.display(), "the note of parked VMs is over its bound; starting a new one");
                    return Note::default();
                }
                Err(e) => {
                    warn!(note = %path.display(), error = %e, "cannot read the note of parked VMs; starting a new one");
                    return Note::default();
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Note::default(),
        Err(e) => {
            warn!(note = %path.display(), error = %e, "cannot read the note of parked VMs; starting a new one");
            return Note::default();
        }
    };
    match serde_json::from_slice::<Note>(&bytes) {
        Ok(n) if n.format == FORMAT && n.version == 1 => n,
        Ok(n) => {
            warn!(note = %path.display(), format = %n.format, version = n.version, "the note of parked VMs is of another kind; starting a new one");
            Note::default()
        }
        Err(e) => {
            warn!(note = %path.display(), error = %e, "the note of parked VMs is damaged; starting a new one");
            Note::default()
        }
    }
}

/// Writes `note` to `path` through a temporary file beside it, written
/// and renamed over `path`: a reader sees the old note or the new one,
/// whole. Not `fsync`ed ([`sync`]): after a host crash before the sync the
/// note is the old one (ext4 writes a file renamed over another before the
/// rename) or, on a file system that does not, unusable, which the next
/// start says.
fn replace(path: &Path, note: &Note) -> std::io::Result<()> {
    let json = serde_json::to_vec(note).map_err(std::io::Error::other)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(&json)?;
    }
    std::fs::rename(&tmp, path)
}

/// `fsync`s the note at `path` and its directory.
fn sync(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    std::fs::File::open(dir.unwrap_or(Path::new(".")))?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parked(uid: u32, name: &str, parked_at: u64) -> ParkedVmStats {
        ParkedVmStats {
            uid,
            name: name.into(),
            bytes: 1 << 30,
            parked_at,
            ..ParkedVmStats::default()
        }
    }

    #[test]
    fn a_vm_the_start_did_not_bring_back_is_lost_until_acknowledged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("hugemem.sock.parked");
        let (r, listed) = ParkRecord::open(path.clone());
        assert!(listed.is_empty());
        r.write(&[parked(0, "web1", 10), parked(1000, "db", 20)]);

        // A start that brought back db only.
        let (r, listed) = ParkRecord::open(path.clone());
        assert_eq!(listed.len(), 2);
        assert_eq!(
            r.reconcile(listed, &[parked(1000, "db", 20)], "no fd store"),
            1
        );
        let lost = r.lost(None);
        assert_eq!((lost[0].uid, lost[0].name.as_str()), (0, "web1"));
        assert!(r.lost(Some(1000)).is_empty(), "a tenant sees its own");

        // The next start still reports it (the note kept it), once.
        let (r, listed) = ParkRecord::open(path.clone());
        assert_eq!(r.reconcile(listed, &[parked(1000, "db", 20)], "again"), 0);
        assert_eq!(r.lost(None).len(), 1);
        let said = describe(&r.find_lost(0, "web1").expect("lost"));
        assert!(
            said.contains("no fd store") && said.contains("1970-01-01 00:00:10 UTC"),
            "{said}"
        );
        assert!(r.acknowledge(0, "web1").is_some());
        r.write(&[parked(1000, "db", 20)]);
        let (r, _) = ParkRecord::open(path);
        assert!(r.lost(None).is_empty(), "acknowledged");
    }

    #[test]
    fn the_note_is_bounded_and_a_damaged_one_is_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("note");
        std::fs::write(&path, b"{not json").expect("write");
        let (r, listed) = ParkRecord::open(path.clone());
        assert!(listed.is_empty());
        let many: Vec<ParkedVmStats> = (0..(MAX_PER_UID as u64 + 10))
            .map(|i| parked(7, &format!("vm{i}"), i))
            .collect();
        r.write(&many);
        let (_, listed) = ParkRecord::open(path.clone());
        assert_eq!(listed.len(), MAX_PER_UID, "named up to the bound");
        let note = read(&path);
        assert_eq!(note.unnamed.get(&7), Some(&10), "the rest counted");
    }
}
