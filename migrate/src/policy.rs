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

/// Why a `stat` line did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatError {
    /// No `(` opens the thread's name.
    #[error("no '(' before the thread name")]
    NoOpen,
    /// No `)` closes it.
    #[error("no ')' after the thread name")]
    NoClose,
    /// The last `)` comes before the first `(`.
    #[error("')' before '('")]
    CloseBeforeOpen,
    /// The thread id is not a number.
    #[error("bad tid {0:?}")]
    Tid(String),
    /// Too few fields after the name.
    #[error("{have} fields after the name, field {field} missing")]
    Missing {
        /// Fields after the name.
        have: usize,
        /// The field asked for (1-based, as proc(5) numbers them).
        field: usize,
    },
    /// The state field is empty.
    #[error("empty state field")]
    EmptyState,
    /// The processor field is not a number.
    #[error("bad processor field {0:?}")]
    Processor(String),
}

/// Parses one `stat` line.
///
/// The name (field 2) is everything between the first `(` and the *last*
/// `)`: a thread can name itself `a) b (c` and the kernel prints it as is.
/// The fields after it are split on whitespace.
///
/// # Errors
///
/// Which part is missing or malformed ([`StatError`]).
pub fn parse_stat(line: &str) -> std::result::Result<TaskStat, StatError> {
    let open = line.find('(').ok_or(StatError::NoOpen)?;
    let close = line.rfind(')').ok_or(StatError::NoClose)?;
    if close < open {
        return Err(StatError::CloseBeforeOpen);
    }
    let tid = line[..open]
        .trim()
        .parse::<i32>()
        .map_err(|_| StatError::Tid(line[..open].trim().to_owned()))?;
    let comm = line[open + 1..close].to_string();
    let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
    let field = |n: usize| {
        rest.get(n - FIELD_STATE)
            .copied()
            .ok_or(StatError::Missing {
                have: rest.len(),
                field: n,
            })
    };
    let state = field(FIELD_STATE)?
        .chars()
        .next()
        .ok_or(StatError::EmptyState)?;
    let cpu_text = field(FIELD_PROCESSOR)?;
    let last_cpu = cpu_text
        .parse::<usize>()
        .map_err(|_| StatError::Processor(cpu_text.to_owned()))?;
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
        let stat = parse_stat(text.trim_end()).map_err(|e| WatchError::Parse {
            path: path.clone(),
            reason: e.to_string(),
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
mod tests;
