//! Whether a QEMU binary's `memory-backend-file` takes `rom` (QEMU 8.2 on),
//! which decides how a shared clone's QEMU opens its template (`clone.rs`).
//!
//! QEMU says so only when run (`-object memory-backend-file,help`), and
//! that process took 40 to 80 ms on the 2-CPU test host: longer than the
//! CLONE exchange it runs beside, so every shared clone waited for it.
//! The answer is a property of the binary, so it is kept per user, one
//! small file per binary, named after the binary's device, inode, size and
//! modification time: an upgrade that replaces the file asks again. The
//! files live in `$XDG_RUNTIME_DIR/hugemem` (else `~/.cache/hugemem`), a
//! directory of the user's own, mode 0700; one that is not the user's, or
//! that others may write, is not used. A wrong answer costs only the
//! user's own clone: QEMU refuses an option it lacks before it runs.

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A question to a QEMU binary about `rom`: answered from the cache, or
/// being asked (the answer then goes into the cache).
#[derive(Debug)]
pub(super) struct RomQuestion {
    known: Option<bool>,
    asked: Option<Child>,
    entry: Option<PathBuf>,
}

/// Asks `program` (a path, or a name looked up on `PATH`) whether its
/// `memory-backend-file` takes `rom`, unless the cache knows. Runs while
/// the caller does other work; [`RomQuestion::takes_rom`] waits.
pub(super) fn ask(program: &OsString) -> RomQuestion {
    ask_with_cache(program, cache_dir().as_deref())
}

fn ask_with_cache(program: &OsString, cache: Option<&Path>) -> RomQuestion {
    let entry = cache.and_then(|dir| Some(dir.join(entry_name(&binary(program)?)?)));
    if let Some(known) = entry.as_deref().and_then(read_entry) {
        tracing::debug!(
            rom = known,
            "QEMU's memory-backend-file options: known for this binary"
        );
        return RomQuestion {
            known: Some(known),
            asked: None,
            entry: None,
        };
    }
    let asked = Command::new(program)
        .args(["-object", "memory-backend-file,help"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok();
    RomQuestion {
        known: None,
        asked,
        entry,
    }
}

impl RomQuestion {
    /// The answer: QEMU lists `rom=` among the options. A QEMU that cannot
    /// be run or fails says no (and nothing is kept).
    pub(super) fn takes_rom(self) -> bool {
        if let Some(known) = self.known {
            return known;
        }
        let Some(out) = self.asked.and_then(|c| c.wait_with_output().ok()) else {
            return false;
        };
        let rom = String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.trim_start().starts_with("rom="));
        if out.status.success() {
            if let Some(entry) = self.entry {
                write_entry(&entry, rom);
            }
        }
        rom
    }
}

/// The file `program` runs: itself when it has a `/`, else the first
/// executable of that name on `PATH` (as `Command` finds it).
fn binary(program: &OsStr) -> Option<PathBuf> {
    let path = Path::new(program);
    if program.as_encoded_bytes().contains(&b'/') {
        return Some(path.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(path))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0))
}

/// The cache file's name for `binary`: what changes when it is replaced.
fn entry_name(binary: &Path) -> Option<String> {
    let m = std::fs::metadata(binary).ok()?;
    Some(format!(
        "qemu-memory-backend-file-rom-{:x}-{:x}-{:x}-{}.{}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec()
    ))
}

/// This user's cache directory, created 0700; `None` when there is none
/// that is only the user's.
fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|v| !v.is_empty())
        .map(|v| PathBuf::from(v).join("hugemem"))
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|v| PathBuf::from(v).join(".cache/hugemem"))
        })?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&base)
        .ok()?;
    let m = std::fs::metadata(&base).ok()?;
    (m.is_dir() && owned_by_us(&m) && m.permissions().mode() & 0o022 == 0).then_some(base)
}

fn owned_by_us(m: &std::fs::Metadata) -> bool {
    m.uid() == nix::unistd::geteuid().as_raw()
}

