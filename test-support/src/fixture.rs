//! Fake `/sys/devices/system` and `/proc` trees in temporary directories,
//! for the tests of `numa` (topology, pinning) and `migrate` (planning,
//! the vCPU-affinity policy).
//!
//! ```ignore
//! let tree = SysTree::new()
//!     .cpu_online("0-3")
//!     .node(0, "0-1", 1_000_000, &[10, 20], &[(2048, 8, 8, 0), (1_048_576, 1, 1, 0)])
//!     .node(1, "2-3", 1_000_000, &[20, 10], &[]);
//! let topo = tree.parse(numa::Topology::from_sysfs);
//! ```
//!
//! Each call writes its files at once. A node with no pools gets no
//! `hugepages/` directory, like a kernel without hugetlb. The trees only
//! write files: this crate depends on no crate of the workspace (`numa`
//! dev-depends on it), so parsing is the caller's ([`SysTree::parse`]).

use std::fs;
use std::path::Path;

use tempfile::TempDir;

/// A fake sysfs root (`/sys/devices/system`) in a temporary directory
/// (removed on drop).
#[derive(Debug)]
pub struct SysTree {
    dir: TempDir,
}

impl Default for SysTree {
    fn default() -> Self {
        Self::new()
    }
}

impl SysTree {
    /// An empty tree: no `cpu/online`, no `node/`.
    ///
    /// # Panics
    ///
    /// When the temporary directory cannot be created.
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("create sysfs fixture dir"),
        }
    }

    /// Node 0 (CPUs 0-1, memory) and node 1 (CPUs 2-3, no memory).
    pub fn two_nodes_one_memoryless() -> Self {
        Self::new()
            .cpu_online("0-3")
            .node(0, "0-1", 1 << 20, &[10, 20], &[])
            .node(1, "2-3", 0, &[20, 10], &[])
    }

    /// The root to pass to `numa::Topology::from_sysfs`.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Parses the tree with `from_sysfs` (`numa::Topology::from_sysfs`).
    ///
    /// # Panics
    ///
    /// With the error, when the tree does not parse.
    pub fn parse<T, E: std::fmt::Debug>(
        &self,
        from_sysfs: impl FnOnce(&Path) -> Result<T, E>,
    ) -> T {
        from_sysfs(self.path()).expect("sysfs fixture parses")
    }

    /// `MemFree` the fixture writes for a node of `mem_kb` kB.
    pub fn mem_free_kb(mem_kb: u64) -> u64 {
        mem_kb / 4
    }

    /// Writes `cpu/online`.
    pub fn cpu_online(self, list: &str) -> Self {
        self.write("cpu/online", &format!("{list}\n"));
        self
    }

    /// Writes `node/online`.
    pub fn node_online(self, list: &str) -> Self {
        self.write("node/online", &format!("{list}\n"));
        self
    }

    /// Writes `node/node<id>/{cpulist,meminfo,distance}` and, when `pools` is
    /// not empty, `hugepages/hugepages-<kB>kB/{nr,free,surplus}_hugepages` for
    /// each `(size_kb, total, free, surplus)`.
    pub fn node(
        self,
        id: u32,
        cpulist: &str,
        mem_kb: u64,
        distances: &[u32],
        pools: &[(u64, u64, u64, u64)],
    ) -> Self {
        let dir = format!("node/node{id}");
        self.write(&format!("{dir}/cpulist"), &format!("{cpulist}\n"));
        let free_kb = Self::mem_free_kb(mem_kb);
        let used_kb = mem_kb - free_kb;
        // Shaped like the real file, including lines without a `kB` unit.
        let meminfo = format!(
            "Node {id} MemTotal:       {mem_kb} kB\n\
             Node {id} MemFree:        {free_kb} kB\n\
             Node {id} MemUsed:        {used_kb} kB\n\
             Node {id} Active:         0 kB\n\
             Node {id} HugePages_Total:     0\n\
             Node {id} HugePages_Free:      0\n"
        );
        self.write(&format!("{dir}/meminfo"), &meminfo);
        let row: Vec<String> = distances.iter().map(u32::to_string).collect();
        self.write(&format!("{dir}/distance"), &format!("{}\n", row.join(" ")));
        for &(size_kb, total, free, surplus) in pools {
            let pool = format!("{dir}/hugepages/hugepages-{size_kb}kB");
            self.write(&format!("{pool}/nr_hugepages"), &format!("{total}\n"));
            self.write(&format!("{pool}/free_hugepages"), &format!("{free}\n"));
            self.write(
                &format!("{pool}/surplus_hugepages"),
                &format!("{surplus}\n"),
            );
        }
        self
    }

    fn write(&self, rel: &str, contents: &str) {
        write_file(self.path(), rel, contents);
    }
}

/// A fake `/proc` root in a temporary directory (removed on drop).
#[derive(Debug)]
pub struct ProcTree {
    dir: TempDir,
}

impl Default for ProcTree {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcTree {
    /// An empty `/proc`.
    ///
    /// # Panics
    ///
    /// When the temporary directory cannot be created.
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("create proc fixture dir"),
        }
    }

    /// The root to pass as `proc_root`.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Adds thread `tid` of `pid` named `comm`, last run on `cpu`: a full
    /// 52-field stat line shaped like the kernel's.
    pub fn thread(self, pid: i32, tid: i32, comm: &str, cpu: usize) -> Self {
        let line = stat_line(tid, comm, cpu);
        write_file(self.path(), &format!("{pid}/task/{tid}/stat"), &line);
        self
    }

    /// Writes raw contents as the stat file of `pid`'s thread `tid`.
    pub fn raw(self, pid: i32, tid: i32, contents: &str) -> Self {
        write_file(self.path(), &format!("{pid}/task/{tid}/stat"), contents);
        self
    }
}

/// A stat line: `tid (comm) S` then fields 4..=52, with field 39 = `cpu`.
pub fn stat_line(tid: i32, comm: &str, cpu: usize) -> String {
    let mut fields: Vec<String> = (4..=52).map(|i| (i * 7).to_string()).collect();
    // Field n is at index n - 4.
    fields[39 - 4] = cpu.to_string();
    format!("{tid} ({comm}) S {}\n", fields.join(" "))
}

/// Writes `rel` under `root`, creating parent directories.
fn write_file(root: &Path, rel: &str, contents: &str) {
    let path = root.join(rel);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("create fixture dir");
    }
    fs::write(&path, contents).expect("write fixture file");
}
