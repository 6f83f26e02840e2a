//! Test-only fake `/sys/devices/system` and `/proc` trees.
//!
//! The `numa` crate keeps its own sysfs fixture private, so this is a small
//! copy of the layout [`numa::Topology::from_sysfs`] reads, plus a `/proc`
//! tree with `PID/task/TID/stat` files for the vCPU watcher.

use std::fs;
use std::path::Path;

use numa::{NodeId, Topology};
use tempfile::TempDir;

/// A fake sysfs root (removed on drop).
pub(crate) struct SysTree {
    dir: TempDir,
}

impl SysTree {
    /// An empty tree with `cpu/online` = `cpus`.
    pub(crate) fn new(cpus: &str) -> Self {
        let tree = Self {
            dir: tempfile::tempdir().expect("create sysfs fixture dir"),
        };
        tree.write("cpu/online", &format!("{cpus}\n"));
        tree
    }

    /// Adds node `id` with `cpulist`, `mem_kb` of memory and a distance row.
    pub(crate) fn node(self, id: NodeId, cpulist: &str, mem_kb: u64, distances: &[u32]) -> Self {
        let dir = format!("node/node{id}");
        self.write(&format!("{dir}/cpulist"), &format!("{cpulist}\n"));
        self.write(
            &format!("{dir}/meminfo"),
            &format!(
                "Node {id} MemTotal:       {mem_kb} kB\nNode {id} MemFree:        {} kB\n",
                mem_kb / 2
            ),
        );
        let row: Vec<String> = distances.iter().map(u32::to_string).collect();
        self.write(&format!("{dir}/distance"), &format!("{}\n", row.join(" ")));
        self
    }

    /// Node 0 (CPUs 0-1, memory) and node 1 (CPUs 2-3, no memory).
    pub(crate) fn two_nodes_one_memoryless() -> Self {
        Self::new("0-3")
            .node(0, "0-1", 1 << 20, &[10, 20])
            .node(1, "2-3", 0, &[20, 10])
    }

    /// Parses the tree.
    pub(crate) fn topology(&self) -> Topology {
        Topology::from_sysfs(self.dir.path()).expect("sysfs fixture parses")
    }

    fn write(&self, rel: &str, contents: &str) {
        write_file(self.dir.path(), rel, contents);
    }
}

/// A fake `/proc` root (removed on drop).
pub(crate) struct ProcTree {
    dir: TempDir,
}

impl ProcTree {
    /// An empty `/proc`.
    pub(crate) fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("create proc fixture dir"),
        }
    }

    /// The root to pass as `proc_root`.
    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Adds thread `tid` of `pid` named `comm`, last run on `cpu`: a full
    /// 52-field stat line shaped like the kernel's.
    pub(crate) fn thread(self, pid: i32, tid: i32, comm: &str, cpu: usize) -> Self {
        let line = stat_line(tid, comm, cpu);
        write_file(self.path(), &format!("{pid}/task/{tid}/stat"), &line);
        self
    }

    /// Writes raw contents as the stat file of `pid`'s thread `tid`.
    pub(crate) fn raw(self, pid: i32, tid: i32, contents: &str) -> Self {
        write_file(self.path(), &format!("{pid}/task/{tid}/stat"), contents);
        self
    }
}

/// A stat line: `tid (comm) S` then fields 4..=52, with field 39 = `cpu`.
pub(crate) fn stat_line(tid: i32, comm: &str, cpu: usize) -> String {
    let mut fields: Vec<String> = (4..=52).map(|i| (i * 7).to_string()).collect();
    // Field n is at index n - 4.
    fields[39 - 4] = cpu.to_string();
    format!("{tid} ({comm}) S {}\n", fields.join(" "))
}

fn write_file(root: &Path, rel: &str, contents: &str) {
    let path = root.join(rel);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("create fixture dir");
    }
    fs::write(&path, contents).expect("write fixture file");
}
