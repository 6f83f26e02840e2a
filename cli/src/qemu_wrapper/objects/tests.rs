use super::*;

const LIBVIRT_FILE: &str = r#"{"qom-type":"memory-backend-file","id":"ram-node0","mem-path":"/dev/hugepages-1G/libvirt/qemu/1-hm1","share":true,"prealloc":true,"size":1073741824,"host-nodes":[0],"policy":"bind","prealloc-context":"tc-ram-node0"}"#;

fn hugetlb_dir() -> Option<PathInfo> {
    Some(PathInfo {
        hugetlbfs: true,
        block_size: 1 << 30,
        is_dir: true,
    })
}

fn take(text: &str, info: Option<PathInfo>) -> Take {
    match classify(&QemuObject::parse(text).expect("parse"), info).expect("classify") {
        Decision::Take(t) => t,
        other => panic!("{text}: {other:?}"),
    }
}

fn unsupported(text: &str, info: Option<PathInfo>) -> String {
    match classify(&QemuObject::parse(text).expect("parse"), info) {
        Err(e @ ObjectError::Unsupported { .. }) => e.to_string(),
        other => panic!("{text}: {other:?}"),
    }
}

#[test]
fn libvirt_9_json_file_backend_is_taken_and_rewritten() {
    let obj = QemuObject::parse(LIBVIRT_FILE).expect("parse");
    assert_eq!(obj.syntax, Syntax::Json);
    // Round trip keeps libvirt's order.
    assert_eq!(obj.to_arg(), LIBVIRT_FILE);
    let t = take(LIBVIRT_FILE, hugetlb_dir());
    assert_eq!(
        (t.id.as_str(), t.size, t.page_size, t.node),
        ("ram-node0", 1 << 30, 1 << 30, Some(0))
    );
    assert_eq!(
        t.dropped,
        ["prealloc", "host-nodes", "policy", "prealloc-context"]
    );
    assert_eq!(
        t.rewrite(Syntax::Json, "/dev/fd/5").to_arg(),
        r#"{"qom-type":"memory-backend-file","id":"ram-node0","mem-path":"/dev/fd/5","share":true,"size":1073741824}"#
    );
}

#[test]
fn keyval_backends() {
    let text = "memory-backend-file,id=ram,,0,mem-path=/dev/hugepages-2M/libvirt/qemu/1-x,prealloc=on,size=2G,host-nodes=1,policy=bind,merge=off";
    let obj = QemuObject::parse(text).expect("parse");
    assert_eq!(obj.syntax, Syntax::KeyVal);
    assert_eq!(obj.id(), "ram,0");
    assert_eq!(obj.to_arg(), text);
    let t = take(
        text,
        Some(PathInfo {
            hugetlbfs: true,
            block_size: 2 << 20,
            is_dir: true,
        }),
    );
    assert_eq!((t.size, t.page_size, t.node), (2 << 30, 2 << 20, Some(1)));
    assert_eq!(
        t.rewrite(Syntax::KeyVal, "/dev/fd/7").to_arg(),
        "memory-backend-file,id=ram,,0,mem-path=/dev/fd/7,share=on,merge=off,size=2147483648"
    );
    // memfd with hugetlb (libvirt <source type='memfd'/>), no host node.
    let t = take(
        r#"{"qom-type":"memory-backend-memfd","id":"pc.ram","hugetlb":true,"hugetlbsize":1073741824,"share":true,"prealloc":true,"size":2147483648}"#,
        None,
    );
    assert_eq!((t.size, t.page_size, t.node), (2 << 30, 1 << 30, None));
    let t = take(
        "qom-type=memory-backend-memfd,id=m,hugetlb=yes,hugetlbsize=2M,size=64M,host-nodes=0-0,policy=preferred",
        None,
    );
    assert_eq!((t.size, t.page_size, t.node), (64 << 20, 2 << 20, Some(0)));
}

