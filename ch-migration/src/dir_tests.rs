use std::path::Path;

use super::ch_snapshot_dir::{read_ch_snapshot_dir, RangePiece};
use super::layout::SnapshotDirError;
use super::offload_dir::*;
use super::Limits;
use crate::fixtures::{config, mapping};

const MIB: u64 = 1 << 20;

fn hostile(dir: &Path, cfg: &[u8], sizes: &[(u32, u64)]) -> Result<OffloadDir, SnapshotDirError> {
    std::fs::create_dir(dir).expect("mkdir");
    std::fs::write(dir.join(MIGRATION_CONFIG_FILE), cfg).expect("write");
    std::fs::write(dir.join(STATE_FILE), b"{}").expect("write");
    for (slot, size) in sizes {
        let f = std::fs::File::create(dir.join(memory_slot_filename(*slot))).expect("create");
        f.set_len(*size).expect("size");
    }
    read_offload_dir(dir, Limits::default())
}

#[test]
fn a_hostile_directory_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let d = |n: &str| tmp.path().join(n);
    let one = config(&mapping(0, 0, MIB, 0));
    assert!(hostile(&d("ok"), &one, &[(0, MIB)]).is_ok());
    assert!(matches!(
        hostile(&d("size"), &one, &[(0, MIB + 4096)]),
        Err(SnapshotDirError::Invalid(_))
    ));
    assert!(matches!(
        hostile(&d("missing"), &one, &[]),
        Err(SnapshotDirError::Io { .. })
    ));
    let mut big = one.clone();
    big.resize((1 << 20) + 1, b' ');
    assert!(matches!(
        hostile(&d("big"), &big, &[(0, MIB)]),
        Err(SnapshotDirError::TooLarge { .. })
    ));
    let unaligned = config(&mapping(0, 0x800, MIB, 0));
    assert!(matches!(
        hostile(&d("unaligned"), &unaligned, &[(0, MIB)]),
        Err(SnapshotDirError::Slot(_))
    ));
    let many: Vec<String> = (0..65)
        .map(|i| mapping(i, u64::from(i) * MIB, MIB, 0))
        .collect();
    assert!(hostile(&d("many"), &config(&many.join(",")), &[]).is_err());
    let no_field = config(r#"{"slot":0,"gpa":0,"size":4096}"#);
    assert!(matches!(
        hostile(&d("field"), &no_field, &[]),
        Err(SnapshotDirError::Field {
            field: "file_offset",
            ..
        })
    ));
    assert!(hostile(&d("json"), b"{not json", &[]).is_err());
    // A memory file that is a link to elsewhere is not followed.
    std::fs::create_dir(d("link")).expect("mkdir");
    std::fs::write(d("link").join(MIGRATION_CONFIG_FILE), &one).expect("write");
    std::fs::write(d("link").join(STATE_FILE), b"{}").expect("write");
    std::os::unix::fs::symlink(d("ok").join("memory-0"), d("link").join("memory-0"))
        .expect("symlink");
    assert!(read_offload_dir(&d("link"), Limits::default()).is_err());
    // Nor does a FIFO in a file's place make the read wait for a writer.
    std::fs::create_dir(d("fifo")).expect("mkdir");
    std::fs::write(d("fifo").join(MIGRATION_CONFIG_FILE), &one).expect("write");
    nix::unistd::mkfifo(&d("fifo").join(STATE_FILE), nix::sys::stat::Mode::S_IRWXU)
        .expect("mkfifo");
    assert!(matches!(
        read_offload_dir(&d("fifo"), Limits::default()),
        Err(SnapshotDirError::NotAFile(_))
    ));
}

