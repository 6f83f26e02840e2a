//! The alloc bench end to end: the pages, the warm-up, the repetitions in
//! alternating order, the scaling run, and the report.

use backend::proto::AllocPart;
use guest_mem::size::format_size;
use guest_mem::PageSize;
use numa::Topology;

use super::config::AllocBenchConfig;
use super::daemon::through_daemon;
use super::error::AllocBenchError;
use super::handout::HandOut;
use super::limits::{limits, memory_bandwidth, scaling_counts, AllocLimits};
use super::populate::{
    cloud_hypervisor_style, cloud_hypervisor_threads, fresh_eager, fresh_eager_workers, node_parts,
    reserve,
};
use super::report::{AllocBenchReport, AllocMedians, AllocRatios, AllocSamples, ScalingPoint};
use crate::harness::rounds;
use crate::stats::{best, median, ratio};

/// Bytes in a GiB, for per-GiB figures.
const GIB: f64 = (1u64 << 30) as f64;

/// Runs the benchmark. `progress` gets one line per step.
///
/// # Errors
///
/// See [`AllocBenchError`].
pub fn run(
    cfg: &AllocBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<AllocBenchReport, AllocBenchError> {
    if cfg.size == 0 || cfg.reps == 0 || !cfg.size.is_multiple_of(2 << 20) {
        return Err(AllocBenchError::Size);
    }
    if cfg.threads.contains(&0) {
        return Err(AllocBenchError::Threads);
    }
    let topology = Topology::detect()?;
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let mut notes = Vec::new();
    let (page, size, _reservation) = reserve(cfg, &mut notes)?;
    let note = (!notes.is_empty()).then(|| notes.join("; "));
    let parts = node_parts(&topology, size, page.bytes());
    let ch_threads = cloud_hypervisor_threads(cpus, size, page.bytes());
    progress(&format!(
        "{} on {page} pages, {} node(s), cloud-hypervisor style with {ch_threads} thread(s){}",
        format_size(size),
        parts.len(),
        note.as_deref()
            .map(|n| format!(" (note: {n})"))
            .unwrap_or_default()
    ));

    rounds::warm_up(progress, "populating and freeing the pages once", || {
        cloud_hypervisor_style(size, page, ch_threads)
    })?;

    let memory = Memory {
        topology: &topology,
        parts: &parts,
        page,
        size,
    };
    let samples = repetitions(&memory, cfg.reps, ch_threads, progress)?;
    let counts = scaling_counts(&cfg.threads, cpus, ch_threads);
    let scaling = scaling(&memory, cfg.reps, &counts, progress)?;
    progress("memory bandwidth: clearing populated pages with all CPUs");
    let bandwidth = memory_bandwidth(&topology, size, page, cpus, cfg.reps)?;
    let best_with = |threads: usize| {
        scaling
            .iter()
            .find(|p| p.threads == threads)
            .map_or(0.0, |p| p.best_s)
    };
    let limits = limits(best_with, size, cpus, ch_threads, bandwidth);
    progress(&format!(
        "limits: kernel zeroing {:.2} GB/s on 1 thread, {:.2} GB/s on {} CPUs; memory bandwidth ({}) {:.2} GB/s",
        limits.kernel_zeroing_touch_threads_gbps,
        limits.kernel_zeroing_all_cpus_gbps,
        limits.all_cpus,
        limits.memory_bandwidth_kernel,
        limits.memory_bandwidth_gbps
    ));
    Ok(report(
        cfg,
        &memory,
        Figures {
            note,
            cpus,
            ch_threads,
            samples,
            scaling,
            limits,
        },
    ))
}

/// The memory every variant gets ready: `size` bytes of `page` pages,
/// split over the nodes as `parts`.
struct Memory<'a> {
    topology: &'a Topology,
    parts: &'a [AllocPart],
    page: PageSize,
    size: u64,
}

