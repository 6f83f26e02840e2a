//! The vCPU-affinity policy: watch where a VM's vCPU threads run and
//! recommend moving its memory towards them when a mismatch persists.
//! **Off by default** ([`PolicyConfig::enabled`]).
//!
//! # Sampling
//!
//! Each sample reads `/proc/<pid>/task/*/stat` of the VMM process, keeps the
//! vCPU threads (by thread name, see [`VcpuFilter`]) and maps each one's last
//! CPU (field 39, `processor`) to a node with the [`numa::Topology`]. A thread name
//! may hold spaces and parentheses (QEMU names vCPU threads `CPU 0/KVM`), so
//! the name is taken up to the *last* `)` of the line, never split on spaces
//! ([`parse_stat`]). A CPU on a memory-less node counts for the nearest node
//! with memory ([`CpuNodes`]), since that is where its memory would go.
//!
//! # Deciding
//!
//! [`Watcher::observe`] is a pure state machine over samples: it recommends
//! [`Decision::Move`] only when one node other than the memory's holds at
//! least [`PolicyConfig::threshold`] of the vCPUs in
//! [`PolicyConfig::persist`] consecutive samples (the same node each time),
//! and then ignores [`PolicyConfig::cooldown`] samples so one move cannot
//! trigger the next. Last-CPU is a point sample and the scheduler moves
//! threads for many short-lived reasons; without hysteresis a VM whose
//! vCPUs straddle two nodes would have its memory bounce between them, and
//! every bounce costs a full copy of its RAM.
//!
//! The watcher only recommends. Acting on it is the daemon's job (a rate-
//! limited [`crate::move_region`]); see `docs/migration.md` for what the
//! policy does and does not handle.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use numa::{NodeId, Topology};
use serde::{Deserialize, Serialize};

/// Errors reading thread stats.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The task directory of the process could not be listed (no such
    /// process, or no permission).
    #[error("cannot list the threads of process {pid} in {path}")]
    Tasks {
        /// The process.
        pid: i32,
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A stat file did not have the kernel's format.
    #[error("cannot parse {path}: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, WatchError>;

/// The fields of a thread's `stat` line the policy needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStat {
    /// Thread id (field 1).
    pub tid: i32,
    /// Thread name (field 2, without the parentheses; may hold spaces and
    /// parentheses itself).
    pub comm: String,
    /// Scheduler state (field 3: `R`, `S`, `D`, ...).
    pub state: char,
    /// CPU the thread last ran on (field 39).
    pub last_cpu: usize,
}

/// Field number of `processor` in `/proc/<pid>/task/<tid>/stat` (1-based).
const FIELD_PROCESSOR: usize = 39;
/// Field number of `state`, the first field after the name.
const FIELD_STATE: usize = 3;

/// Parses one `stat` line.
///
/// The name (field 2) is everything between the first `(` and the *last*
/// `)`: a thread can name itself `a) b (c` and the kernel prints it as is.
/// The fields after it are split on whitespace.
///
/// # Errors
///
/// A message saying which part is missing or malformed.
pub fn parse_stat(line: &str) -> std::result::Result<TaskStat, String> {
    let open = line.find('(').ok_or("no '(' before the thread name")?;
    let close = line.rfind(')').ok_or("no ')' after the thread name")?;
    if close < open {
        return Err("')' before '('".to_string());
    }
    let tid = line[..open]
        .trim()
        .parse::<i32>()
        .map_err(|_| format!("bad tid {:?}", line[..open].trim()))?;
    let comm = line[open + 1..close].to_string();
    let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
    let field = |n: usize| {
        rest.get(n - FIELD_STATE)
            .copied()
            .ok_or_else(|| format!("{} fields after the name, field {n} missing", rest.len()))
    };
    let state = field(FIELD_STATE)?
        .chars()
        .next()
        .ok_or("empty state field")?;
    let cpu_text = field(FIELD_PROCESSOR)?;
    let last_cpu = cpu_text
        .parse::<usize>()
        .map_err(|_| format!("bad processor field {cpu_text:?}"))?;
    Ok(TaskStat {
        tid,
        comm,
        state,
        last_cpu,
    })
}

