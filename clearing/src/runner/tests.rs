//! Tests of the clearing runner: jobs, workers, cancellation and progress, on real memory.

#![allow(clippy::undocumented_unsafe_blocks)]

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::kernel::MAX_RUN;

use proptest::prelude::*;

use super::*;

/// The live topology. Panics (failing the test) until `numa` is complete.
fn topology() -> Topology {
    Topology::detect().expect("detect the host NUMA topology")
}

fn job(start: usize, len: usize) -> Job {
    Job {
        start,
        len,
        align: 1,
        min_chunk: 1,
        max_threads: 2,
        node: None,
    }
}

fn chunks_of(plan: &JobPlan) -> Vec<Chunk> {
    (0..).map_while(|k| plan.chunk(0, k)).collect()
}

/// Checks the splitting rules for one plan; returns the chunks.
fn check_plan(j: &Job, cpus: usize, max_chunk: usize) -> Vec<Chunk> {
    let plan = JobPlan::new(j, cpus, max_chunk);
    let chunks = chunks_of(&plan);
    assert_eq!(chunks.len(), plan.chunks);
    assert!(plan.workers >= 1 && plan.workers <= j.max_threads && plan.workers <= cpus.max(1));
    assert!(plan.workers <= plan.chunks);
    let mut pos = j.start;
    let min_chunk = j.min_chunk.max(1);
    let floor = align_up(min_chunk, j.align).unwrap_or(usize::MAX);
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.start, pos, "chunks are contiguous");
        assert!(c.len > 0);
        pos += c.len;
        let last = i + 1 == chunks.len();
        if !last {
            assert_eq!(
                pos % j.align,
                0,
                "interior boundary {pos:#x} not aligned to {:#x}",
                j.align
            );
            assert!(
                c.len >= min_chunk,
                "chunk {i} of {} below min_chunk {min_chunk}",
                c.len
            );
        }
        // `max_chunk` yields only where the job's constraints leave no
        // choice: the cap is below one legal chunk, or (first chunk) no
        // aligned boundary lies between `start + min_chunk` and
        // `start + max_chunk`.
        let cap_possible = align_down(max_chunk, j.align) >= floor;
        let first_possible =
            align_up(j.start + min_chunk, j.align).is_some_and(|e| e - j.start <= max_chunk);
        if max_chunk != 0 && cap_possible && (i > 0 || first_possible || last) {
            assert!(
                c.len <= max_chunk,
                "chunk {i} of {} above max_chunk {max_chunk}",
                c.len
            );
        }
    }
    assert_eq!(pos, j.start + j.len);
    chunks
}

#[test]
fn plan_padata_shape() {
    // 1 GiB, 2 MiB aligned, 8 threads allowed, 2 CPUs: 2 workers, ~8 chunks.
    let j = Job {
        start: 1 << 30,
        len: 1 << 30,
        align: 2 << 20,
        min_chunk: 4 << 20,
        max_threads: 8,
        node: None,
    };
    let plan = JobPlan::new(&j, 2, 0);
    assert_eq!(plan.workers, 2);
    assert_eq!(plan.chunk_size, 128 << 20);
    assert_eq!(plan.chunks, 8);
    check_plan(&j, 2, 0);
    // The 64 MiB responsiveness cap gives 16 chunks.
    let plan = JobPlan::new(&j, 2, MAX_RUN);
    assert_eq!(plan.chunk_size, MAX_RUN);
    assert_eq!(plan.chunks, 16);
    check_plan(&j, 2, MAX_RUN);
}

#[test]
fn plan_small_job_is_one_chunk() {
    let j = Job {
        min_chunk: 1 << 20,
        ..job(12345, 1000)
    };
    let plan = JobPlan::new(&j, 4, MAX_RUN);
    assert_eq!((plan.chunks, plan.workers), (1, 1));
    assert_eq!(
        chunks_of(&plan),
        vec![Chunk {
            job: 0,
            start: 12345,
            len: 1000
        }]
    );
}

#[test]
fn plan_unaligned_start_keeps_first_chunk_long_enough() {
    let j = Job {
        start: 4096 - 1,
        len: 1 << 20,
        align: 4096,
        min_chunk: 64 << 10,
        max_threads: 4,
        node: None,
    };
    let chunks = check_plan(&j, 4, 128 << 10);
    // 64 KiB chunks; the first ends on the first 4 KiB boundary past
    // min_chunk, since the one before would leave it short.
    assert_eq!(chunks[0].start + chunks[0].len, 4096 + (64 << 10));
    assert_eq!(chunks[1].len, 64 << 10);
    // With the cap at min_chunk no legal first chunk fits under it; the
    // job's min_chunk wins, by the least possible.
    let chunks = check_plan(&j, 4, 64 << 10);
    assert_eq!(chunks[0].len, (64 << 10) + 1);
}