/// `reps` rounds of all four variants, the daemon-less ones and the
/// daemon's in turn first.
fn repetitions(
    m: &Memory<'_>,
    reps: usize,
    ch_threads: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<AllocSamples, AllocBenchError> {
    let mut s = AllocSamples::default();
    rounds::each(reps, |round| {
        progress(&format!("repetition {round}"));
        let daemonless = |s: &mut AllocSamples| -> Result<(), AllocBenchError> {
            s.fresh_eager_s
                .push(fresh_eager(m.topology, m.parts, m.page)?);
            s.cloud_hypervisor_style_s
                .push(cloud_hypervisor_style(m.size, m.page, ch_threads)?);
            Ok(())
        };
        let daemon = |s: &mut AllocSamples| -> Result<(), AllocBenchError> {
            let d = through_daemon(m.size, m.parts, m.page)?;
            s.fresh_eager_daemon_s.push(d.fresh_s);
            s.free_to_clean_s.push(d.clean.seconds);
            s.free_to_clean_cpu_s.push(d.clean.cpu_seconds);
            s.pooled_eager_s.push(d.pooled.alloc_s);
            s.hand_outs.pooled_eager.push(d.pooled);
            s.hand_outs.pooled_resident.push(d.resident);
            s.hand_outs.pooled_holes.push(d.holes);
            Ok(())
        };
        round.both(&mut s, daemonless, daemon)?;
        let (rep, h) = (round.index(), &s.hand_outs);
        progress(&format!(
            "  fresh {:.3} s, fresh via daemon {:.3} s, cloud-hypervisor style {:.3} s; pooled {:.4} s ({} holes), resident {:.4} s (touched {:.4} s, {} holes), with holes {:.4} s (touched {:.4} s, {} holes)",
            s.fresh_eager_s[rep], s.fresh_eager_daemon_s[rep], s.cloud_hypervisor_style_s[rep],
            s.pooled_eager_s[rep], format_size(h.pooled_eager[rep].hole_bytes),
            h.pooled_resident[rep].alloc_s, h.pooled_resident[rep].touched_s, format_size(h.pooled_resident[rep].hole_bytes),
            h.pooled_holes[rep].alloc_s, h.pooled_holes[rep].touched_s, format_size(h.pooled_holes[rep].hole_bytes),
        ));
        Ok::<_, AllocBenchError>(())
    })?;
    Ok(s)
}

/// The fresh populate with exactly each of `counts` node-local workers,
/// `reps` times each (the order of the counts alternating), and GB/s
/// relative to the first count.
fn scaling(
    m: &Memory<'_>,
    reps: usize,
    counts: &[usize],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<ScalingPoint>, AllocBenchError> {
    let mut per_count: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    rounds::each(reps, |round| {
        for i in round.alternate((0..counts.len()).collect()) {
            per_count[i].push(fresh_eager_workers(m.topology, m.parts, m.page, counts[i])?);
        }
        Ok::<_, AllocBenchError>(())
    })?;
    let mut scaling: Vec<ScalingPoint> = counts
        .iter()
        .zip(&per_count)
        .map(|(&threads, samples)| {
            let best_s = best(samples);
            ScalingPoint {
                threads,
                best_s,
                median_s: median(samples),
                gbps: ratio(m.size as f64 / 1e9, best_s),
                speedup: 0.0,
            }
        })
        .collect();
    let base = scaling.first().map_or(0.0, |p| p.gbps);
    for p in &mut scaling {
        p.speedup = ratio(p.gbps, base);
        progress(&format!(
            "fresh populate, {} node-local worker(s): {:.3} s, {:.2} GB/s ({:.2}x)",
            p.threads, p.best_s, p.gbps, p.speedup
        ));
    }
    Ok(scaling)
}

/// What a run measured, for [`report`].
struct Figures {
    note: Option<String>,
    cpus: usize,
    ch_threads: usize,
    samples: AllocSamples,
    scaling: Vec<ScalingPoint>,
    limits: AllocLimits,
}

/// The hand-out of `samples` with the best ALLOC time (zeros when none).
fn best_hand_out(samples: &[HandOut]) -> HandOut {
    samples
        .iter()
        .copied()
        .min_by(|a, b| a.alloc_s.total_cmp(&b.alloc_s))
        .unwrap_or_default()
}

/// Best and median of one field over hand-outs.
fn times(samples: &[HandOut], field: fn(&HandOut) -> f64) -> (f64, f64) {
    let v: Vec<f64> = samples.iter().map(field).collect();
    (best(&v), median(&v))
}

/// The report: the best of every variant, ratios and medians.
fn report(cfg: &AllocBenchConfig, m: &Memory<'_>, f: Figures) -> AllocBenchReport {
    let Figures {
        note,
        cpus,
        ch_threads,
        samples: s,
        scaling,
        limits,
    } = f;
    let h = &s.hand_outs;
    let resident = times(&h.pooled_resident, |x| x.alloc_s);
    let resident_touched = times(&h.pooled_resident, |x| x.touched_s);
    let holes = times(&h.pooled_holes, |x| x.alloc_s);
    let holes_touched = times(&h.pooled_holes, |x| x.touched_s);
    let size = m.size;
    let fresh = best(&s.fresh_eager_s);
    let fresh_daemon = best(&s.fresh_eager_daemon_s);
    let pooled = best(&s.pooled_eager_s);
    let ch = best(&s.cloud_hypervisor_style_s);
    #[allow(clippy::cast_precision_loss)] // rates
    let gb = size as f64 / 1e9;
    AllocBenchReport {
        size_bytes: size,
        requested_size_bytes: cfg.size,
        page_size: m.page.to_string(),
        note,
        reps: cfg.reps,
        cpus,
        nodes: m.parts.len(),
        fresh_eager_s: fresh,
        fresh_eager_daemon_s: fresh_daemon,
        pooled_eager_s: pooled,
        pooled_eager: best_hand_out(&h.pooled_eager),
        pooled_resident_s: resident.0,
        pooled_resident_touched_s: resident_touched.0,
        pooled_resident: best_hand_out(&h.pooled_resident),
        pooled_holes_s: holes.0,
        pooled_holes_touched_s: holes_touched.0,
        pooled_holes: best_hand_out(&h.pooled_holes),
        cloud_hypervisor_style_s: ch,
        cloud_hypervisor_style_threads: ch_threads,
        fresh_eager_gbps: ratio(gb, fresh),
        cloud_hypervisor_style_gbps: ratio(gb, ch),
        free_to_clean_s: best(&s.free_to_clean_s),
        scrub_cpu_s_per_gib: ratio(median(&s.free_to_clean_cpu_s), size as f64 / GIB),
        ratios: AllocRatios {
            cloud_hypervisor_style_over_fresh_eager: ratio(ch, fresh),
            cloud_hypervisor_style_over_pooled_eager: ratio(ch, pooled),
            fresh_eager_daemon_over_pooled_eager: ratio(fresh_daemon, pooled),
            fresh_eager_daemon_over_fresh_eager: ratio(fresh_daemon, fresh),
            fresh_eager_daemon_over_pooled_resident: ratio(fresh_daemon, resident.0),
            cloud_hypervisor_style_over_pooled_resident_touched: ratio(ch, resident_touched.0),
            cloud_hypervisor_style_over_pooled_holes_touched: ratio(ch, holes_touched.0),
            pooled_holes_touched_over_kernel_zeroing: ratio(
                holes_touched.0,
                limits.kernel_zeroing_touch_threads_s,
            ),
            fresh_eager_over_kernel_zeroing: ratio(fresh, limits.kernel_zeroing_all_cpus_s),
            cloud_hypervisor_style_over_kernel_zeroing: ratio(
                ch,
                limits.kernel_zeroing_cloud_hypervisor_threads_s,
            ),
        },
        limits,
        medians: AllocMedians {
            fresh_eager_s: median(&s.fresh_eager_s),
            fresh_eager_daemon_s: median(&s.fresh_eager_daemon_s),
            pooled_eager_s: median(&s.pooled_eager_s),
            pooled_resident_s: resident.1,
            pooled_resident_touched_s: resident_touched.1,
            pooled_holes_s: holes.1,
            pooled_holes_touched_s: holes_touched.1,
            cloud_hypervisor_style_s: median(&s.cloud_hypervisor_style_s),
            free_to_clean_s: median(&s.free_to_clean_s),
        },
        samples: s,
        scaling,
    }
}