/// A kept answer: the file is ours and says `rom=1` or `rom=0`.
fn read_entry(entry: &Path) -> Option<bool> {
    let m = std::fs::symlink_metadata(entry).ok()?;
    if !m.is_file() || !owned_by_us(&m) {
        return None;
    }
    match std::fs::read_to_string(entry).ok()?.trim() {
        "rom=1" => Some(true),
        "rom=0" => Some(false),
        _ => None,
    }
}

/// Keeps an answer (written aside and renamed: a reader sees all or none
/// of it). A failure only means the next clone asks again.
fn write_entry(entry: &Path, rom: bool) {
    let Some(dir) = entry.parent() else {
        return;
    };
    let written = tempfile::NamedTempFile::new_in(dir).and_then(|mut f| {
        writeln!(f, "rom={}", u8::from(rom))?;
        f.persist(entry).map_err(|e| e.error)?;
        Ok(())
    });
    if let Err(e) = written {
        tracing::debug!(error = %e, entry = %entry.display(), "QEMU's memory-backend-file options not kept");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for QEMU's option listing: prints `rom=` when `rom`,
    /// and counts its runs in `runs`.
    fn fake_qemu(dir: &Path, rom: bool, runs: &Path) -> OsString {
        let program = dir.join("qemu-fake");
        // Of different lengths: a replaced file differs in size even
        // where its inode and coarse modification time come back the same.
        let listing = if rom {
            "  rom=<OnOffAuto>"
        } else {
            "  readonly=<bool> - no rom here"
        };
        std::fs::write(
            &program,
            format!(
                "#!/bin/sh\necho run >> '{}'\necho 'memory-backend-file options:'\necho '{listing}'\n",
                runs.display()
            ),
        )
        .expect("write the stand-in");
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the stand-in");
        program.into_os_string()
    }

    fn runs(path: &Path) -> usize {
        std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
    }

    #[test]
    fn a_binary_is_asked_once_and_again_when_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = dir.path().join("cache");
        std::fs::create_dir(&cache).expect("cache dir");
        let counted = dir.path().join("runs");
        let program = fake_qemu(dir.path(), true, &counted);
        assert!(ask_with_cache(&program, Some(&cache)).takes_rom());
        assert!(ask_with_cache(&program, Some(&cache)).takes_rom());
        assert_eq!(runs(&counted), 1, "the second answer came from the cache");
        // Replaced by one without `rom` (a new file): asked again.
        std::fs::remove_file(&program).expect("remove the stand-in");
        let program = fake_qemu(dir.path(), false, &counted);
        assert!(!ask_with_cache(&program, Some(&cache)).takes_rom());
        assert!(!ask_with_cache(&program, Some(&cache)).takes_rom());
        assert_eq!(runs(&counted), 2);
    }

    #[test]
    fn no_cache_asks_every_time_and_a_failed_answer_is_not_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let counted = dir.path().join("runs");
        let program = fake_qemu(dir.path(), true, &counted);
        assert!(ask_with_cache(&program, None).takes_rom());
        assert!(ask_with_cache(&program, None).takes_rom());
        assert_eq!(runs(&counted), 2);
        let cache = dir.path().join("cache");
        std::fs::create_dir(&cache).expect("cache dir");
        let failing = dir.path().join("qemu-failing");
        std::fs::write(&failing, "#!/bin/sh\necho '  rom=<bool>'\nexit 1\n").expect("write");
        std::fs::set_permissions(&failing, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        assert!(ask_with_cache(&failing.clone().into_os_string(), Some(&cache)).takes_rom());
        assert_eq!(
            std::fs::read_dir(&cache).expect("read cache").count(),
            0,
            "a QEMU that failed is not believed next time"
        );
        let missing = OsString::from(dir.path().join("no-such-qemu"));
        assert!(!ask_with_cache(&missing, Some(&cache)).takes_rom());
    }

    #[test]
    fn a_kept_answer_not_ours_or_garbled_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let entry = dir.path().join("e");
        std::fs::write(&entry, "rom=maybe\n").expect("write");
        assert_eq!(read_entry(&entry), None);
        std::fs::write(&entry, "rom=0\n").expect("write");
        assert_eq!(read_entry(&entry), Some(false));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&entry, &link).expect("symlink");
        assert_eq!(read_entry(&link), None, "a link is not followed");
    }
}