#[test]
fn plan_job_constraints_beat_max_chunk() {
    let j = Job {
        start: 0,
        len: 8 << 20,
        align: 1 << 20,
        min_chunk: 1,
        max_threads: 2,
        node: None,
    };
    // A cap below `align` cannot be met: chunks are one alignment unit.
    let plan = JobPlan::new(&j, 2, 4096);
    assert_eq!(plan.chunk_size, 1 << 20);
    check_plan(&j, 2, 4096);
}

#[test]
fn memory_only_node_borrows_the_nearest_cpus() {
    let node = |id: NodeId, cpus: Vec<usize>, distances: Vec<u32>| numa::Node {
        id,
        cpus,
        offline_cpus: Vec::new(),
        mem_total: 1 << 30,
        mem_free: 1 << 30,
        distances,
        huge_pages: Vec::new(),
    };
    // Node 2 is CPU-less, closer to node 1 than to node 0.
    let nodes = vec![
        node(0, vec![0, 1], vec![10, 20, 30, 30]),
        node(1, vec![2, 3], vec![20, 10, 15, 30]),
        node(2, vec![], vec![30, 15, 10, 15]),
        node(3, vec![4], vec![30, 30, 15, 10]),
    ];
    let distance = |a: NodeId, b: NodeId| {
        let (a, b) = (usize::try_from(a).ok()?, usize::try_from(b).ok()?);
        nodes.get(a)?.distances.get(b).copied()
    };
    // Ties (1 and 3 both at 15) go to the lower id.
    assert_eq!(
        nearest_with_cpus(&nodes, 2, distance).map(|n| n.id),
        Some(1)
    );
    assert_eq!(
        nearest_with_cpus(&nodes, 0, distance).map(|n| n.id),
        Some(0)
    );
    assert!(nearest_with_cpus(&nodes[2..3], 2, distance).is_none());
}

#[test]
fn align_helpers() {
    assert_eq!(align_up(0, 8), Some(0));
    assert_eq!(align_up(1, 8), Some(8));
    assert_eq!(align_up(usize::MAX, 8), None);
    assert_eq!(align_down(15, 8), 8);
}

#[test]
fn gate_releases_when_expected_arrive() {
    let gate = StartGate::default();
    thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| gate.arrive_and_wait());
        }
        gate.expect(3);
    });
    let gate = StartGate::default();
    gate.expect(0);
    assert!(gate.lock().open);
}

#[test]
fn cancel_token_clones_share_state() {
    let t = CancelToken::new();
    let u = t.clone();
    assert!(!u.is_cancelled());
    t.cancel();
    assert!(u.is_cancelled());
}

#[test]
fn gib_per_s_handles_zero_time() {
    let s = NodeStats {
        node: None,
        bytes: 1 << 30,
        seconds: 0.0,
        threads: 1,
        chunks: 1,
    };
    assert!(s.gib_per_s().abs() < f64::EPSILON);
    let s = NodeStats { seconds: 0.5, ..s };
    assert!((s.gib_per_s() - 2.0).abs() < 1e-9);
}

#[test]
fn overlapping_clear_jobs_are_rejected() {
    let jobs = [job(0, 100), job(200, 10), job(50, 60)];
    let err = check_disjoint(&jobs).expect_err("overlap");
    assert!(matches!(err, RunError::InvalidJob { job: 2, .. }), "{err}");
    assert!(check_disjoint(&[job(0, 100), job(100, 1), job(5, 0)]).is_ok());
}