/// Every thread of process `pid` under `proc_root` (normally `/proc`).
///
/// A thread that exits between listing and reading is skipped, as is one
/// whose directory name is not a number.
///
/// # Errors
///
/// [`WatchError::Tasks`] when the task directory cannot be listed,
/// [`WatchError::Parse`] when a stat file is malformed.
pub fn read_threads(proc_root: &Path, pid: i32) -> Result<Vec<TaskStat>> {
    let dir = proc_root.join(pid.to_string()).join("task");
    let entries = fs::read_dir(&dir).map_err(|source| WatchError::Tasks {
        pid,
        path: dir.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for entry in entries {
        let Ok(entry) = entry else { continue };
        if entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .is_none()
        {
            continue;
        }
        let path = entry.path().join("stat");
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            // The thread exited: ENOENT, or ESRCH from a half-gone task.
            Err(e)
                if matches!(e.kind(), io::ErrorKind::NotFound)
                    || e.raw_os_error() == Some(libc::ESRCH) =>
            {
                continue
            }
            Err(e) => {
                return Err(WatchError::Parse {
                    path,
                    reason: e.to_string(),
                })
            }
        };
        let stat = parse_stat(text.trim_end()).map_err(|reason| WatchError::Parse {
            path: path.clone(),
            reason,
        })?;
        out.push(stat);
    }
    out.sort_by_key(|t| t.tid);
    Ok(out)
}

/// Which threads of the VMM are vCPUs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VcpuFilter {
    /// The thread names VMMs give their vCPU threads (see [`is_vcpu_name`]).
    #[default]
    KnownNames,
    /// Threads whose name starts with one of these.
    Prefixes(Vec<String>),
    /// These thread ids.
    Tids(Vec<i32>),
    /// Every thread (a VMM whose names are unknown; I/O threads then count too).
    All,
}

impl VcpuFilter {
    /// True when `task` is a vCPU thread.
    pub fn matches(&self, task: &TaskStat) -> bool {
        match self {
            Self::KnownNames => is_vcpu_name(&task.comm),
            Self::Prefixes(p) => p.iter().any(|p| task.comm.starts_with(p.as_str())),
            Self::Tids(t) => t.contains(&task.tid),
            Self::All => true,
        }
    }
}

/// Thread names of vCPU threads: QEMU `CPU <n>/KVM` and `CPU <n>/TCG`,
/// cloud-hypervisor `vcpu<n>`, Firecracker `fc_vcpu <n>`, crosvm
/// `crosvm_vcpu<n>`. Names are cut to 15 bytes by the kernel, which none
/// of these reach for fewer than 10^8 vCPUs... except QEMU's with four-digit
/// ids, which still start with `CPU `.
pub fn is_vcpu_name(comm: &str) -> bool {
    fn digits_then(s: &str) -> Option<&str> {
        let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        (end > 0).then(|| &s[end..])
    }
    if let Some(rest) = comm.strip_prefix("CPU ") {
        return digits_then(rest).is_some_and(|tail| tail.is_empty() || tail.starts_with('/'));
    }
    for prefix in ["vcpu", "fc_vcpu ", "crosvm_vcpu"] {
        if let Some(rest) = comm.strip_prefix(prefix) {
            return digits_then(rest).is_some_and(str::is_empty);
        }
    }
    false
}

/// CPU → node where that CPU's memory should be: the CPU's own node, or for
/// a CPU on a memory-less node the nearest node with memory (by the
/// kernel's distance; ties go to the lower id).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CpuNodes {
    map: BTreeMap<usize, NodeId>,
}

impl CpuNodes {
    /// Builds the map from `topology` (online and offline CPUs).
    pub fn new(topology: &Topology) -> Self {
        let with_memory: Vec<NodeId> = topology
            .nodes()
            .iter()
            .filter(|n| !n.is_memoryless())
            .map(|n| n.id)
            .collect();
        let mut map = BTreeMap::new();
        for node in topology.nodes() {
            let home = if node.is_memoryless() {
                with_memory
                    .iter()
                    .copied()
                    .min_by_key(|&m| (topology.distance(node.id, m).unwrap_or(u32::MAX), m))
            } else {
                Some(node.id)
            };
            let Some(home) = home else { continue };
            for &cpu in node.cpus.iter().chain(&node.offline_cpus) {
                map.insert(cpu, home);
            }
        }
        Self { map }
    }

