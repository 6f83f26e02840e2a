//! The cloud-hypervisor a launch, update, park or restore would run: which
//! one (`CLOUD_HYPERVISOR`, as `scripts/build-cloud-hypervisor --print-env`
//! sets it, else `cloud-hypervisor` on `PATH`), what its `--version` says
//! (release, migration protocol versions), and whether its local migration
//! and offload work with hugemem on this host.
//!
//! "Work" is decided without running a migration, and the item says how:
//! the migration protocol versions it lists against the one hugemem speaks
//! ([`ch_migration::version`]); the commit it was built from (in a git
//! build's version, `v53.0-246-gae44c2971`, or in the name of the build
//! script's cache entry it runs from); and, on software KVM (`kvm_pvm`),
//! whether it is the build script's patched build, since an unpatched one
//! fails every local migration there (docs/operations.md, "Which
//! cloud-hypervisor"). The patch changes nothing `--version` or `--help`
//! shows, so the cache entry is the only sign of it.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use ch_migration::version::{
    CLOUD_HYPERVISOR_COMMIT, CLOUD_HYPERVISOR_RELEASE, NEWER_EXPECTS, PROTOCOL_VERSION, SPOKEN,
};

use super::report::Item;

/// The item naming the binary.
const NAME: &str = "cloud-hypervisor";
/// The item saying whether local migration and offload work.
const MIGRATION: &str = "ch-migration";
/// The fix that gives the build hugemem's tests run.
const BUILD_FIX: &str = "in a hugemem checkout: eval \"$(scripts/build-cloud-hypervisor --print-env)\" (the patched build of the commit hugemem speaks; docs/operations.md, \"Which cloud-hypervisor\")";

/// Where the binary was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The executable.
    pub path: PathBuf,
    /// `CLOUD_HYPERVISOR` named it (else `PATH`).
    pub from_env: bool,
}

/// What `cloud-hypervisor --version` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionInfo {
    /// The release (`v54.0.0`, or a git build's `v53.0-246-gae44c2971`).
    pub release: String,
    /// The migration protocol versions it lists; `None`: it lists none (a
    /// release older than protocol versioning).
    pub protocols: Option<Vec<u16>>,
}

/// The host's KVM, as far as local migration cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kvm {
    /// Software KVM (`kvm_pvm`): needs the patched build.
    Software,
    /// `kvm_intel` or `kvm_amd`.
    Hardware(&'static str),
    /// No KVM module loaded.
    None,
}

/// The binary `CLOUD_HYPERVISOR` names, else the first executable
/// `cloud-hypervisor` on `path_var`.
pub fn find(env_value: Option<OsString>, path_var: Option<OsString>) -> Option<Found> {
    if let Some(path) = env_value.filter(|v| !v.is_empty()) {
        return Some(Found {
            path: PathBuf::from(path),
            from_env: true,
        });
    }
    std::env::split_paths(&path_var?)
        .map(|dir| dir.join(NAME))
        .find(|p| is_executable(p))
        .map(|path| Found {
            path,
            from_env: false,
        })
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Parses `cloud-hypervisor --version`: `cloud-hypervisor vX` on the first
/// line, then `Migration Protocol Versions: 0, 1` where it has them.
pub fn parse_version(out: &str) -> Option<VersionInfo> {
    let mut lines = out.lines();
    let release = lines
        .next()?
        .strip_prefix("cloud-hypervisor ")?
        .trim()
        .to_owned();
    if release.is_empty() {
        return None;
    }
    let protocols = out
        .lines()
        .find_map(|l| l.strip_prefix("Migration Protocol Versions:"))
        .map(|list| {
            list.split(',')
                .filter_map(|v| v.trim().parse().ok())
                .collect()
        });
    Some(VersionInfo { release, protocols })
}

/// The commit a git build's release names (`v53.0-246-gae44c2971` →
/// `ae44c2971`).
fn commit_in_release(release: &str) -> Option<&str> {
    let (_, hash) = release.rsplit_once("-g")?;
    let hash = hash.strip_suffix("-dirty").unwrap_or(hash);
    (hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit())).then_some(hash)
}