#[test]
fn error_messages_read_as_sentences() {
    let e: RunError<io::Error> = RunError::InvalidJob {
        job: 1,
        reason: "max_threads is 0".into(),
    };
    assert_eq!(e.to_string(), "job 1 is invalid: max_threads is 0");
    let e: RunError<io::Error> = RunError::Work {
        chunk: Chunk {
            job: 0,
            start: 0x1000,
            len: 4096,
        },
        source: io::Error::other("boom"),
    };
    assert_eq!(e.to_string(), "work failed on job 0 at 0x1000 (4096 bytes)");
    assert!(std::error::Error::source(&e).is_some());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn plan_rules_hold(
        start in 0usize..(1 << 40),
        len in 1usize..(1 << 34),
        align_shift in 0u32..31,
        min_chunk in 0usize..(1 << 26),
        max_threads in 1usize..64,
        cpus in 1usize..64,
        max_chunk in prop_oneof![Just(0usize), 1usize..(1 << 28)],
    ) {
        let j = Job { start, len, align: 1 << align_shift, min_chunk, max_threads, node: None };
        let plan = JobPlan::new(&j, cpus, max_chunk);
        // Keep the walk over chunks cheap.
        prop_assume!(plan.chunks <= 100_000);
        check_plan(&j, cpus, max_chunk);
    }
}

// ---- Tests through `run_jobs` (need `numa::Topology::detect`). ----

/// A counter per unit of an abstract address space `0..SPACE`; jobs are
/// ranges in it and the work function counts every unit it is given.
struct Counters(Vec<AtomicU32>);

impl Counters {
    fn new(n: usize) -> Self {
        Self((0..n).map(|_| AtomicU32::new(0)).collect())
    }
    fn count(&self, c: &Chunk) {
        for u in &self.0[c.start..c.start + c.len] {
            u.fetch_add(1, Ordering::Relaxed);
        }
    }
}

const SPACE: usize = 1 << 18;
const GUARD_UNITS: usize = 4096;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn run_jobs_covers_each_unit_exactly_once(
        specs in proptest::collection::vec(
            (0usize..4096, 1usize..(64 << 10), 0u32..13, 0usize..(16 << 10), 1usize..8),
            1..=3,
        ),
        max_chunk in prop_oneof![Just(0usize), 1usize..(64 << 10)],
    ) {
        let topo = topology();
        // Lay the jobs out one after another with guard zones between.
        let mut jobs = Vec::new();
        let mut pos = GUARD_UNITS;
        for &(off, len, align_shift, min_chunk, max_threads) in &specs {
            let start = pos + off;
            jobs.push(Job { start, len, align: 1 << align_shift, min_chunk, max_threads, node: None });
            pos = start + len + GUARD_UNITS;
        }
        prop_assert!(pos <= SPACE);
        let counters = Counters::new(SPACE);
        let seen = Mutex::new(Vec::new());
        let opts = RunOptions { max_chunk, ..RunOptions::default() };
        let report = run_jobs(&topo, &jobs, &opts, |c: &Chunk| {
            counters.count(c);
            seen.lock().map_err(|_| io::Error::other("poisoned"))?.push(*c);
            Ok::<(), io::Error>(())
        });
        let report = report.map_err(|e| TestCaseError::fail(e.to_string()))?;
        let total: usize = jobs.iter().map(|j| j.len).sum();
        prop_assert_eq!(report.bytes, total as u64);
        prop_assert_eq!(report.nodes.len(), 1);
        prop_assert_eq!(report.nodes[0].bytes, total as u64);

        // Every unit in a job counted once, every other unit zero.
        let mut expect = vec![0u32; SPACE];
        for j in &jobs {
            expect[j.start..j.start + j.len].fill(1);
        }
        for (i, (c, e)) in counters.0.iter().zip(&expect).enumerate() {
            prop_assert_eq!(c.load(Ordering::Relaxed), *e, "unit {}", i);
        }

        // Chunk rules, per job.
        let mut seen = seen.into_inner().map_err(|_| TestCaseError::fail("poisoned"))?;
        seen.sort_by_key(|c| c.start);
        prop_assert_eq!(report.nodes[0].chunks, seen.len());
        for (ji, j) in jobs.iter().enumerate() {
            let mine: Vec<_> = seen.iter().filter(|c| c.job == ji).collect();
            let min_chunk = j.min_chunk.max(1);
            for (k, c) in mine.iter().enumerate() {
                let end = c.start + c.len;
                if k + 1 < mine.len() {
                    prop_assert_eq!(end % j.align, 0, "job {} boundary {} not aligned", ji, end);
                    prop_assert!(c.len >= min_chunk, "job {} chunk {} too short", ji, k);
                } else {
                    prop_assert_eq!(end, j.start + j.len);
                }
            }
        }
    }
}

