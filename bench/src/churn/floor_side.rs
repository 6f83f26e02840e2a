//! The floor side of a churn: the kernel-zeroing limit, measured with the
//! floor's memory, then the same VMM and guest as hugemem's side on
//! resident memfds handed over as hugemem's fds are, no daemon.

use std::time::Duration;

use guest_mem::size::format_size;

use super::error::ChurnError;
use super::launches::{churn, warm_up};
use super::options::ChurnConfig;
use super::plan::{Plan, Side};
use super::process::chain;
use super::report::LaunchSample;
use crate::floor::{zeroing_limit, FloorError, FloorPool};

/// Timed populates of a fresh memfd for the limit, after an untimed one.
const ZEROING_REPS: usize = 3;

/// What the floor side gave.
pub(super) enum FloorOutcome {
    /// Its launches and the limit's samples, ms.
    Ran {
        warm: LaunchSample,
        launches: Vec<LaunchSample>,
        zeroing_ms: Vec<f64>,
    },
    /// Why it did not run (`--socket` only).
    Skipped(String),
}

/// Runs the floor side: the limit, then `parallel` memfds populated, one
/// untimed launch and `vms` timed ones. Every memfd is freed before this
/// returns (at exact fit the daemon that comes next needs the pages).
/// With `--socket` a floor whose memory cannot be had (the live daemon's
/// pool may hold the pages) is skipped with the reason; without, it fails
/// the run.
pub(super) fn floor_side(
    plan: &mut Plan,
    cfg: &ChurnConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<FloorOutcome, ChurnError> {
    let (memory, zeroing_ms) = match floor_memory(plan, cfg.parallel, progress) {
        Ok(x) => x,
        Err(e) if cfg.socket.is_some() => {
            let why = format!(
                "{} x {} of {} pages could not be had for it ({}); with --socket the daemon's pool may hold them",
                cfg.parallel,
                format_size(plan.size),
                plan.baseline_page,
                chain(&e)
            );
            progress(&format!("floor skipped: {why}"));
            return Ok(FloorOutcome::Skipped(why));
        }
        Err(source) => {
            return Err(ChurnError::Floor {
                count: cfg.parallel,
                size: format_size(plan.size),
                page: plan.baseline_page.to_string(),
                source,
            })
        }
    };
    progress(&format!(
        "limit: the kernel zeroing {} on 1 thread (populate of a fresh memfd): {} ms",
        format_size(plan.size),
        zeroing_ms
            .iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    plan.floor = Some(memory);
    let result = warm_up(plan, Side::Floor, progress).and_then(|warm| {
        Ok((
            warm,
            churn(plan, Side::Floor, cfg.vms, cfg.parallel, progress)?,
        ))
    });
    plan.floor = None;
    let (warm, launches) = result?;
    Ok(FloorOutcome::Ran {
        warm,
        launches,
        zeroing_ms,
    })
}

/// The limit's samples, ms (one untimed populate of a fresh memfd first,
/// then [`ZEROING_REPS`] timed ones, each memfd freed before the next:
/// [`zeroing_limit`]), and `count` populated memfds for the launches.
fn floor_memory(
    plan: &Plan,
    count: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<(FloorPool, Vec<f64>), FloorError> {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let zeroing = zeroing_limit(plan.size, plan.baseline_page, ZEROING_REPS, progress)?;
    let memory = FloorPool::populated(count, plan.size, plan.baseline_page)?;
    Ok((memory, zeroing.into_iter().map(ms).collect()))
}
