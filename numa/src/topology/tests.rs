//! Tests of reading the NUMA topology, on a fixture `/sys` tree.

use super::*;
use test_support::fixture::SysTree as Tree;

const KB: u64 = 1024;

#[test]
fn cpulist_valid() {
    assert_eq!(parse_cpulist("").expect("empty"), Vec::<usize>::new());
    assert_eq!(
        parse_cpulist("\n").expect("newline only"),
        Vec::<usize>::new()
    );
    assert_eq!(parse_cpulist("0").expect("single"), vec![0]);
    assert_eq!(parse_cpulist("0-3").expect("range"), vec![0, 1, 2, 3]);
    assert_eq!(parse_cpulist("5-5").expect("unit range"), vec![5]);
    assert_eq!(
        parse_cpulist("0-3,8,10-11\n").expect("mixed"),
        vec![0, 1, 2, 3, 8, 10, 11]
    );
    assert_eq!(parse_cpulist("8,0-1").expect("unordered"), vec![0, 1, 8]);
    assert_eq!(parse_cpulist("1,1,0-1").expect("dup"), vec![0, 1]);
    assert_eq!(parse_cpulist("1048575").expect("max id"), vec![1_048_575]);
}

#[test]
fn cpulist_invalid() {
    for bad in [
        "3-1",
        "a",
        "1,,2",
        ",",
        "1,",
        ",1",
        "-",
        "1-",
        "-1",
        "0-3-5",
        " 1",
        "1 ",
        "+1",
        "0-7:2",
        "1\n\n",
        "0x1",
        "1048576",
        "0-4294967295",
        "99999999999999999999999",
    ] {
        match parse_cpulist(bad) {
            Err(TopologyError::Cpulist(s)) => assert_eq!(s, bad),
            other => panic!("{bad:?} gave {other:?}"),
        }
    }
}

#[test]
fn one_node() {
    let tree = Tree::new().cpu_online("0-1").node(
        0,
        "0-1",
        24_570_000,
        &[10],
        &[(2048, 8, 6, 1), (1_048_576, 4, 3, 0)],
    );
    let topo = tree.parse(Topology::from_sysfs);
    assert_eq!(topo.nodes().len(), 1);
    let n = topo.node(0).expect("node 0");
    assert_eq!(n.id, 0);
    assert_eq!(n.cpus, vec![0, 1]);
    assert!(n.offline_cpus.is_empty());
    assert_eq!(n.mem_total, 24_570_000 * KB);
    assert_eq!(n.mem_free, Tree::mem_free_kb(24_570_000) * KB);
    assert!(!n.is_memoryless());
    assert_eq!(n.distances, vec![10]);
    assert_eq!(
        n.huge_pages,
        vec![
            HugePagePool {
                page_size: 2 << 20,
                total: 8,
                free: 6,
                surplus: 1
            },
            HugePagePool {
                page_size: 1 << 30,
                total: 4,
                free: 3,
                surplus: 0
            },
        ]
    );
    assert_eq!(n.huge_pool(crate::HUGE_PAGE_1G).map(|p| p.free), Some(3));
    assert_eq!(n.huge_pool(crate::HUGE_PAGE_2M).map(|p| p.total), Some(8));
    assert_eq!(n.huge_pool(64 * KB), None);
    assert_eq!(topo.distance(0, 0), Some(10));
    assert_eq!(topo.distance(0, 1), None);
    assert_eq!(topo.node_of_cpu(1), Some(0));
    assert_eq!(topo.node_of_cpu(2), None);
}

#[test]
fn two_nodes() {
    let tree = Tree::new()
        .cpu_online("0-7")
        .node_online("0-1")
        .node(0, "0-3", 1000, &[10, 21], &[(2048, 2, 2, 0)])
        .node(1, "4-7", 2000, &[21, 10], &[(2048, 0, 0, 0)]);
    let topo = tree.parse(Topology::from_sysfs);
    let ids: Vec<_> = topo.nodes().iter().map(|n| n.id).collect();
    assert_eq!(ids, vec![0, 1]);
    assert_eq!(topo.node(1).expect("node 1").cpus, vec![4, 5, 6, 7]);
    assert_eq!(topo.node(1).expect("node 1").mem_total, 2000 * KB);
    assert_eq!(topo.distance(0, 1), Some(21));
    assert_eq!(topo.distance(1, 0), Some(21));
    assert_eq!(topo.distance(1, 1), Some(10));
    assert_eq!(topo.node_of_cpu(3), Some(0));
    assert_eq!(topo.node_of_cpu(4), Some(1));
    assert_eq!(topo.node_of_cpu(8), None);
    let pool = topo
        .node(1)
        .expect("node 1")
        .huge_pool(crate::HUGE_PAGE_2M)
        .copied();
    assert_eq!(
        pool,
        Some(HugePagePool {
            page_size: 2 << 20,
            total: 0,
            free: 0,
            surplus: 0
        })
    );
}