/// The build script's cache entry the binary runs from
/// (`…/ae44c2971-58ee63afa87fa644/cloud-hypervisor`: the commit, then the
/// hash of the sources, the patch and the recipe), as (entry, commit).
pub fn build_entry(path: &Path) -> Option<(String, String)> {
    let entry = path.parent()?.file_name()?.to_str()?;
    let (commit, key) = entry.split_once('-')?;
    let hex = |s: &str, n: std::ops::RangeInclusive<usize>| {
        n.contains(&s.len()) && s.chars().all(|c| c.is_ascii_hexdigit())
    };
    (hex(commit, 7..=40) && hex(key, 16..=16)).then(|| (entry.to_owned(), commit.to_owned()))
}

/// Two abbreviations of one commit.
fn same_commit(a: &str, b: &str) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// The release's major version (`v54.0.0` → 54).
fn major(release: &str) -> Option<u32> {
    let digits: String = release
        .trim_start_matches('v')
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// The host's KVM module, from `<sys>/module`.
pub fn kvm_kind(sys: &Path) -> Kvm {
    let loaded = |m: &str| sys.join("module").join(m).exists();
    if loaded("kvm_pvm") {
        Kvm::Software
    } else if loaded("kvm_intel") {
        Kvm::Hardware("kvm_intel")
    } else if loaded("kvm_amd") {
        Kvm::Hardware("kvm_amd")
    } else {
        Kvm::None
    }
}

/// The two items: which cloud-hypervisor (`found`, from
/// `CheckInputs::cloud_hypervisor`), and whether its local migration and
/// offload work with hugemem here (the KVM module read under `sys`).
pub fn items(found: Option<&Found>, sys: &Path) -> Vec<Item> {
    let Some(found) = found else {
        return vec![Item::skip(
            NAME,
            "no cloud-hypervisor: CLOUD_HYPERVISOR is unset and none is on PATH (hugemem launch, update, park and restore of cloud-hypervisor VMs need one)",
            format!("install cloud-hypervisor, or {BUILD_FIX}"),
        )];
    };
    let out = match Command::new(&found.path).arg("--version").output() {
        Ok(out) if out.status.success() => out,
        Ok(out) => {
            return vec![not_cloud_hypervisor(
                found,
                &format!("--version exited with {}", out.status),
            )]
        }
        Err(e) => return vec![not_cloud_hypervisor(found, &e.to_string())],
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(version) = parse_version(&text) else {
        let first = text.lines().next().unwrap_or("").to_owned();
        return vec![not_cloud_hypervisor(
            found,
            &format!("--version said {first:?}"),
        )];
    };
    vec![
        identity(found, &version),
        migration(found, &version, kvm_kind(sys)),
    ]
}

fn not_cloud_hypervisor(found: &Found, why: &str) -> Item {
    Item::fail(
        NAME,
        format!("{}: {why}: is it cloud-hypervisor?", describe(found)),
        format!("point CLOUD_HYPERVISOR at a cloud-hypervisor binary, or {BUILD_FIX}"),
    )
}

fn describe(found: &Found) -> String {
    let from = if found.from_env {
        "CLOUD_HYPERVISOR"
    } else {
        "PATH"
    };
    format!("{} (from {from})", found.path.display())
}

fn protocols_text(version: &VersionInfo) -> String {
    match &version.protocols {
        Some(list) => {
            let list: Vec<String> = list.iter().map(u16::to_string).collect();
            format!("migration protocol versions {}", list.join(", "))
        }
        None => "no migration protocol versions listed".to_owned(),
    }
}

/// The commit the binary was built from, and how that is known.
fn commit_of(found: &Found, version: &VersionInfo) -> Option<(String, String)> {
    if let Some(hash) = commit_in_release(&version.release) {
        return Some((hash.to_owned(), "its version".to_owned()));
    }
    build_entry(&found.path).map(|(entry, commit)| {
        (
            commit,
            format!("scripts/build-cloud-hypervisor's cache entry {entry}"),
        )
    })
}

/// Names the binary: where it came from, its release, protocols, commit.
pub fn identity(found: &Found, version: &VersionInfo) -> Item {
    let commit = match commit_of(found, version) {
        Some((commit, how)) => format!(", commit {commit} (from {how})"),
        None => String::new(),
    };
    Item::pass(
        NAME,
        format!(
            "{}: cloud-hypervisor {}, {}{commit}",
            describe(found),
            version.release,
            protocols_text(version)
        ),
    )
}

/// Whether local migration and offload work with hugemem, and how that
/// was decided.
pub fn migration(found: &Found, version: &VersionInfo, kvm: Kvm) -> Item {
    let speaks = version
        .protocols
        .as_ref()
        .is_some_and(|l| l.contains(&PROTOCOL_VERSION));
    if version.protocols.is_some() && !speaks {
        return Item::fail(
            MIGRATION,
            format!(
                "cloud-hypervisor {} lists {}, not {PROTOCOL_VERSION}: it refuses hugemem's park, restore and update; {SPOKEN}; {NEWER_EXPECTS}",
                version.release,
                protocols_text(version)
            ),
            format!("use cloud-hypervisor {CLOUD_HYPERVISOR_RELEASE} (commit {CLOUD_HYPERVISOR_COMMIT}): {BUILD_FIX}"),
        );
    }
    let commit = commit_of(found, version);
    let matches = commit
        .as_ref()
        .is_some_and(|(c, _)| same_commit(c, CLOUD_HYPERVISOR_COMMIT));
    if !matches {
        let age = match major(&version.release).zip(major(CLOUD_HYPERVISOR_RELEASE)) {
            Some((m, ours)) if m > ours => format!("newer than {CLOUD_HYPERVISOR_RELEASE}: {NEWER_EXPECTS}, which hugemem does not send yet"),
            Some((m, ours)) if m < ours => format!("older than {CLOUD_HYPERVISOR_RELEASE}: its local migration may lack what hugemem's offload needs (CompletePaused, PageFault)"),
            _ => format!("a build hugemem was not tested with ({}): releases after commit {CLOUD_HYPERVISOR_COMMIT} may use {}", commit.map_or_else(|| "commit unknown".to_owned(), |(c, how)| format!("commit {c}, from {how}")), ch_migration::version::NEWER_MEMORY_FDS_OPTION),
        };
        return Item::warn(
            MIGRATION,
            format!(
                "cloud-hypervisor {}, {}: {age}; {SPOKEN}; decided by its version, no migration was run",
                version.release,
                protocols_text(version)
            ),
            BUILD_FIX,
        );
    }
    let (commit, how) = commit.unwrap_or_default();
    let patched = build_entry(&found.path).is_some();
    match kvm {
        Kvm::Software if !patched => Item::warn(
            MIGRATION,
            format!(
                "this host's KVM is software (kvm_pvm): an unpatched cloud-hypervisor fails every local migration and offload snapshot there (KVM_GET_NESTED_STATE answers EINVAL; seccomp kills the migration thread on getcwd), and {} runs from no build of scripts/build-cloud-hypervisor, which applies the patch; decided by where it runs from, no migration was run",
                found.path.display()
            ),
            BUILD_FIX,
        ),
        Kvm::Software => Item::pass(
            MIGRATION,
            format!(
                "local migration and offload work: protocol version {PROTOCOL_VERSION} at commit {commit} as hugemem speaks (from {how}), and the build applies software-kvm-local-migration.patch, which this host's software KVM (kvm_pvm) needs; decided by its version and build, no migration was run"
            ),
        ),
        Kvm::Hardware(module) => Item::pass(
            MIGRATION,
            format!(
                "local migration and offload work: protocol version {PROTOCOL_VERSION} at commit {commit} as hugemem speaks (from {how}); hardware KVM ({module}) needs no patch; decided by its version and the KVM module, no migration was run"
            ),
        ),
        Kvm::None => Item::skip(
            MIGRATION,
            format!("protocol version {PROTOCOL_VERSION} at commit {commit} as hugemem speaks (from {how}), but no KVM module is loaded: no VM runs here"),
            "load kvm_intel or kvm_amd (modprobe)",
        ),
    }
}

#[cfg(test)]
#[path = "cloud_hypervisor_tests.rs"]
mod tests;
