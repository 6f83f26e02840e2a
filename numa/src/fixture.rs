//! Test-only builder for fake `/sys/devices/system` trees.
//!
//! ```ignore
//! let tree = Tree::new()
//!     .cpu_online("0-3")
//!     .node(0, "0-1", 1_000_000, &[10, 20], &[(2048, 8, 8, 0), (1_048_576, 1, 1, 0)])
//!     .node(1, "2-3", 1_000_000, &[20, 10], &[]);
//! let topo = tree.topology();
//! ```
//!
//! Each call writes its files at once. A node with no pools gets no
//! `hugepages/` directory, like a kernel without hugetlb.

use std::fs;
use std::path::Path;

use tempfile::TempDir;

use crate::topology::{NodeId, Topology};

/// A fake sysfs root in a temporary directory (removed on drop).
pub(crate) struct Tree {
    dir: TempDir,
}

impl Tree {
    /// An empty tree: no `cpu/online`, no `node/`.
    pub(crate) fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("create fixture tempdir"),
        }
    }

    /// The root to pass to `Topology::from_sysfs`.
    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `MemFree` the fixture writes for a node of `mem_kb` kB.
    pub(crate) fn mem_free_kb(mem_kb: u64) -> u64 {
        mem_kb / 4
    }

    /// Writes `cpu/online`.
    pub(crate) fn cpu_online(self, list: &str) -> Self {
        self.write("cpu/online", &format!("{list}\n"));
        self
    }

    /// Writes `node/online`.
    pub(crate) fn node_online(self, list: &str) -> Self {
        self.write("node/online", &format!("{list}\n"));
        self
    }

    /// Writes `node/node<id>/{cpulist,meminfo,distance}` and, when `pools` is
    /// not empty, `hugepages/hugepages-<kB>kB/{nr,free,surplus}_hugepages` for
    /// each `(size_kb, total, free, surplus)`.
    pub(crate) fn node(
        self,
        id: NodeId,
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

    /// Parses the tree, panicking with the error if it does not parse.
    pub(crate) fn topology(&self) -> Topology {
        Topology::from_sysfs(self.path()).expect("fixture tree parses")
    }

    /// Writes `rel` under the root, creating parent directories.
    fn write(&self, rel: &str, contents: &str) {
        let path = self.path().join(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("create fixture dir");
        }
        fs::write(&path, contents).expect("write fixture file");
    }
}