    /// The node for `cpu`, if known.
    pub fn node_of(&self, cpu: usize) -> Option<NodeId> {
        self.map.get(&cpu).copied()
    }
}

/// vCPU threads per node at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Sample {
    /// vCPU threads per node (by [`CpuNodes`]).
    pub per_node: BTreeMap<NodeId, usize>,
    /// vCPU threads whose CPU is on no known node.
    pub unknown: usize,
}

impl Sample {
    /// A sample from per-node counts (tests, or a VMM that reports its own).
    pub fn from_counts(counts: &[(NodeId, usize)]) -> Self {
        Self {
            per_node: counts.iter().copied().filter(|&(_, c)| c > 0).collect(),
            unknown: 0,
        }
    }

    /// vCPU threads counted on a node.
    pub fn vcpus(&self) -> usize {
        self.per_node.values().sum()
    }

    /// The node with the most vCPUs and its share of them; ties prefer
    /// `prefer`, then the lower id.
    pub fn busiest(&self, prefer: NodeId) -> Option<(NodeId, f64)> {
        let total = self.vcpus();
        let (&node, &count) = self
            .per_node
            .iter()
            .max_by_key(|(&n, &c)| (c, n == prefer, std::cmp::Reverse(n)))?;
        // vCPU counts are far below 2^53.
        #[allow(clippy::cast_precision_loss)]
        let share = count as f64 / total as f64;
        Some((node, share))
    }
}

/// Takes one sample of the vCPU threads of `pid`.
///
/// # Errors
///
/// As [`read_threads`].
pub fn sample(proc_root: &Path, pid: i32, filter: &VcpuFilter, cpus: &CpuNodes) -> Result<Sample> {
    let mut s = Sample::default();
    for task in read_threads(proc_root, pid)? {
        if !filter.matches(&task) {
            continue;
        }
        match cpus.node_of(task.last_cpu) {
            Some(n) => *s.per_node.entry(n).or_insert(0) += 1,
            None => s.unknown += 1,
        }
    }
    Ok(s)
}

/// Policy settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyConfig {
    /// Off by default: moving a VM's memory costs a copy of all of it.
    pub enabled: bool,
    /// Share of the vCPUs (0..=1) one other node must hold. Default 0.75.
    pub threshold: f64,
    /// Consecutive samples the same node must pass the threshold. Default 6
    /// (a minute at the suggested 10 s interval).
    pub persist: u32,
    /// Samples ignored after a recommendation. Default 30.
    pub cooldown: u32,
    /// Fewest vCPUs seen for a sample to count. Default 1.
    pub min_vcpus: usize,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            threshold: 0.75,
            persist: 6,
            cooldown: 30,
            min_vcpus: 1,
        }
    }
}

/// What the watcher says after a sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The policy is off.
    Disabled,
    /// Within the cool-down after a recommendation; `remaining` samples left.
    CoolingDown {
        /// Samples still ignored.
        remaining: u32,
    },
    /// Too few vCPU threads seen.
    NoVcpus,
    /// Most vCPUs run on the memory's node.
    Local {
        /// Their share.
        share: f64,
    },
    /// Another node leads, below the threshold: vCPUs are spread.
    Spread {
        /// The leading node.
        busiest: NodeId,
        /// Its share.
        share: f64,
    },
    /// Another node passes the threshold, not yet for long enough.
    Pending {
        /// The node.
        to: NodeId,
        /// Consecutive samples so far.
        streak: u32,
        /// Samples needed.
        needed: u32,
    },
    /// Move the memory to `to`. The watcher enters its cool-down.
    Move {
        /// Where the memory is.
        from: NodeId,
        /// Where the vCPUs are.
        to: NodeId,
        /// Their share in the last sample.
        share: f64,
    },
}

/// The hysteresis state for one region (or VM).
#[derive(Debug, Clone, PartialEq)]
pub struct Watcher {
    config: PolicyConfig,
    candidate: Option<NodeId>,
    streak: u32,
    cooldown_left: u32,
}

impl Watcher {
    /// A watcher with no history.
    pub fn new(config: PolicyConfig) -> Self {
        Self {
            config,
            candidate: None,
            streak: 0,
            cooldown_left: 0,
        }
    }

