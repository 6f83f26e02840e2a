//! The report's ratios and the optional plot.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use guest_mem::size::format_size;

use super::error::CompareError;
use super::results::{CompareReport, Figure};

impl CompareReport {
    /// A human-readable table.
    pub fn to_table(&self) -> String {
        use std::fmt::Write;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "hugemem bench compare: {} on {} pages, {} CPU(s), prealloc-threads={}, best / median of {}",
            format_size(self.size_bytes),
            self.page_size,
            self.cpus,
            self.prealloc_threads,
            self.reps
        );
        if let Some(n) = &self.note {
            let _ = writeln!(t, "  note: {n}");
        }
        let _ = writeln!(
            t,
            "  {:<48} {:>17} {:>17} {:>8} {:>8} {:>8}",
            "", "ready s", "power-off s", "GiB/s", "ready x", "off x"
        );
        let fig = |f: Option<Figure>| {
            f.map_or_else(
                || "-".to_string(),
                |f| format!("{:.3} / {:.3}", f.best, f.median),
            )
        };
        for v in &self.variants {
            if v.skipped {
                let _ = writeln!(
                    t,
                    "  {:<48} skipped: {}",
                    v.label,
                    v.note.as_deref().unwrap_or("")
                );
                continue;
            }
            let r = self.ratios.get(v.key);
            let _ = writeln!(
                t,
                "  {:<48} {:>17} {:>17} {:>8.2} {:>8} {:>8}",
                v.label,
                fig(v.ready_s),
                fig(v.poweroff_s),
                v.gib_per_s.unwrap_or(0.0),
                r.map_or("-".into(), |r| format!("{:.2}", r.ready)),
                r.map_or("-".into(), |r| format!("{:.2}", r.poweroff)),
            );
        }
        if let Some(s) = self.pool_scrub_s {
            let _ = writeln!(
                t,
                "  FREE -> pool clean (background scrub): {:.3} / {:.3} s",
                s.best, s.median
            );
        }
        let _ = writeln!(
            t,
            "  ratios: {} time / variant time (best of reps); above 1 = faster than the baseline",
            self.baseline
        );
        t
    }
}

/// `scripts/plot-compare`, compiled into the binary so that `--plot` works
/// from an installed `hugemem` with no source tree around.
const PLOT_SCRIPT: &str = include_str!("../../../scripts/plot-compare");

/// The plot script that runs: `HUGEMEM_PLOT_SCRIPT` when set (a developer's
/// edited copy), else the copy compiled in (`None`).
pub fn plot_script() -> Option<PathBuf> {
    std::env::var_os("HUGEMEM_PLOT_SCRIPT")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Runs the plot script with `args`: the one in `HUGEMEM_PLOT_SCRIPT`, or the
/// compiled-in copy written to a private temporary file and run with
/// `python3` (the script re-executes itself by path when it needs another
/// python, so it must be a file).
pub(super) fn run_plot_script(
    args: &[&std::ffi::OsStr],
) -> Result<std::process::Output, CompareError> {
    let (script, temp) = match plot_script() {
        Some(path) => (path, None),
        None => {
            let path = std::env::temp_dir()
                .join(format!("hugemem-plot-compare-{}.py", std::process::id()));
            std::fs::write(&path, PLOT_SCRIPT).map_err(|e| CompareError::Plot {
                script: path.clone(),
                why: e.to_string(),
            })?;
            (path.clone(), Some(path))
        }
    };
    let mut cmd = match &temp {
        Some(path) => {
            let mut c = Command::new("python3");
            c.arg(path);
            c
        }
        None => Command::new(&script),
    };
    let out = cmd.args(args).stdin(Stdio::null()).output();
    if let Some(path) = temp {
        let _ = std::fs::remove_file(path);
    }
    out.map_err(|e| CompareError::Plot {
        script,
        why: e.to_string(),
    })
}

/// Renders `report` to `png` with `scripts/plot-compare` (python3 with
/// matplotlib; see the script).
///
/// # Errors
///
/// [`CompareError::Plot`] when the report cannot be written or the script
/// fails.
pub fn plot(report: &CompareReport, png: &Path) -> Result<(), CompareError> {
    let script = plot_script().unwrap_or_else(|| PathBuf::from("scripts/plot-compare (built in)"));
    let fail = |why: String| CompareError::Plot {
        script: script.clone(),
        why,
    };
    let json = serde_json::to_vec(report).map_err(|e| fail(e.to_string()))?;
    let path = std::env::temp_dir().join(format!("hugemem-compare-{}.json", std::process::id()));
    std::fs::write(&path, json).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    let out = run_plot_script(&[path.as_os_str(), png.as_os_str()]);
    let _ = std::fs::remove_file(&path);
    let out = out?;
    if !out.status.success() {
        return Err(fail(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}
