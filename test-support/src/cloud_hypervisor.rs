//! The cloud-hypervisor binaries the cloud-hypervisor tests run, found or
//! built by the tests themselves, so that `cargo test --workspace` alone
//! runs them (the README's one test command).
//!
//! Where `CLOUD_HYPERVISOR` names a binary (an operator's own build, or
//! `eval "$(scripts/build-cloud-hypervisor --print-env)"`), that one is
//! used, with `CH_REMOTE` and `CH_OFFLOAD_DAEMON` beside it. Otherwise the
//! first test that asks runs `scripts/build-cloud-hypervisor --print-env`
//! once per test binary: it builds cloud-hypervisor from the source beside
//! the checkout into a cache outside it (minutes, once per machine; its
//! progress goes to stderr) and later calls only print the cached paths.
//! A build that fails is a skip naming why, and CI fails on any skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// cloud-hypervisor, ch-remote and the offload daemon of one build.
#[derive(Debug, Clone)]
pub struct ChBinaries {
    /// `cloud-hypervisor`.
    pub cloud_hypervisor: PathBuf,
    /// `ch-remote`.
    pub ch_remote: PathBuf,
    /// cloud-hypervisor's reference `offload_daemon`.
    pub offload_daemon: PathBuf,
}

/// Why no cloud-hypervisor is at hand.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ChMissing {
    /// `CLOUD_HYPERVISOR` names something that is not a program.
    #[error("CLOUD_HYPERVISOR={0} is not an executable file")]
    NotAProgram(String),
    /// The project's build script failed or could not run.
    #[error("scripts/build-cloud-hypervisor failed ({0}); its log is above")]
    BuildFailed(String),
    /// The script ran but printed no `CLOUD_HYPERVISOR`.
    #[error("scripts/build-cloud-hypervisor printed no CLOUD_HYPERVISOR: {0:?}")]
    NoPath(String),
}

/// The binaries, found or built once per process.
///
/// # Errors
///
/// Why there are none (see [`ChMissing`]); the caller records a skip.
pub fn binaries() -> Result<&'static ChBinaries, ChMissing> {
    static FOUND: OnceLock<Result<ChBinaries, ChMissing>> = OnceLock::new();
    FOUND
        .get_or_init(find_or_build)
        .as_ref()
        .map_err(Clone::clone)
}

/// [`binaries`], or `None` after recording the skip.
pub fn binaries_or_skip() -> Option<&'static ChBinaries> {
    match binaries() {
        Ok(b) => Some(b),
        Err(why) => {
            crate::skip!("{why}");
            None
        }
    }
}

fn find_or_build() -> Result<ChBinaries, ChMissing> {
    let named = std::env::var_os("CLOUD_HYPERVISOR").filter(|v| !v.is_empty());
    let (ch, remote, offload) = match named {
        Some(ch) => (
            PathBuf::from(ch),
            std::env::var_os("CH_REMOTE").map(PathBuf::from),
            std::env::var_os("CH_OFFLOAD_DAEMON").map(PathBuf::from),
        ),
        None => build()?,
    };
    if !is_program(&ch) {
        return Err(ChMissing::NotAProgram(ch.display().to_string()));
    }
    let beside = |name: &str| ch.with_file_name(name);
    Ok(ChBinaries {
        ch_remote: remote.unwrap_or_else(|| beside("ch-remote")),
        offload_daemon: offload.unwrap_or_else(|| beside("offload_daemon")),
        cloud_hypervisor: ch,
    })
}

type Paths = (PathBuf, Option<PathBuf>, Option<PathBuf>);

fn build() -> Result<Paths, ChMissing> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/build-cloud-hypervisor");
    eprintln!(
        "test-support: CLOUD_HYPERVISOR is not set: {} --print-env (a first build takes minutes)",
        script.display()
    );
    let out = Command::new(&script)
        .arg("--print-env")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| ChMissing::BuildFailed(format!("{}: {e}", script.display())))?;
    if !out.status.success() {
        return Err(ChMissing::BuildFailed(out.status.to_string()));
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let var = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            .map(|v| PathBuf::from(v.trim().trim_matches('\'').trim_matches('"')))
    };
    let ch = var("CLOUD_HYPERVISOR").ok_or_else(|| ChMissing::NoPath(text.clone()))?;
    Ok((ch, var("CH_REMOTE"), var("CH_OFFLOAD_DAEMON")))
}

fn is_program(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| {
        m.is_file() && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
    })
}