    /// The settings.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// Feeds one sample; `memory_node` is where the memory is now.
    pub fn observe(&mut self, sample: &Sample, memory_node: NodeId) -> Decision {
        if !self.config.enabled {
            return Decision::Disabled;
        }
        if self.cooldown_left > 0 {
            self.cooldown_left -= 1;
            self.reset();
            return Decision::CoolingDown {
                remaining: self.cooldown_left,
            };
        }
        let Some((busiest, share)) = sample
            .busiest(memory_node)
            .filter(|_| sample.vcpus() >= self.config.min_vcpus.max(1))
        else {
            self.reset();
            return Decision::NoVcpus;
        };
        if busiest == memory_node {
            self.reset();
            return Decision::Local { share };
        }
        if share < self.config.threshold {
            self.reset();
            return Decision::Spread { busiest, share };
        }
        if self.candidate == Some(busiest) {
            self.streak += 1;
        } else {
            self.candidate = Some(busiest);
            self.streak = 1;
        }
        if self.streak >= self.config.persist.max(1) {
            self.reset();
            self.cooldown_left = self.config.cooldown;
            return Decision::Move {
                from: memory_node,
                to: busiest,
                share,
            };
        }
        Decision::Pending {
            to: busiest,
            streak: self.streak,
            needed: self.config.persist.max(1),
        }
    }

    /// Starts the cool-down now (after a move the daemon made for another
    /// reason, e.g. a manual REBALANCE).
    pub fn moved(&mut self) {
        self.reset();
        self.cooldown_left = self.config.cooldown;
    }

    fn reset(&mut self) {
        self.candidate = None;
        self.streak = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_support::fixture::{stat_line, ProcTree, SysTree};

    #[test]
    fn parses_stat_with_awkward_names() {
        let t = parse_stat(&stat_line(42, "(a) b (c)", 3)).expect("parse");
        assert_eq!(
            t,
            TaskStat {
                tid: 42,
                comm: "(a) b (c)".into(),
                state: 'S',
                last_cpu: 3
            }
        );
        let t = parse_stat(&stat_line(7, "CPU 0/KVM", 1)).expect("parse");
        assert_eq!((t.comm.as_str(), t.last_cpu), ("CPU 0/KVM", 1));
        // A name that is only a closing parenthesis and spaces.
        let t = parse_stat(&stat_line(8, ") ) ", 5)).expect("parse");
        assert_eq!((t.comm.as_str(), t.last_cpu), (") ) ", 5));
        // An empty name.
        assert_eq!(parse_stat(&stat_line(9, "", 0)).expect("parse").comm, "");
    }

    #[test]
    fn parses_a_real_stat_line() {
        let text = fs::read_to_string("/proc/thread-self/stat").expect("read own stat");
        let t = parse_stat(text.trim_end()).expect("parse own stat");
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        assert!(t.last_cpu < cpus.max(1024));
        assert_eq!(t.state, 'R');
    }

    #[test]
    fn refuses_malformed_lines() {
        for bad in [
            "",
            "12 comm S 1 2",
            "x (comm) S 1",
            "12 (comm) S 1 2 3",
            "12 )comm( S",
            "12 (comm) ",
        ] {
            assert!(parse_stat(bad).is_err(), "{bad:?} parsed");
        }
        // Field 39 present but not a number.
        let mut line = stat_line(1, "x", 0);
        line = line.replacen(" 0 ", " zz ", 1);
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields[38], "zz");
        assert!(parse_stat(&line)
            .expect_err("bad cpu")
            .contains("processor"));
    }

    #[test]
    fn vcpu_names() {
        for yes in [
            "CPU 0/KVM",
            "CPU 12/TCG",
            "CPU 3",
            "vcpu0",
            "vcpu17",
            "fc_vcpu 3",
            "crosvm_vcpu2",
        ] {
            assert!(is_vcpu_name(yes), "{yes}");
        }
        for no in [
            "CPU /KVM",
            "CPU x/KVM",
            "vcpu",
            "vcpu_x",
            "qemu-system-x86",
            "IO mon_iothread",
            "vhost-123",
            "(a) b (c)",
        ] {
            assert!(!is_vcpu_name(no), "{no}");
        }
    }