#[test]
fn four_nodes_without_online_file_sorted_by_id() {
    // Written out of order, and node 10 > node 2 numerically but not lexically.
    let d = |i: u32| -> Vec<u32> {
        (0..4)
            .map(|j| if i == j { 10 } else { 20 + i + j })
            .collect()
    };
    let tree = Tree::new()
        .cpu_online("0-15")
        .node(10, "12-15", 4000, &d(3), &[])
        .node(2, "8-11", 3000, &d(2), &[])
        .node(0, "0-3", 1000, &d(0), &[])
        .node(1, "4-7", 2000, &d(1), &[]);
    let topo = tree.parse(Topology::from_sysfs);
    let ids: Vec<_> = topo.nodes().iter().map(|n| n.id).collect();
    assert_eq!(ids, vec![0, 1, 2, 10]);
    assert_eq!(topo.distance(0, 10), Some(23));
    assert_eq!(topo.distance(10, 2), Some(25));
    assert_eq!(topo.distance(2, 2), Some(10));
    assert_eq!(topo.distance(1, 2), Some(23));
    assert_eq!(topo.distance(3, 0), None);
    assert_eq!(topo.node_of_cpu(13), Some(10));
    assert_eq!(topo.node_of_cpu(9), Some(2));
    for n in topo.nodes() {
        assert_eq!(n.distances.len(), 4);
        assert!(n.huge_pages.is_empty());
    }
}

#[test]
fn offline_cpu_is_split_out() {
    let tree = Tree::new()
        .cpu_online("0,2-3")
        .node(0, "0-1", 1000, &[10, 20], &[])
        .node(1, "2-3", 1000, &[20, 10], &[]);
    let topo = tree.parse(Topology::from_sysfs);
    let n0 = topo.node(0).expect("node 0");
    assert_eq!(n0.cpus, vec![0]);
    assert_eq!(n0.offline_cpus, vec![1]);
    assert_eq!(topo.node(1).expect("node 1").cpus, vec![2, 3]);
    assert!(topo.node(1).expect("node 1").offline_cpus.is_empty());
    // An offline CPU still belongs to its node.
    assert_eq!(topo.node_of_cpu(1), Some(0));
}

#[test]
fn memoryless_cpuless_node_and_missing_hugepages_dir() {
    let tree = Tree::new()
        .cpu_online("0-1")
        .node(0, "0-1", 8000, &[10, 17], &[(2048, 1, 1, 0)])
        .node(1, "", 0, &[17, 10], &[]);
    let topo = tree.parse(Topology::from_sysfs);
    let n1 = topo.node(1).expect("node 1");
    assert!(n1.is_memoryless());
    assert_eq!(n1.mem_total, 0);
    assert_eq!(n1.mem_free, 0);
    assert!(n1.cpus.is_empty() && n1.offline_cpus.is_empty());
    assert!(n1.huge_pages.is_empty(), "no hugepages/ dir means no pools");
    assert_eq!(n1.huge_pool(crate::HUGE_PAGE_2M), None);
    assert_eq!(topo.node(0).expect("node 0").huge_pages.len(), 1);
    assert_eq!(topo.distance(1, 0), Some(17));
}

