//! A second QEMU, 8.2 or later, for the tests of what such a QEMU does
//! differently from Debian 12's 7.2 (a shared clone's template opened
//! read-only, `readonly=on,rom=off`).
//!
//! Where `HUGEMEM_QEMU_NEW` names a binary, that one is used. Otherwise
//! the first test that asks runs `scripts/fetch-qemu-backports --print-env
//! --cached` once per test binary: it prints the entry that script put in
//! its cache (QEMU from Debian's bookworm-backports, beside the system's
//! QEMU) and never fetches, so a test never reaches the network. No entry
//! is a skip naming the command that fetches it; `.ci/run` fetches it
//! first, and CI fails on any skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The environment variable that names the newer QEMU.
pub const ENV: &str = "HUGEMEM_QEMU_NEW";

/// Why no newer QEMU is at hand.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NewQemuMissing {
    /// `HUGEMEM_QEMU_NEW` names something that is not a program.
    #[error("{ENV}={0} is not an executable file")]
    NotAProgram(String),
    /// The cache has no entry (exit 3 of the script's `--cached`).
    #[error(
        "no QEMU 8.2 or later fetched: run scripts/fetch-qemu-backports (Debian 12's bookworm-backports) or set {ENV}"
    )]
    NotFetched,
    /// The script failed or could not run.
    #[error("scripts/fetch-qemu-backports --cached failed ({0})")]
    ScriptFailed(String),
}

/// The newer QEMU's `qemu-system-x86_64`, found once per process.
///
/// # Errors
///
/// Why there is none (see [`NewQemuMissing`]); the caller records a skip.
pub fn qemu() -> Result<&'static Path, NewQemuMissing> {
    static FOUND: OnceLock<Result<PathBuf, NewQemuMissing>> = OnceLock::new();
    FOUND
        .get_or_init(find)
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(Clone::clone)
}

/// [`qemu`], or `None` after recording the skip.
pub fn qemu_or_skip() -> Option<&'static Path> {
    match qemu() {
        Ok(q) => Some(q),
        Err(why) => {
            crate::skip!("{why}");
            None
        }
    }
}

fn find() -> Result<PathBuf, NewQemuMissing> {
    let path = match std::env::var_os(ENV).filter(|v| !v.is_empty()) {
        Some(named) => PathBuf::from(named),
        None => cached()?,
    };
    let runs = std::fs::metadata(&path).is_ok_and(|m| {
        m.is_file() && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
    });
    if runs {
        Ok(path)
    } else {
        Err(NewQemuMissing::NotAProgram(path.display().to_string()))
    }
}

/// The cache's entry, as the script prints it; never a fetch.
fn cached() -> Result<PathBuf, NewQemuMissing> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-qemu-backports");
    let out = Command::new(&script)
        .args(["--cached", "--print-env"])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| NewQemuMissing::ScriptFailed(format!("{}: {e}", script.display())))?;
    match out.status.code() {
        Some(0) => {}
        Some(3) => return Err(NewQemuMissing::NotFetched),
        _ => return Err(NewQemuMissing::ScriptFailed(out.status.to_string())),
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("export {ENV}=")))
        .map(|v| PathBuf::from(v.trim().trim_matches('\'').trim_matches('"')))
        .ok_or_else(|| NewQemuMissing::ScriptFailed(format!("it printed no {ENV}: {text:?}")))
}