    #[test]
    fn reads_a_fixture_proc_tree() {
        let tree = ProcTree::new()
            .thread(100, 100, "qemu-system-x86", 0)
            .thread(100, 101, "CPU 0/KVM", 2)
            .thread(100, 102, "CPU 1/KVM", 3)
            .thread(100, 103, "(a) b (c)", 1)
            .thread(100, 104, "CPU 2/KVM", 0);
        let threads = read_threads(tree.path(), 100).expect("read");
        assert_eq!(threads.len(), 5);
        assert_eq!(threads[3].comm, "(a) b (c)");

        let sys = SysTree::new()
            .cpu_online("0-3")
            .node(0, "0-1", 1 << 20, &[10, 20], &[])
            .node(1, "2-3", 1 << 20, &[20, 10], &[]);
        let cpus = CpuNodes::new(&sys.parse(numa::Topology::from_sysfs));
        let s = sample(tree.path(), 100, &VcpuFilter::default(), &cpus).expect("sample");
        assert_eq!(s.per_node, BTreeMap::from([(0, 1), (1, 2)]));
        let all = sample(tree.path(), 100, &VcpuFilter::All, &cpus).expect("sample");
        assert_eq!(all.vcpus(), 5);
        let tids = sample(tree.path(), 100, &VcpuFilter::Tids(vec![103]), &cpus).expect("sample");
        assert_eq!(tids.per_node, BTreeMap::from([(0, 1)]));
        let pre = sample(
            tree.path(),
            100,
            &VcpuFilter::Prefixes(vec!["(a)".into()]),
            &cpus,
        )
        .expect("sample");
        assert_eq!(pre.vcpus(), 1);
    }

    #[test]
    fn proc_tree_errors() {
        let tree = ProcTree::new()
            .raw(5, 5, "5 (bad line")
            .thread(6, 6, "vcpu0", 9);
        assert!(matches!(
            read_threads(tree.path(), 4),
            Err(WatchError::Tasks { pid: 4, .. })
        ));
        let err = read_threads(tree.path(), 5).expect_err("malformed");
        assert!(err.to_string().contains("5/task/5/stat"), "{err}");
        // A CPU no node lists is counted as unknown.
        let sys = SysTree::new()
            .cpu_online("0-1")
            .node(0, "0-1", 1 << 20, &[10], &[]);
        let s = sample(
            tree.path(),
            6,
            &VcpuFilter::default(),
            &CpuNodes::new(&sys.parse(numa::Topology::from_sysfs)),
        )
        .expect("sample");
        assert_eq!((s.vcpus(), s.unknown), (0, 1));
    }

    #[test]
    fn reads_this_process() {
        let threads =
            read_threads(Path::new("/proc"), std::process::id() as i32).expect("read self");
        assert!(!threads.is_empty());
        let topo = Topology::detect().expect("topology");
        let s = sample(
            Path::new("/proc"),
            std::process::id() as i32,
            &VcpuFilter::All,
            &CpuNodes::new(&topo),
        )
        .expect("sample self");
        assert_eq!(s.vcpus() + s.unknown, threads.len());
    }

    #[test]
    fn memoryless_cpus_count_for_the_nearest_memory_node() {
        let sys = SysTree::new()
            .cpu_online("0-5")
            .node(0, "0-1", 1 << 20, &[10, 20, 30], &[])
            .node(1, "2-3", 0, &[20, 10, 12], &[])
            .node(2, "4-5", 1 << 20, &[30, 12, 10], &[]);
        let cpus = CpuNodes::new(&sys.parse(numa::Topology::from_sysfs));
        assert_eq!(cpus.node_of(0), Some(0));
        assert_eq!(
            cpus.node_of(2),
            Some(2),
            "node 1 is nearer to 2 (12) than 0 (20)"
        );
        assert_eq!(cpus.node_of(5), Some(2));
        assert_eq!(cpus.node_of(6), None);
        let only = SysTree::two_nodes_one_memoryless();
        assert_eq!(
            CpuNodes::new(&only.parse(numa::Topology::from_sysfs)).node_of(3),
            Some(0)
        );
    }

    fn on() -> PolicyConfig {
        PolicyConfig {
            enabled: true,
            threshold: 0.75,
            persist: 3,
            cooldown: 2,
            min_vcpus: 1,
        }
    }

