//! A side's launches: the untimed warm-up, then N timed ones, K at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};

use super::error::{launch_error, ChurnError};
use super::plan::{Plan, Side};
use super::report::{page_key, LaunchSample};
use crate::harness::rounds;

/// The untimed first launch of a side.
pub(super) fn warm_up(
    plan: &Plan,
    side: Side,
    progress: &mut dyn FnMut(&str),
) -> Result<LaunchSample, ChurnError> {
    let what = format!("one untimed {} launch", side.name());
    let warm = rounds::warm_up(progress, &what, || {
        plan.launch(side)
            .map_err(launch_error(side, "warm-up".into()))
    })?;
    progress(&format!(
        "{} warm-up launch: {:.1} ms{}",
        side.name(),
        warm.ms,
        pages_text(&warm.page_sizes)
    ));
    Ok(warm)
}

/// `vms` timed launches, `parallel` at once, in start order. Every guest
/// must end normally.
pub(super) fn churn(
    plan: &Plan,
    side: Side,
    vms: usize,
    parallel: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<LaunchSample>, ChurnError> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let results: Mutex<Vec<Option<Result<LaunchSample, String>>>> =
        Mutex::new((0..vms).map(|_| None).collect());
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::scope(|s| {
        for _ in 0..parallel.min(vms) {
            let tx = tx.clone();
            let (next, stop, results) = (&next, &stop, &results);
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= vms || stop.load(Ordering::Relaxed) {
                    return;
                }
                let r = plan.launch(side);
                let line = match &r {
                    Ok(x) => format!(
                        "{} launch {}/{vms}: {:.1} ms{}{}",
                        side.name(),
                        i + 1,
                        x.ms,
                        pages_text(&x.page_sizes),
                        if x.stale { ", STALE READ" } else { "" }
                    ),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        format!("{} launch {}/{vms} failed: {e}", side.name(), i + 1)
                    }
                };
                let _ = tx.send(line);
                if let Ok(mut g) = results.lock() {
                    g[i] = Some(r);
                }
            });
        }
        drop(tx);
        for line in rx {
            progress(&line);
        }
    });
    let results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out = Vec::with_capacity(vms);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok(x)) => out.push(x),
            Some(Err(why)) => return Err(launch_error(side, (i + 1).to_string())(why)),
            None => {}
        }
    }
    if out.len() != vms {
        return Err(launch_error(side, "?".into())(
            "stopped after another launch failed".into(),
        ));
    }
    Ok(out)
}

pub(super) fn pages_text(sizes: &[u64]) -> String {
    if sizes.is_empty() {
        String::new()
    } else {
        format!(" on {} pages", page_key(sizes))
    }
}
