use super::*;
use std::ffi::OsStr;
use std::path::PathBuf;

use hugemem_client::proto::{AllocPart, PagePolicy};

#[test]
fn detects_vmms() {
    assert_eq!(
        Vmm::detect(OsStr::new("/usr/bin/cloud-hypervisor")),
        Some(Vmm::CloudHypervisor)
    );
    assert_eq!(
        Vmm::detect(OsStr::new("cloud-hypervisor-static")),
        Some(Vmm::CloudHypervisor)
    );
    assert_eq!(
        Vmm::detect(OsStr::new("qemu-system-x86_64")),
        Some(Vmm::Qemu)
    );
    assert_eq!(
        Vmm::detect(OsStr::new("/opt/qemu/bin/qemu-system-aarch64")),
        Some(Vmm::Qemu)
    );
    assert_eq!(Vmm::detect(OsStr::new("qemu-kvm")), Some(Vmm::Qemu));
    assert_eq!(Vmm::detect(OsStr::new("firecracker")), None);
    assert_eq!(Vmm::detect(OsStr::new("/usr/bin/qemu-img")), None);
    assert_eq!(Vmm::parse("ch"), Some(Vmm::CloudHypervisor));
    assert_eq!(Vmm::parse("qemu"), Some(Vmm::Qemu));
    assert_eq!(Vmm::parse("xen"), None);
}

#[test]
fn parses_nodes() {
    assert_eq!(
        parse_nodes("0:2G,1:2G"),
        Ok(vec![
            AllocPart {
                node: 0,
                size: 2 << 30
            },
            AllocPart {
                node: 1,
                size: 2 << 30
            }
        ])
    );
    assert_eq!(
        parse_nodes("3:512M"),
        Ok(vec![AllocPart {
            node: 3,
            size: 512 << 20
        }])
    );
    for bad in [
        "",
        "0",
        "0:",
        "x:1G",
        "0:0",
        "0:1X",
        "4294967295:1G",
        "0:1G,",
    ] {
        assert!(parse_nodes(bad).is_err(), "{bad:?}");
    }
    // Two regions on one node.
    let two = parse_nodes("0:1G,0:1G").expect("one node twice");
    assert_eq!(two.len(), 2);
    assert!(two.iter().all(|p| p.node == 0 && p.size == 1 << 30));
}

/// A launch of QEMU with every option at its default (other tests start from it).
pub(crate) fn cfg() -> LaunchConfig {
    LaunchConfig {
        restore: None,
        on_demand: false,
        clone_of: None,
        clone_mode: hugemem_client::proto::CloneMode::Copy,
        copy_eager: false,
        socket: PathBuf::from("/tmp/s"),
        size: None,
        node: None,
        nodes: Vec::new(),
        page_policy: PagePolicy::Best,
        hugetlbfs: false,
        alloc_wait: None,
        lock: false,
        guest_numa: false,
        reattach_timeout: DEFAULT_REATTACH_TIMEOUT,
        control: None,
        update_timeout: crate::launch::DEFAULT_UPDATE_TIMEOUT,
        vmm: None,
        command: vec!["qemu-system-x86_64".into()],
    }
}

#[test]
fn alloc_requests_from_options() {
    let r = LaunchConfig {
        size: Some(4 << 30),
        ..cfg()
    }
    .alloc_request()
    .expect("size");
    assert_eq!(
        (r.total_size, r.parts.len(), r.want_paths),
        (4 << 30, 0, false)
    );
    let r = LaunchConfig {
        size: Some(2 << 30),
        node: Some(1),
        hugetlbfs: true,
        ..cfg()
    }
    .alloc_request()
    .expect("node");
    assert_eq!(
        r.parts,
        vec![AllocPart {
            node: 1,
            size: 2 << 30
        }]
    );
    assert!(r.want_paths);
    let nodes = parse_nodes("0:1G,1:3G").expect("nodes");
    let r = LaunchConfig {
        nodes: nodes.clone(),
        ..cfg()
    }
    .alloc_request()
    .expect("nodes");
    assert_eq!(r.total_size, 4 << 30);
    assert!(LaunchConfig {
        nodes: nodes.clone(),
        size: Some(4 << 30),
        ..cfg()
    }
    .alloc_request()
    .is_ok());
    for bad in [
        LaunchConfig {
            nodes: nodes.clone(),
            size: Some(2 << 30),
            ..cfg()
        },
        LaunchConfig {
            nodes,
            node: Some(0),
            size: Some(4 << 30),
            ..cfg()
        },
        LaunchConfig {
            node: Some(0),
            ..cfg()
        },
        cfg(),
        LaunchConfig {
            size: Some(0),
            ..cfg()
        },
    ] {
        assert!(
            matches!(bad.alloc_request(), Err(LaunchError::Options(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn page_policies() {
    assert_eq!(parse_page_policy("best"), Some(PagePolicy::Best));
    assert_eq!(parse_page_policy("1G"), Some(PagePolicy::Huge1G));
    assert_eq!(parse_page_policy("2m"), Some(PagePolicy::Huge2M));
    assert_eq!(parse_page_policy("4K"), Some(PagePolicy::Base4K));
    assert_eq!(parse_page_policy("3M"), None);
}

#[test]
fn option_names() {
    assert_eq!(option_name("--memory"), Some("memory"));
    assert_eq!(option_name("--memory=size=1G"), Some("memory"));
    assert_eq!(option_name("-m"), Some("m"));
    assert_eq!(option_name("--m"), Some("m"));
    assert_eq!(option_name("-"), None);
    assert_eq!(option_name("--"), None);
    assert_eq!(option_name("size=1G"), None);
}

#[test]
fn memory_file_paths() {
    assert_eq!(MemoryFile::Fd(7).vmm_path(), "/dev/fd/7");
    assert_eq!(
        MemoryFile::Path("/dev/hugepages-1G/a".into()).vmm_path(),
        "/dev/hugepages-1G/a"
    );
}
