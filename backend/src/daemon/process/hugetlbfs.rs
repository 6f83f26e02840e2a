//! The hugetlbfs mounts the daemon creates path-backed regions on, and the
//! region files an earlier daemon instance left behind on them.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tracing::warn;

use crate::daemon::config;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::process::error::{DaemonError, Result};

/// Page size of the hugetlbfs mount holding `dir`, if it is one.
fn hugetlbfs_page_size(dir: &Path) -> Option<guest_mem::PageSize> {
    let st = nix::sys::statfs::statfs(dir).ok()?;
    if st.filesystem_type() != nix::sys::statfs::HUGETLBFS_MAGIC {
        return None;
    }
    #[allow(clippy::useless_conversion)] // the field type differs between libcs
    let bytes = u64::try_from(i128::from(st.block_size())).ok()?;
    guest_mem::PageSize::from_bytes(bytes).filter(|p| p.is_huge())
}

/// Releases hugetlbfs files an earlier daemon instance left behind (it was
/// killed, or died). Region
/// files are named `hugemem-r<ID>.<PID>.<N>` (see `guest_mem`'s
/// `create_hugetlbfs_file`); a file whose `<PID>` is not a live process is
/// unlinked, never reused: its pages may hold a tenant's data and go back to
/// the kernel (which zeroes them) once no process still has the file open or
/// mapped. Files of a live pid (another daemon sharing the mount) are left
/// alone. Counted in STATS (`leftover_files_released`, `leftover_bytes_released`).
pub(crate) fn recover_leftovers(
    dirs: &[(guest_mem::PageSize, PathBuf)],
    metrics: &Metrics,
    inherited: &std::collections::HashSet<PathBuf>,
) {
    for (_, dir) in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = leftover_pid(&name.to_string_lossy()) else {
                continue;
            };
            // A region passed on (a takeover, systemd's fd store) keeps
            // its file, whoever created it.
            if inherited.contains(&entry.path()) {
                continue;
            }
            if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            let path = entry.path();
            let bytes = std::fs::symlink_metadata(&path).map_or(0, |m| m.blocks() * 512);
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    Metrics::add(&metrics.leftover_files_released, 1);
                    Metrics::add(&metrics.leftover_bytes_released, bytes);
                    warn!(path = %path.display(), pid, bytes, "released a region file left by an earlier daemon instance");
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "cannot release a region file left by an earlier daemon instance");
                }
            }
        }
    }
}

/// The pid in a region file name `hugemem-r<ID>.<PID>.<N>`, or `None`.
fn leftover_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("hugemem-r")?;
    let mut parts = rest.split('.');
    let (id, pid, n) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some()
        || id.is_empty()
        || n.is_empty()
        || !id.bytes().all(|b| b.is_ascii_digit())
        || !n.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    pid.parse().ok()
}

/// The hugetlbfs directory per page size: configured (checked) or the first
/// mount of that size in `/proc/mounts`.
pub(crate) fn hugetlbfs_dirs(
    cfg: &config::HugetlbfsConfig,
) -> Result<Vec<(guest_mem::PageSize, PathBuf)>> {
    use guest_mem::PageSize;
    let mounts: Vec<PathBuf> = std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, dir, kind) = (f.next()?, f.next()?, f.next()?);
            (kind == "hugetlbfs").then(|| PathBuf::from(dir.replace("\\040", " ")))
        })
        .collect();
    let mut out = Vec::new();
    for (size, key, key_size, configured) in [
        (PageSize::Huge2M, "dir_2m", "2M", &cfg.dir_2m),
        (PageSize::Huge1G, "dir_1g", "1G", &cfg.dir_1g),
    ] {
        match configured {
            Some(dir) if hugetlbfs_page_size(dir) == Some(size) => out.push((size, dir.clone())),
            Some(dir) => {
                return Err(DaemonError::Hugetlbfs {
                    key,
                    key_size,
                    path: dir.clone(),
                })
            }
            None => {
                if let Some(dir) = mounts.iter().find(|m| hugetlbfs_page_size(m) == Some(size)) {
                    out.push((size, dir.clone()));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftover_names_carry_the_pid() {
        assert_eq!(leftover_pid("hugemem-r12.4242.0"), Some(4242));
        assert_eq!(leftover_pid("hugemem-r12.4242"), None);
        assert_eq!(leftover_pid("hugemem-r12.4242.0.1"), None);
        assert_eq!(leftover_pid("other-r12.4242.0"), None);
        assert_eq!(leftover_pid("hugemem-rx.4242.0"), None);
    }
}