#[test]
fn invalid_jobs_are_rejected_before_any_work() {
    let topo = topology();
    let ran = AtomicBool::new(false);
    let work = |_: &Chunk| {
        ran.store(true, Ordering::Relaxed);
        Ok::<(), io::Error>(())
    };
    let opts = RunOptions::default();
    let cases: [(Job, &str); 4] = [
        (
            Job {
                align: 3,
                ..job(0, 100)
            },
            "not a power of two",
        ),
        (
            Job {
                align: 0,
                ..job(0, 100)
            },
            "not a power of two",
        ),
        (
            Job {
                max_threads: 0,
                ..job(0, 100)
            },
            "max_threads is 0",
        ),
        (job(usize::MAX - 5, 10), "overflows"),
    ];
    for (bad, msg) in cases {
        // The valid job comes first: it must not run either.
        let err = run_jobs(&topo, &[job(0, 100), bad], &opts, work).expect_err("invalid");
        match err {
            RunError::InvalidJob { job: 1, reason } => {
                assert!(reason.contains(msg), "{reason}")
            }
            other => panic!("unexpected {other}"),
        }
    }
    let missing = topo.nodes().iter().map(|n| n.id).max().unwrap_or(0) + 1;
    let err = run_jobs(
        &topo,
        &[Job {
            node: Some(missing),
            ..job(0, 100)
        }],
        &opts,
        work,
    )
    .expect_err("unknown node");
    assert!(matches!(err, RunError::InvalidJob { job: 0, .. }), "{err}");
    assert!(!ran.load(Ordering::Relaxed));
}

#[test]
fn empty_jobs_are_no_ops() {
    let topo = topology();
    let report = run_jobs(&topo, &[job(0, 0)], &RunOptions::default(), |_: &Chunk| {
        Err::<(), io::Error>(io::Error::other("must not run"))
    })
    .expect("empty run");
    assert_eq!(report.bytes, 0);
    assert!(report.nodes.is_empty());
    let report = run_jobs(&topo, &[], &RunOptions::default(), |_: &Chunk| {
        Ok::<(), io::Error>(())
    })
    .expect("no jobs");
    assert_eq!(report.bytes, 0);
}