    #[test]
    fn off_by_default() {
        assert!(!PolicyConfig::default().enabled);
        let mut w = Watcher::new(PolicyConfig::default());
        for _ in 0..100 {
            assert_eq!(
                w.observe(&Sample::from_counts(&[(1, 4)]), 0),
                Decision::Disabled
            );
        }
    }

    #[test]
    fn persistent_mismatch_recommends_once_then_cools_down() {
        let mut w = Watcher::new(on());
        let away = Sample::from_counts(&[(0, 1), (1, 3)]);
        assert_eq!(
            w.observe(&away, 0),
            Decision::Pending {
                to: 1,
                streak: 1,
                needed: 3
            }
        );
        assert_eq!(
            w.observe(&away, 0),
            Decision::Pending {
                to: 1,
                streak: 2,
                needed: 3
            }
        );
        assert_eq!(
            w.observe(&away, 0),
            Decision::Move {
                from: 0,
                to: 1,
                share: 0.75
            }
        );
        // Cool-down: the same samples are ignored.
        assert_eq!(w.observe(&away, 0), Decision::CoolingDown { remaining: 1 });
        assert_eq!(w.observe(&away, 0), Decision::CoolingDown { remaining: 0 });
        // Then the streak starts from zero.
        assert_eq!(
            w.observe(&away, 0),
            Decision::Pending {
                to: 1,
                streak: 1,
                needed: 3
            }
        );
    }

    #[test]
    fn a_break_in_the_streak_resets_it() {
        let mut w = Watcher::new(on());
        let away = Sample::from_counts(&[(1, 4)]);
        let home = Sample::from_counts(&[(0, 4)]);
        let spread = Sample::from_counts(&[(0, 2), (1, 2)]);
        w.observe(&away, 0);
        w.observe(&away, 0);
        assert_eq!(w.observe(&home, 0), Decision::Local { share: 1.0 });
        assert_eq!(
            w.observe(&away, 0),
            Decision::Pending {
                to: 1,
                streak: 1,
                needed: 3
            }
        );
        w.observe(&away, 0);
        // Half and half: spread, no move (ties prefer the memory's node).
        assert_eq!(w.observe(&spread, 0), Decision::Local { share: 0.5 });
        assert_eq!(
            w.observe(&Sample::from_counts(&[(0, 1), (1, 2), (2, 1)]), 0),
            Decision::Spread {
                busiest: 1,
                share: 0.5
            }
        );
        assert_eq!(
            w.observe(&away, 0),
            Decision::Pending {
                to: 1,
                streak: 1,
                needed: 3
            }
        );
    }

    #[test]
    fn a_change_of_candidate_restarts_the_streak() {
        let mut w = Watcher::new(on());
        let to1 = Sample::from_counts(&[(1, 4)]);
        let to2 = Sample::from_counts(&[(2, 4)]);
        w.observe(&to1, 0);
        w.observe(&to1, 0);
        assert_eq!(
            w.observe(&to2, 0),
            Decision::Pending {
                to: 2,
                streak: 1,
                needed: 3
            }
        );
    }

    #[test]
    fn too_few_vcpus_is_no_evidence() {
        let mut w = Watcher::new(PolicyConfig {
            min_vcpus: 2,
            ..on()
        });
        assert_eq!(
            w.observe(&Sample::from_counts(&[(1, 1)]), 0),
            Decision::NoVcpus
        );
        assert_eq!(w.observe(&Sample::default(), 0), Decision::NoVcpus);
    }

    #[test]
    fn manual_move_starts_the_cool_down() {
        let mut w = Watcher::new(on());
        w.observe(&Sample::from_counts(&[(1, 4)]), 0);
        w.moved();
        assert_eq!(
            w.observe(&Sample::from_counts(&[(1, 4)]), 0),
            Decision::CoolingDown { remaining: 1 }
        );
    }

    #[test]
    fn config_defaults_through_serde() {
        let c: PolicyConfig = serde_json::from_str(r#"{"enabled": true}"#).expect("parse");
        assert_eq!(
            c,
            PolicyConfig {
                enabled: true,
                ..PolicyConfig::default()
            }
        );
    }
}
