//! A save is whole or absent: it is written into a temporary sibling of
//! its directory, flushed, and renamed into place as its last step.
//!
//! The temporary is `.<name>.hugemem-save.<boot>.<pid>.<start>.<n>` beside
//! `<name>`: the boot (the first 8 characters of the kernel's boot id), the
//! pid and the start time of the process that writes it, and a number that
//! tells that process's saves apart. Its name says
//! whose it is, so a later save to the same directory removes it when
//! that process is gone (another boot, no such pid, or a pid that started
//! at another time): a SIGKILL or a power cut mid-save leaves only such a
//! temporary, never a directory under the final name. A temporary is
//! removed only when it holds nothing but the files a save writes.
//!
//! [`Staging::commit`] flushes the temporary (every file was flushed by
//! the writer) and renames it over the final name, which must not exist
//! or be an empty directory (`rename(2)` replaces an empty directory
//! atomically, and refuses one with files: a save never overwrites one),
//! then flushes the parent directory so the rename itself survives a
//! power cut. Dropped without a commit, the temporary is removed.

use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ch_migration::layout::SnapshotDirError;
use ch_migration::offload_dir::{MIGRATION_CONFIG_FILE, STATE_FILE};

use super::manifest::MANIFEST_FILE;

const TAG: &str = ".hugemem-save.";

/// A save in progress: its temporary directory, and where it goes.
#[derive(Debug)]
pub(super) struct Staging {
    temp: PathBuf,
    final_dir: PathBuf,
    parent: PathBuf,
    committed: bool,
}

impl Staging {
    /// Checks that `final_dir` can take a save (it does not exist, or is
    /// an empty directory), removes stale temporaries of earlier saves to
    /// it, and makes this save's temporary (mode 0700).
    ///
    /// # Errors
    ///
    /// [`SnapshotDirError::NotEmpty`], a path with no file name, a final
    /// path that is not a directory, I/O errors.
    pub(super) fn begin(final_dir: &Path) -> Result<Self, SnapshotDirError> {
        let name = final_dir
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| !n.starts_with('.'))
            .ok_or_else(|| {
                SnapshotDirError::Invalid(format!(
                    "{}: a save needs a directory name that does not start with '.'",
                    final_dir.display()
                ))
            })?;
        let parent = match final_dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        check_free(final_dir)?;
        remove_stale(&parent, name);
        let temp = parent.join(format!(".{name}{TAG}{}", whose()));
        DirBuilder::new()
            .mode(0o700)
            .create(&temp)
            .map_err(SnapshotDirError::io(&temp))?;
        Ok(Self {
            temp,
            final_dir: final_dir.to_owned(),
            parent,
            committed: false,
        })
    }

    /// The temporary directory the save writes into.
    pub(super) fn dir(&self) -> &Path {
        &self.temp
    }

    /// Flushes the temporary and renames it to the final name, then
    /// flushes the parent. Every file in it must have been flushed.
    ///
    /// # Errors
    ///
    /// The final directory is taken now (it got files meanwhile), I/O
    /// errors; the temporary is removed then.
    pub(super) fn commit(mut self) -> Result<(), SnapshotDirError> {
        fsync_dir(&self.temp)?;
        std::fs::rename(&self.temp, &self.final_dir).map_err(|e| {
            if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) {
                SnapshotDirError::NotEmpty(self.final_dir.clone())
            } else {
                SnapshotDirError::io(&self.final_dir)(e)
            }
        })?;
        self.committed = true;
        fsync_dir(&self.parent)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            if let Err(e) = remove_save_dir(&self.temp) {
                tracing::warn!(dir = %self.temp.display(), error = %e, "cannot remove a failed save's temporary directory");
            }
        }
    }
}

/// `final_dir` does not exist, or is an empty directory.
fn check_free(final_dir: &Path) -> Result<(), SnapshotDirError> {
    match std::fs::symlink_metadata(final_dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SnapshotDirError::io(final_dir)(e)),
        Ok(m) if !m.is_dir() => Err(SnapshotDirError::Invalid(format!(
            "{}: exists and is not a directory",
            final_dir.display()
        ))),
        Ok(_) => {
            let mut entries =
                std::fs::read_dir(final_dir).map_err(SnapshotDirError::io(final_dir))?;
            if entries.next().is_some() {
                return Err(SnapshotDirError::NotEmpty(final_dir.to_owned()));
            }
            Ok(())
        }
    }
}

/// `<boot>.<pid>.<start>.<n>` of this process's next save.
fn whose() -> String {
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!(
        "{}.{}.{}.{}",
        boot_id(),
        std::process::id(),
        start_time("self").unwrap_or(0),
        SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// The first 8 characters of the kernel's boot id.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().chars().take(8).collect())
        .unwrap_or_else(|_| "noboot".into())
}

/// Field 22 of `/proc/<pid>/stat`: when the process started, in clock
/// ticks since boot (a pid reused by another process has another).
fn start_time(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Removes the temporaries of earlier saves to `<parent>/<name>` whose
/// process is gone.
fn remove_stale(parent: &Path, name: &str) {
    let prefix = format!(".{name}{TAG}");
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let boot = boot_id();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(tail) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let mut parts = tail.split('.');
        let (Some(b), Some(pid), Some(start)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let alive = b == boot && start_time(pid).map(|s| s.to_string()).as_deref() == Some(start);
        if alive {
            continue;
        }
        let path = entry.path();
        match remove_save_dir(&path) {
            Ok(()) => {
                tracing::info!(dir = %path.display(), "removed the temporary of a save that did not finish")
            }
            Err(e) => {
                tracing::warn!(dir = %path.display(), error = %e, "a stale save's temporary was left in place")
            }
        }
    }
}

/// Whether `name` is a file a save writes.
fn written_by_save(name: &str) -> bool {
    name == MIGRATION_CONFIG_FILE
        || name == STATE_FILE
        || name == MANIFEST_FILE
        || name
            .strip_prefix("memory-")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes a save's directory: only when it is a directory (not a link)
/// holding nothing but regular files a save writes.
fn remove_save_dir(dir: &Path) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(std::io::Error::other("not a directory"));
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let ours = name.to_str().is_some_and(written_by_save) && entry.file_type()?.is_file();
        if !ours {
            return Err(std::io::Error::other(format!(
                "it holds {name:?}, which a save does not write"
            )));
        }
        files.push(entry.path());
    }
    for f in files {
        std::fs::remove_file(f)?;
    }
    std::fs::remove_dir(dir)
}

/// A new file (`O_EXCL`, mode 0600, no link followed) in a save's
/// temporary.
pub(super) fn create_file(path: &Path) -> Result<File, SnapshotDirError> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(SnapshotDirError::io(path))
}

/// `path` opened again for `O_DIRECT` writes, where its file system takes
/// them (tmpfs does not: `None`).
pub(super) fn open_direct(path: &Path) -> Option<File> {
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_DIRECT)
        .open(path)
        .inspect_err(|e| tracing::debug!(path = %path.display(), error = %e, "no O_DIRECT writes"))
        .ok()
}

/// `fsync` of a directory (its entries).
pub(super) fn fsync_dir(dir: &Path) -> Result<(), SnapshotDirError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(SnapshotDirError::io(dir))
}

/// This process's start time as a save's temporary names it (tests).
#[cfg(test)]
pub(super) fn tests_start_time() -> u64 {
    start_time("self").unwrap_or(0)
}