#[test]
fn unknown_node_lists_available() {
    let tree = Tree::new()
        .cpu_online("0-3")
        .node(0, "0-1", 1, &[10, 20], &[])
        .node(1, "2-3", 1, &[20, 10], &[]);
    let topo = tree.parse(Topology::from_sysfs);
    let err = topo.node(7).expect_err("no node 7");
    match &err {
        TopologyError::UnknownNode { node, available } => {
            assert_eq!(*node, 7);
            assert_eq!(available, &vec![0, 1]);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "no NUMA node 7; this host has nodes [0, 1]"
    );
}

#[test]
fn no_numa_kernel_gives_single_node() {
    let tree = Tree::new().cpu_online("0-3");
    let topo = tree.parse(Topology::from_sysfs);
    assert_eq!(topo.nodes().len(), 1);
    let n = &topo.nodes()[0];
    assert_eq!(n.id, 0);
    assert_eq!(n.cpus, vec![0, 1, 2, 3]);
    assert_eq!(n.mem_total, 0);
    assert_eq!(n.distances, vec![10]);
    assert!(n.huge_pages.is_empty());
    // `detect()` fills memory from /proc/meminfo in this case.
    let meminfo = tree.path().join("meminfo");
    fs::write(
        &meminfo,
        "MemTotal:       16000 kB\nMemFree:         4000 kB\nMemAvailable:  8000 kB\n",
    )
    .expect("write meminfo");
    let topo = Topology::read(tree.path(), Some(&meminfo)).expect("fallback with meminfo");
    assert_eq!(topo.nodes()[0].mem_total, 16000 * KB);
    assert_eq!(topo.nodes()[0].mem_free, 4000 * KB);
}

#[test]
fn node_online_file_decides_the_nodes() {
    // node2/ exists on disk but is not online: it is ignored.
    let tree = Tree::new()
        .cpu_online("0-1")
        .node(0, "0-1", 1, &[10], &[])
        .node(2, "", 1, &[10], &[])
        .node_online("0");
    let ids: Vec<_> = tree
        .parse(Topology::from_sysfs)
        .nodes()
        .iter()
        .map(|n| n.id)
        .collect();
    assert_eq!(ids, vec![0]);
}

#[test]
fn malformed_files_are_errors() {
    // Distance row shorter than the node count.
    let tree = Tree::new()
        .cpu_online("0-1")
        .node(0, "0", 1, &[10], &[])
        .node(1, "1", 1, &[10, 20], &[]);
    let err = Topology::from_sysfs(tree.path()).expect_err("short row");
    assert!(
        matches!(&err, TopologyError::Parse { path, .. } if path.ends_with("node0/distance")),
        "{err:?}"
    );

    // Missing cpu/online.
    let tree = Tree::new().node(0, "0", 1, &[10], &[]);
    let err = Topology::from_sysfs(tree.path()).expect_err("no cpu/online");
    assert!(
        matches!(&err, TopologyError::Read { path, .. } if path.ends_with("cpu/online")),
        "{err:?}"
    );

    // Garbage cpulist.
    let tree = Tree::new().cpu_online("0-1").node(0, "1-0", 1, &[10], &[]);
    let err = Topology::from_sysfs(tree.path()).expect_err("bad cpulist");
    assert!(
        matches!(&err, TopologyError::Parse { path, .. } if path.ends_with("node0/cpulist")),
        "{err:?}"
    );

    // meminfo without MemFree, then a non-number, then a line about another node.
    let tree = Tree::new().cpu_online("0").node(0, "0", 1, &[10], &[]);
    let meminfo = tree.path().join("node/node0/meminfo");
    for (text, want) in [
        ("Node 0 MemTotal: 5 kB\n", "no MemFree"),
        (
            "Node 0 MemTotal: x kB\nNode 0 MemFree: 1 kB\n",
            "bad number",
        ),
        ("Node 0 MemTotal: 5\nNode 0 MemFree: 1 kB\n", "<number> kB"),
        (
            "Node 1 MemTotal: 5 kB\nNode 1 MemFree: 1 kB\n",
            "not about node 0",
        ),
    ] {
        fs::write(&meminfo, text).expect("write meminfo");
        let err = Topology::from_sysfs(tree.path()).expect_err(text);
        assert!(err.to_string().contains(want), "{text:?}: {err}");
    }

    // A non-number in a hugepage counter.
    let tree = Tree::new()
        .cpu_online("0")
        .node(0, "0", 1, &[10], &[(2048, 1, 1, 0)]);
    fs::write(
        tree.path()
            .join("node/node0/hugepages/hugepages-2048kB/free_hugepages"),
        "many\n",
    )
    .expect("write");
    let err = Topology::from_sysfs(tree.path()).expect_err("bad count");
    assert!(
        matches!(&err, TopologyError::Parse { path, .. } if path.ends_with("free_hugepages")),
        "{err:?}"
    );
}

#[test]
fn unexpected_hugepages_entries_are_skipped() {
    let tree = Tree::new()
        .cpu_online("0")
        .node(0, "0", 1, &[10], &[(2048, 1, 1, 0)]);
    fs::create_dir_all(tree.path().join("node/node0/hugepages/README")).expect("mkdir");
    let topo = tree.parse(Topology::from_sysfs);
    assert_eq!(topo.nodes()[0].huge_pages.len(), 1);
}