/// A cloud-hypervisor snapshot directory's three files, by hand.
fn ch_dir(dir: &Path, ranges: &str, mappings: &str, memory_len: u64) {
    std::fs::create_dir(dir).expect("mkdir");
    std::fs::write(dir.join("config.json"), br#"{"cpus":{"boot_vcpus":1}}"#).expect("write");
    let mm =
        format!(r#"{{"memory_ranges":{{"data":[{ranges}]}},"guest_ram_mappings":[{mappings}]}}"#);
    let vm = r#"{"common_cpuid":[{"function":0}]}"#;
    let state = serde_json::json!({
        "snapshots": {"memory-manager": {"snapshots": {}, "snapshot_data": {"state": mm}}},
        "snapshot_data": {"state": vm},
    });
    std::fs::write(dir.join("state.json"), state.to_string()).expect("write");
    let f = std::fs::File::create(dir.join("memory-ranges")).expect("create");
    f.set_len(memory_len).expect("size");
}

#[test]
fn a_cloud_hypervisor_snapshot_converts_to_a_migration() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("ch");
    // Slot 0 in two ranges, slot 1 in one, stored as: slot 1, then slot 0's parts.
    ch_dir(
        &dir,
        &format!(
            r#"{{"gpa":{},"length":{}}},{{"gpa":0,"length":{}}},{{"gpa":{},"length":{}}}"#,
            0x1_0000_0000u64,
            2 * MIB,
            MIB,
            MIB,
            MIB
        ),
        &format!(
            "{},{}",
            mapping(0, 0, 2 * MIB, 0),
            mapping(1, 0x1_0000_0000, 2 * MIB, 0)
        ),
        4 * MIB,
    );
    let got = read_ch_snapshot_dir(&dir, Limits::default()).expect("convert");
    let config: serde_json::Value = serde_json::from_slice(&got.migration_config).expect("json");
    assert_eq!(config["vm_config"]["cpus"]["boot_vcpus"], 1);
    assert_eq!(config["common_cpuid"][0]["function"], 0);
    assert!(config["memory_manager_data"]["guest_ram_mappings"].is_array());
    assert_eq!(
        got.slots[0].pieces,
        vec![
            RangePiece {
                offset_in_slot: 0,
                length: MIB,
                file_offset: 2 * MIB
            },
            RangePiece {
                offset_in_slot: MIB,
                length: MIB,
                file_offset: 3 * MIB
            },
        ]
    );
    assert_eq!(
        got.slots[1].pieces,
        vec![RangePiece {
            offset_in_slot: 0,
            length: 2 * MIB,
            file_offset: 0
        }]
    );
    assert_eq!(
        got.state,
        std::fs::read(dir.join("state.json")).expect("read")
    );
}

#[test]
fn a_cloud_hypervisor_snapshot_missing_a_slot_or_bytes_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let r = |gpa: u64, len: u64| format!(r#"{{"gpa":{gpa},"length":{len}}}"#);
    ch_dir(
        &tmp.path().join("short"),
        &r(0, MIB),
        &mapping(0, 0, 2 * MIB, 0),
        MIB,
    );
    ch_dir(
        &tmp.path().join("len"),
        &r(0, 2 * MIB),
        &mapping(0, 0, 2 * MIB, 0),
        MIB,
    );
    ch_dir(
        &tmp.path().join("overlap"),
        &format!("{},{}", r(0, 2 * MIB), r(MIB, MIB)),
        &mapping(0, 0, 2 * MIB, 0),
        3 * MIB,
    );
    for name in ["short", "len", "overlap"] {
        assert!(
            matches!(
                read_ch_snapshot_dir(&tmp.path().join(name), Limits::default()),
                Err(SnapshotDirError::Invalid(_))
            ),
            "{name}"
        );
    }
}

#[test]
fn zones_are_declared_hugetlb_without_their_stale_path() {
    use super::layout::with_hugetlb_zones;
    let config = br#"{"vm_config":{"memory":{"size":0,"hugepages":false,"zones":[
        {"id":"hugemem0","size":134217728,"file":"/dev/fd/5","shared":true,"hugepages":false}]}},
        "memory_manager_data":{}}"#;
    let out: serde_json::Value =
        serde_json::from_slice(&with_hugetlb_zones(config, 2 * MIB).expect("rewrite"))
            .expect("json");
    let zone = &out["vm_config"]["memory"]["zones"][0];
    assert_eq!(zone["hugepages"], true);
    assert_eq!(zone["hugepage_size"], 2 * MIB);
    assert!(zone["file"].is_null());
    assert_eq!(zone["shared"], true);
    assert_eq!(
        out["vm_config"]["memory"]["hugepages"], false,
        "size=0: no zone-less memory"
    );
    let plain = br#"{"vm_config":{"memory":{"size":134217728,"shared":true}}}"#;
    let out: serde_json::Value =
        serde_json::from_slice(&with_hugetlb_zones(plain, 2 * MIB).expect("rewrite"))
            .expect("json");
    assert_eq!(out["vm_config"]["memory"]["hugepage_size"], 2 * MIB);
    assert!(with_hugetlb_zones(b"{}", 2 * MIB).is_err());
}