#[test]
fn work_error_is_returned_with_its_chunk() {
    let topo = topology();
    let j = Job {
        min_chunk: 1000,
        max_threads: 2,
        ..job(0, 100_000)
    };
    let bad_start = AtomicUsize::new(usize::MAX);
    let err = run_jobs(
        &topo,
        &[j],
        &RunOptions {
            max_chunk: 1000,
            ..RunOptions::default()
        },
        |c: &Chunk| {
            if c.start <= 50_000 && 50_000 < c.start + c.len {
                bad_start.store(c.start, Ordering::Relaxed);
                return Err(io::Error::other("bad chunk"));
            }
            Ok(())
        },
    )
    .expect_err("work error");
    match err {
        RunError::Work { chunk, source } => {
            assert_eq!(chunk.job, 0);
            assert_eq!(chunk.start, bad_start.load(Ordering::Relaxed));
            assert!(chunk.start <= 50_000 && 50_000 < chunk.start + chunk.len);
            assert_eq!(source.to_string(), "bad chunk");
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn cancel_from_progress_callback_stops_the_run() {
    let topo = topology();
    let token = CancelToken::new();
    let calls = AtomicUsize::new(0);
    let progress = |p: &Progress| {
        calls.fetch_add(1, Ordering::Relaxed);
        assert!(p.bytes_done <= p.bytes_total);
        token.cancel();
    };
    let opts = RunOptions {
        cancel: Some(&token),
        progress: Some(&progress),
        max_chunk: 1024,
    };
    let total = 1 << 20;
    let err = run_jobs(
        &topo,
        &[Job {
            max_threads: 2,
            ..job(0, total)
        }],
        &opts,
        |_: &Chunk| Ok::<(), io::Error>(()),
    )
    .expect_err("cancelled");
    match err {
        RunError::Cancelled { bytes_done } => {
            assert!(bytes_done > 0 && bytes_done < total as u64, "{bytes_done}");
        }
        other => panic!("unexpected {other}"),
    }
    assert!(calls.load(Ordering::Relaxed) >= 1);
}

#[test]
fn progress_is_monotonic_and_ends_at_total() {
    let topo = topology();
    let last = Mutex::new(Vec::new());
    let progress = |p: &Progress| last.lock().expect("not poisoned").push(*p);
    let opts = RunOptions {
        progress: Some(&progress),
        max_chunk: 4096,
        ..RunOptions::default()
    };
    let total = 4 << 20;
    run_jobs(
        &topo,
        &[Job {
            max_threads: 2,
            ..job(0, total)
        }],
        &opts,
        |_: &Chunk| Ok::<(), io::Error>(()),
    )
    .expect("run");
    let calls = last.into_inner().expect("not poisoned");
    assert!(!calls.is_empty());
    assert!(calls.windows(2).all(|w| w[0].bytes_done < w[1].bytes_done));
    let end = calls.last().expect("non-empty");
    assert_eq!(
        (end.bytes_done, end.bytes_total),
        (total as u64, total as u64)
    );
}

#[test]
fn worker_panic_becomes_an_error() {
    let topo = topology();
    let err = run_jobs(
        &topo,
        &[Job {
            max_threads: 2,
            ..job(0, 10_000)
        }],
        &RunOptions {
            max_chunk: 100,
            ..RunOptions::default()
        },
        |c: &Chunk| {
            assert!(c.start < 5_000, "boom at {}", c.start);
            Ok::<(), io::Error>(())
        },
    )
    .expect_err("panic");
    match err {
        RunError::WorkerPanicked { job: 0, message } => {
            assert!(message.contains("boom"), "{message}")
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn clear_parallel_zeroes_the_buffer() {
    let topo = topology();
    for kernel in ClearKernel::ALL {
        let mut buf = vec![0xEEu8; (3 * CLEAR_MIN_CHUNK) + 12345];
        let report = clear_parallel(
            &topo,
            &mut buf[7..],
            None,
            4,
            kernel,
            &RunOptions::default(),
        )
        .expect("clear");
        assert_eq!(report.bytes, (buf.len() - 7) as u64);
        assert_eq!(buf[..7], [0xEE; 7]);
        assert!(buf[7..].iter().all(|&b| b == 0), "{}", kernel.name());
    }
}

#[test]
fn clear_jobs_zeroes_several_ranges() {
    let topo = topology();
    let mut buf = vec![0x11u8; 3 << 20];
    let base = buf.as_mut_ptr() as usize;
    let jobs = [
        Job {
            start: base + 100,
            len: 1 << 20,
            align: 4096,
            min_chunk: 64 << 10,
            max_threads: 2,
            node: None,
        },
        Job {
            start: base + (2 << 20),
            len: (1 << 20) - 1,
            align: 4096,
            min_chunk: 64 << 10,
            max_threads: 2,
            node: None,
        },
    ];
    let report = unsafe {
        clear_jobs(
            &topo,
            &jobs,
            ClearKernel::default_kernel(),
            &RunOptions::default(),
        )
    }
    .expect("clear");
    assert_eq!(report.bytes, (2 << 20) - 1);
    assert!(buf[..100].iter().all(|&b| b == 0x11));
    assert!(buf[100..100 + (1 << 20)].iter().all(|&b| b == 0));
    assert!(buf[100 + (1 << 20)..2 << 20].iter().all(|&b| b == 0x11));
    assert!(buf[2 << 20..(3 << 20) - 1].iter().all(|&b| b == 0));
    assert_eq!(buf[(3 << 20) - 1], 0x11);
}

#[test]
fn workers_run_on_their_node() {
    let topo = topology();
    let jobs: Vec<Job> = topo
        .nodes()
        .iter()
        .filter(|n| !n.cpus.is_empty())
        .enumerate()
        .map(|(i, n)| Job {
            start: i << 24,
            len: 1 << 20,
            align: 4096,
            min_chunk: 4096,
            max_threads: 4,
            node: Some(n.id),
        })
        .collect();
    assert!(!jobs.is_empty());
    let opts = RunOptions {
        max_chunk: 16 << 10,
        ..RunOptions::default()
    };
    let report = run_jobs(&topo, &jobs, &opts, |c: &Chunk| {
        let (cpu, node) = numa::current_cpu().map_err(io::Error::other)?;
        let want = jobs[c.job].node.expect("pinned job");
        let cpus = &topo.node(want).map_err(io::Error::other)?.cpus;
        if node != want || !cpus.contains(&cpu) {
            return Err(io::Error::other(format!(
                "on cpu {cpu} node {node}, want node {want}"
            )));
        }
        Ok(())
    })
    .expect("pinned run");
    assert_eq!(report.nodes.len(), jobs.len());
    for (s, j) in report.nodes.iter().zip(&jobs) {
        assert_eq!(s.node, j.node);
        assert_eq!(s.bytes, 1 << 20);
        assert!(s.threads >= 1);
    }
}
