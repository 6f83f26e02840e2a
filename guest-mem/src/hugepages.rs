//! Reserving huge pages through `scripts/hugepages`.
//!
//! Operators, CI and the tests all reserve huge pages with the same script, so
//! there is one code path that writes `nr_hugepages`, compacts memory when the
//! kernel falls short, and reports what it really got. This module runs it and
//! reads its JSON report. The script is found through `HUGEMEM_HUGEPAGES_SCRIPT`
//! or, in a source checkout, next to this crate.

use std::path::PathBuf;
use std::process::Command;

use crate::mapping::PageSize;

/// Errors reserving huge pages.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// Base pages need no reservation.
    #[error("4 KiB pages are not reserved")]
    NotHuge,
    /// The script is not where we looked.
    #[error("scripts/hugepages not found at {0} (set HUGEMEM_HUGEPAGES_SCRIPT)")]
    ScriptMissing(PathBuf),
    /// The script could not be started.
    #[error("cannot run {path}")]
    Spawn {
        /// Script path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The script failed (not root, no such node, ...); its message is kept.
    #[error("scripts/hugepages failed: {0}")]
    Script(String),
    /// The script's report was not what we expect.
    #[error("cannot read the report of scripts/hugepages: {0}")]
    Report(String),
}

/// What the kernel gave for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveReport {
    /// Page size.
    pub page_size: PageSize,
    /// Pages asked for.
    pub requested: u64,
    /// Pool size afterwards.
    pub total: u64,
    /// Pages free and not reserved by another mapping afterwards.
    pub free: u64,
    /// True when the request was met in full.
    pub met: bool,
}

fn script_path() -> PathBuf {
    std::env::var_os("HUGEMEM_HUGEPAGES_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/hugepages"))
        })
}

fn size_flag(page_size: PageSize) -> Result<&'static str, ReserveError> {
    match page_size {
        PageSize::Huge1G => Ok("--1g"),
        PageSize::Huge2M => Ok("--2m"),
        PageSize::Base4K => Err(ReserveError::NotHuge),
    }
}

fn run_script(
    page_size: PageSize,
    count: u64,
    mode: &str,
    node: Option<u32>,
) -> Result<ReserveReport, ReserveError> {
    let path = script_path();
    if !path.exists() {
        return Err(ReserveError::ScriptMissing(path));
    }
    let mut cmd = Command::new(&path);
    cmd.args([
        size_flag(page_size)?,
        &count.to_string(),
        mode,
        "--no-mount",
        "--json",
    ]);
    if let Some(node) = node {
        cmd.args(["--node", &node.to_string()]);
    }
    let out = cmd.output().map_err(|source| ReserveError::Spawn {
        path: path.clone(),
        source,
    })?;
    // Exit 3 = fewer pages than asked: still a valid report.
    if !out.status.success() && out.status.code() != Some(3) {
        return Err(ReserveError::Script(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    parse_report(&out.stdout, page_size)
}

fn parse_report(stdout: &[u8], page_size: PageSize) -> Result<ReserveReport, ReserveError> {
    let bad = |what: &str| ReserveError::Report(what.to_string());
    let value: serde_json::Value =
        serde_json::from_slice(stdout).map_err(|e| ReserveError::Report(e.to_string()))?;
    let pool = value
        .get("pools")
        .and_then(|p| p.as_array())
        .and_then(|p| p.first())
        .ok_or_else(|| bad("no pool in report"))?;
    let field = |name: &str| {
        pool.get(name)
            .and_then(|v| v.as_u64())
            .ok_or_else(|| bad(name))
    };
    Ok(ReserveReport {
        page_size,
        requested: field("requested")?,
        total: field("total")?,
        free: field("available")?,
        met: pool
            .get("met")
            .and_then(|v| v.as_bool())
            .ok_or_else(|| bad("met"))?,
    })
}

/// Makes sure at least `pages` pages of `page_size` are free (on `node`, or
/// host-wide), growing the pool when needed; the pool stays as it is after.
/// A report with `met == false` says the kernel gave fewer.
pub fn ensure_free(
    page_size: PageSize,
    pages: u64,
    node: Option<u32>,
) -> Result<ReserveReport, ReserveError> {
    run_script(page_size, pages, "--free", node)
}

/// Host-wide pool size of `page_size` from sysfs.
fn host_pool_total(page_size: PageSize) -> Option<u64> {
    let kb = page_size.bytes() / 1024;
    std::fs::read_to_string(format!(
        "/sys/kernel/mm/hugepages/hugepages-{kb}kB/nr_hugepages"
    ))
    .ok()?
    .trim()
    .parse()
    .ok()
}

/// Huge pages reserved for the lifetime of this value: the host pool is grown
/// so that `pages` are free, and set back to its earlier size on drop.
#[derive(Debug)]
pub struct Reservation {
    report: ReserveReport,
    previous_total: Option<u64>,
}

impl Reservation {
    /// Reserves `pages` free pages of `page_size` host-wide for this value's lifetime.
    pub fn for_run(page_size: PageSize, pages: u64) -> Result<Self, ReserveError> {
        let previous_total = host_pool_total(page_size);
        let report = ensure_free(page_size, pages, None)?;
        Ok(Self {
            report,
            previous_total,
        })
    }

    /// What the kernel gave.
    pub fn report(&self) -> ReserveReport {
        self.report
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let Some(previous) = self.previous_total else {
            return;
        };
        if Some(previous) == host_pool_total(self.report.page_size) {
            return;
        }
        if let Err(e) = run_script(self.report.page_size, previous, "--exact", None) {
            tracing::warn!(error = %e, "could not give reserved huge pages back");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_script_report() {
        let json = br#"{"pools": [{"size": "2M", "page_kb": 2048, "node": null, "mode": "free", "requested": 4, "total": 6, "free": 4, "available": 4, "surplus": 0, "met": true}], "mounts": [], "all_met": true}"#;
        let r = parse_report(json, PageSize::Huge2M).expect("parse");
        assert_eq!((r.requested, r.total, r.free, r.met), (4, 6, 4, true));
        assert!(parse_report(b"{}", PageSize::Huge2M).is_err());
        assert!(parse_report(b"not json", PageSize::Huge2M).is_err());
    }

    #[test]
    fn base_pages_are_not_reserved() {
        assert!(matches!(
            ensure_free(PageSize::Base4K, 1, None),
            Err(ReserveError::NotHuge)
        ));
    }

    #[test]
    fn reserves_2m_pages_through_the_script() {
        match ensure_free(PageSize::Huge2M, 2, None) {
            Ok(r) => {
                assert!(r.met, "kernel gave fewer 2 MiB pages than asked: {r:?}");
                assert!(r.free >= 2);
            }
            Err(ReserveError::Script(msg)) if msg.contains("root") => {
                test_support::skip!("reserving huge pages needs root: {msg}");
            }
            Err(e) => panic!("reserve failed: {e}"),
        }
    }
}
