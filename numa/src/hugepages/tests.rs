//! The fixture is a `/sys` + `/proc` tree in a temporary directory, and a
//! write hook that does to it what the kernel does to the real one: a
//! node gives at most `capacity` pages (a fixture-only file standing for
//! the contiguous memory the node has), pages in use are never taken away,
//! the host-wide pool is the sum of the nodes' pools, and a write to
//! `compact_memory` raises a node's capacity to its `capacity_compacted`.

use super::*;
use tempfile::TempDir;

const G: u64 = 1 << 30;
const M2: u64 = 2 << 20;

struct Fixture {
    dir: TempDir,
}

fn write(path: &Path, value: impl ToString) {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("fixture dir");
    }
    fs::write(path, format!("{}\n", value.to_string())).expect("fixture file");
}

fn num(path: &Path) -> u64 {
    read_count(path).expect("fixture number")
}

impl Fixture {
    fn new() -> Self {
        let f = Self {
            dir: tempfile::tempdir().expect("tempdir"),
        };
        write(&f.proc().join("mounts"), "proc /proc proc rw 0 0");
        write(&f.proc().join("sys/vm/compact_memory"), "");
        write(&f.proc().join("sys/vm/drop_caches"), "");
        f
    }
    fn sys(&self) -> PathBuf {
        self.dir.path().join("sys")
    }
    fn proc(&self) -> PathBuf {
        self.dir.path().join("proc")
    }
    fn host_pool(&self, size: u64) -> PathBuf {
        self.sys()
            .join(format!("kernel/mm/hugepages/hugepages-{}kB", size / 1024))
    }
    fn node_pool(&self, node: NodeId, size: u64) -> PathBuf {
        self.sys().join(format!(
            "devices/system/node/node{node}/hugepages/hugepages-{}kB",
            size / 1024
        ))
    }
    /// Adds node `id`'s pool of `size`: `total` pages of which `in_use`
    /// are mapped; the kernel can give `capacity` pages, or
    /// `capacity_compacted` after compaction.
    fn pool(
        self,
        id: NodeId,
        size: u64,
        total: u64,
        in_use: u64,
        capacity: u64,
        capacity_compacted: u64,
    ) -> Self {
        let dir = self.node_pool(id, size);
        write(&dir.join("nr_hugepages"), total);
        write(&dir.join("free_hugepages"), total - in_use);
        write(&dir.join("surplus_hugepages"), 0);
        write(&dir.join("capacity"), capacity);
        write(&dir.join("capacity_compacted"), capacity_compacted);
        let host = self.host_pool(size);
        if !host.join("resv_hugepages").exists() {
            write(&host.join("resv_hugepages"), 0);
        }
        sync_host(&self.sys(), size);
        self
    }
    fn resv(self, size: u64, resv: u64) -> Self {
        write(&self.host_pool(size).join("resv_hugepages"), resv);
        self
    }
    /// The pools with the kernel model as write hook; writes are logged
    /// to `<root>/writes`, and a `<root>/deny` file makes every write
    /// fail with EACCES (an unprivileged caller).
    fn pools(&self) -> HugePages {
        let root = self.dir.path().to_owned();
        let sys = self.sys();
        let hook: WriteHook = Box::new(move |path, value| kernel_write(&root, &sys, path, value));
        HugePages::with_roots(&self.sys(), &self.proc()).with_write_hook(hook)
    }
    fn writes(&self) -> Vec<String> {
        fs::read_to_string(self.dir.path().join("writes"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

fn node_dirs(sys: &Path, size: u64) -> Vec<PathBuf> {
    let pools = HugePages::with_roots(sys, Path::new("/nonexistent"));
    pools
        .node_ids()
        .expect("node ids")
        .into_iter()
        .map(|n| {
            sys.join(format!(
                "devices/system/node/node{n}/hugepages/hugepages-{}kB",
                size / 1024
            ))
        })
        .filter(|d| d.is_dir())
        .collect()
}

fn sync_host(sys: &Path, size: u64) {
    let (mut nr, mut free) = (0, 0);
    for d in node_dirs(sys, size) {
        nr += num(&d.join("nr_hugepages"));
        free += num(&d.join("free_hugepages"));
    }
    let host = sys.join(format!("kernel/mm/hugepages/hugepages-{}kB", size / 1024));
    write(&host.join("nr_hugepages"), nr);
    write(&host.join("free_hugepages"), free);
    write(&host.join("surplus_hugepages"), 0);
}

/// Sets a node pool to `want`, within its capacity and keeping pages in use.
fn set_node(dir: &Path, want: u64) {
    let nr = num(&dir.join("nr_hugepages"));
    let in_use = nr - num(&dir.join("free_hugepages"));
    let got = want.min(num(&dir.join("capacity"))).max(in_use);
    write(&dir.join("nr_hugepages"), got);
    write(&dir.join("free_hugepages"), got - in_use);
}

fn kernel_write(root: &Path, sys: &Path, path: &Path, value: &str) -> io::Result<()> {
    if root.join("deny").exists() {
        return Err(io::Error::from_raw_os_error(libc::EACCES));
    }
    let rel = path
        .strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string();
    let mut log = fs::read_to_string(root.join("writes")).unwrap_or_default();
    log.push_str(&format!("{rel}={value}\n"));
    fs::write(root.join("writes"), log)?;
    if path.ends_with("compact_memory") {
        for size in [G, M2] {
            for d in node_dirs(sys, size) {
                fs::copy(d.join("capacity_compacted"), d.join("capacity"))?;
            }
        }
    }
    if !path.ends_with("nr_hugepages") {
        return fs::write(path, value);
    }
    let want: u64 = value
        .parse()
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let dir = path.parent().expect("pool dir");
    let kb: u64 = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| {
            n.strip_prefix("hugepages-")?
                .strip_suffix("kB")?
                .parse()
                .ok()
        })
        .expect("pool dir name");
    let size = kb * 1024;
    if dir.starts_with(sys.join("devices")) {
        set_node(dir, want);
    } else {
        let nr = num(&dir.join("nr_hugepages"));
        let mut remaining = want.abs_diff(nr);
        for d in node_dirs(sys, size) {
            let (n, free) = (num(&d.join("nr_hugepages")), num(&d.join("free_hugepages")));
            let step = if want > nr {
                remaining.min(num(&d.join("capacity")).saturating_sub(n))
            } else {
                remaining.min(free)
            };
            set_node(&d, if want > nr { n + step } else { n - step });
            remaining -= step;
        }
    }
    sync_host(sys, size);
    Ok(())
}

#[test]
fn total_mode_grows_to_the_floor_and_never_shrinks() {
    let f = Fixture::new().pool(0, M2, 4, 0, 100, 100);
    let r = f
        .pools()
        .reserve(M2, 2, None, ReserveMode::Total)
        .expect("reserve");
    assert!(r.met);
    assert_eq!((r.total_before, r.after.total), (4, 4));
    assert!(f.writes().is_empty(), "nothing to write: {:?}", f.writes());

    let r = f
        .pools()
        .reserve(M2, 10, None, ReserveMode::Total)
        .expect("reserve");
    assert!(r.met && !r.compacted);
    assert_eq!((r.after.total, r.after.free, r.shortfall()), (10, 10, 0));
    assert_eq!(
        f.writes(),
        ["sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages=10"]
    );
}

#[test]
fn free_mode_counts_reserved_pages_as_taken() {
    // 4 pages, 1 mapped, 2 of the 3 free ones promised to a mapping:
    // 1 available; 3 wanted means 2 more.
    let f = Fixture::new().pool(0, M2, 4, 1, 100, 100).resv(M2, 2);
    let before = f.pools().pool(M2, None).expect("pool");
    assert_eq!(
        (before.free, before.reserved, before.available()),
        (3, 2, 1)
    );
    let r = f
        .pools()
        .reserve(M2, 3, None, ReserveMode::Free)
        .expect("reserve");
    assert!(r.met, "{r:?}");
    assert_eq!((r.after.total, r.after.available()), (6, 3));
    // Enough available already: no write.
    let r = f
        .pools()
        .reserve(M2, 2, None, ReserveMode::Free)
        .expect("reserve");
    assert!(r.met && r.after.total == 6);
    assert_eq!(f.writes().len(), 1);
}

#[test]
fn exact_mode_shrinks_but_keeps_pages_in_use() {
    let f = Fixture::new().pool(0, M2, 8, 3, 100, 100);
    let r = f
        .pools()
        .reserve(M2, 5, None, ReserveMode::Exact)
        .expect("reserve");
    assert!(r.met);
    assert_eq!((r.after.total, r.after.free), (5, 2));
    let r = f
        .pools()
        .reserve(M2, 0, None, ReserveMode::Exact)
        .expect("reserve");
    assert!(!r.met, "3 pages are in use: {r:?}");
    assert_eq!(r.after.total, 3);
    assert_eq!(r.shortfall(), 0, "pages kept in use are no shortfall");
}

#[test]
fn a_short_node_is_compacted_retried_and_reported() {
    // Node 1 has room for 1 page of 1 GiB, 2 after compaction; 3 wanted.
    let f = Fixture::new().pool(0, G, 0, 0, 4, 4).pool(1, G, 0, 0, 1, 2);
    let r = f
        .pools()
        .reserve(G, 3, Some(1), ReserveMode::Total)
        .expect("reserve");
    assert!(r.compacted && !r.met, "{r:?}");
    assert_eq!((r.node, r.after.total, r.shortfall()), (Some(1), 2, 1));
    assert_eq!(
        r.nodes,
        [
            NodePool {
                node: 0,
                total: 0,
                free: 0,
                surplus: 0
            },
            NodePool {
                node: 1,
                total: 2,
                free: 2,
                surplus: 0
            },
        ]
    );
    let node1 = "sys/devices/system/node/node1/hugepages/hugepages-1048576kB/nr_hugepages=3";
    assert_eq!(
        f.writes(),
        [
            node1,
            "proc/sys/vm/drop_caches=3",
            "proc/sys/vm/compact_memory=1",
            node1
        ]
    );
    // Host-wide, the pages come from whichever node has room.
    let r = f
        .pools()
        .reserve(G, 5, None, ReserveMode::Total)
        .expect("reserve");
    assert!(r.met, "{r:?}");
    assert_eq!(r.nodes.iter().map(|n| n.total).collect::<Vec<_>>(), [3, 2]);
}

#[test]
fn one_gib_pages_are_reserved_first() {
    let f = Fixture::new()
        .pool(0, G, 0, 0, 2, 2)
        .pool(0, M2, 0, 0, 64, 64);
    let reports = f
        .pools()
        .reserve_all(&[(M2, 64), (G, 2)], None, ReserveMode::Total)
        .expect("reserve");
    assert_eq!(
        reports.iter().map(|r| r.page_size).collect::<Vec<_>>(),
        [G, M2]
    );
    assert!(reports.iter().all(|r| r.met));
    let writes = f.writes();
    assert!(writes[0].contains("hugepages-1048576kB"), "{writes:?}");
    assert!(writes[1].contains("hugepages-2048kB"), "{writes:?}");
}

#[test]
fn wrong_node_missing_pool_and_no_privilege_are_typed_errors() {
    let f = Fixture::new()
        .pool(0, M2, 0, 0, 8, 8)
        .pool(2, M2, 0, 0, 8, 8);
    match f.pools().reserve(M2, 1, Some(1), ReserveMode::Total) {
        Err(HugePagesError::NoSuchNode { node: 1, available }) => assert_eq!(available, [0, 2]),
        other => panic!("expected NoSuchNode, got {other:?}"),
    }
    match f.pools().reserve(G, 1, None, ReserveMode::Total) {
        Err(e @ HugePagesError::NoPool { .. }) => {
            assert!(e.to_string().contains("1048576 kB"), "{e}")
        }
        other => panic!("expected NoPool, got {other:?}"),
    }
    write(&f.dir.path().join("deny"), 1);
    match f.pools().reserve(M2, 1, Some(0), ReserveMode::Total) {
        Err(e @ HugePagesError::NotRoot { .. }) => {
            assert!(e.to_string().contains("root"), "{e}")
        }
        other => panic!("expected NotRoot, got {other:?}"),
    }
    // Nothing to change: no write, so no privilege needed.
    let r = f
        .pools()
        .reserve(M2, 0, Some(0), ReserveMode::Total)
        .expect("no-op");
    assert!(r.met);
}

#[test]
fn mounts_are_read_from_proc_and_not_mounted_twice() {
    let f = Fixture::new();
    let mount_root = f.dir.path().join("dev");
    let target = mount_root.join("hugepages-2M");
    let escaped = target.display().to_string().replace(' ', "\\040");
    write(
        &f.proc().join("mounts"),
        format!(
            "hugetlbfs {escaped} hugetlbfs rw,pagesize=2M 0 0\nhugetlbfs /x\\040y hugetlbfs rw 0 0"
        ),
    );
    let pools = f.pools();
    assert_eq!(
        pools.hugetlbfs_mounts().expect("mounts"),
        [target.clone(), PathBuf::from("/x y")]
    );
    let m = pools
        .mount_hugetlbfs(M2, &mount_root)
        .expect("already mounted");
    assert_eq!((m.path, m.state), (target, MountState::AlreadyMounted));
}

#[test]
fn size_labels() {
    assert_eq!(size_label(G), "1G");
    assert_eq!(size_label(M2), "2M");
    assert_eq!(size_label(64 << 10), "64K");
    assert_eq!(unescape_mount_path("a\\040b\\134c\\9"), "a b\\c\\9");
}