#[test]
fn backends_without_huge_pages_are_left_alone() {
    for (text, info) in [
        (
            r#"{"qom-type":"memory-backend-ram","id":"pc.ram","size":1073741824}"#,
            None,
        ),
        ("memory-backend-memfd,id=m,size=1G,share=on", None),
        (
            r#"{"qom-type":"memory-backend-file","id":"ram-node0","mem-path":"/var/lib/libvirt/qemu/ram/1-x/ram-node0","share":true,"size":1073741824}"#,
            Some(PathInfo {
                hugetlbfs: false,
                block_size: 4096,
                is_dir: false,
            }),
        ),
    ] {
        let obj = QemuObject::parse(text).expect("parse");
        assert!(
            matches!(classify(&obj, info), Ok(Decision::Leave(_))),
            "{text}"
        );
    }
    let obj = QemuObject::parse(r#"{"qom-type":"secret","id":"s","data":"x"}"#).expect("parse");
    assert_eq!(classify(&obj, None), Ok(Decision::Other));
}

#[test]
fn what_the_daemon_cannot_stand_in_for_is_refused() {
    let with = |extra: &str| LIBVIRT_FILE.replace(r#""share":true"#, extra);
    for (text, info, what) in [
        (
            with(r#""share":true,"discard-data":true"#),
            hugetlb_dir(),
            "discard-data",
        ),
        (with(r#""share":false"#), hugetlb_dir(), "private mapping"),
        (with(r#""share":true,"pmem":true"#), hugetlb_dir(), "pmem"),
        (
            with(r#""share":true,"readonly":true"#),
            hugetlb_dir(),
            "readonly",
        ),
        (
            LIBVIRT_FILE.replace("[0]", "[0,1]"),
            hugetlb_dir(),
            "host nodes [0, 1]",
        ),
        (
            LIBVIRT_FILE.to_string(),
            Some(PathInfo {
                hugetlbfs: true,
                block_size: 1 << 30,
                is_dir: false,
            }),
            "chosen for its contents",
        ),
        (LIBVIRT_FILE.to_string(), None, "cannot stat"),
        (
            LIBVIRT_FILE.replace("1073741824", "1073745920"),
            hugetlb_dir(),
            "whole number",
        ),
        (
            r#"{"qom-type":"memory-backend-epc","id":"e","size":1048576}"#.to_string(),
            None,
            "memory-backend-epc",
        ),
    ] {
        let msg = unsupported(&text, info);
        assert!(msg.contains(what), "{what} not in {msg}");
        assert!(msg.contains("not started"), "{msg}");
    }
    // discard-data=false is what QEMU does anyway.
    let t = take(&with(r#""share":true,"discard-data":false"#), hugetlb_dir());
    assert_eq!(t.size, 1 << 30);
}

#[test]
fn bad_values_and_syntax() {
    assert!(QemuObject::parse("{not json").is_err());
    assert!(QemuObject::parse("memory-backend-ram,id=x,oops").is_err());
    let obj = QemuObject::parse("memory-backend-file,id=x,size=lots").expect("parse");
    assert!(matches!(
        obj.size("size"),
        Err(ObjectError::BadValue { .. })
    ));
    let obj = QemuObject::parse("memory-backend-file,id=x,share=maybe").expect("parse");
    assert!(obj.bool("share").is_err());
    let obj = QemuObject::parse("memory-backend-file,id=x,host-nodes=3-1").expect("parse");
    assert!(obj.nodes("host-nodes").is_err());
    let obj = QemuObject::parse("memory-backend-file,host-nodes=0,host-nodes=2-3").expect("parse");
    assert_eq!(obj.nodes("host-nodes"), Ok(vec![0, 2, 3]));
}

#[test]
fn device_drivers() {
    assert_eq!(
        device_driver(r#"{"driver":"virtio-mem-pci","memdev":"memvirtiomem0","id":"virtiomem0"}"#)
            .as_deref(),
        Some("virtio-mem-pci")
    );
    assert_eq!(
        device_driver("isa-debug-exit,iobase=0x501").as_deref(),
        Some("isa-debug-exit")
    );
    assert_eq!(
        device_driver("driver=virtio-mem-pci,memdev=m").as_deref(),
        Some("virtio-mem-pci")
    );
}
