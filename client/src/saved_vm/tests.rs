use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use super::load::with_file_offsets;
use super::manifest::{Manifest, ManifestError, MANIFEST_FILE, PIECE};
use super::*;
use ch_migration::fixtures::{memfd, parked};
use ch_migration::offload_dir::read_offload_dir;

const MIB: u64 = 1 << 20;

fn info() -> SaveInfo {
    SaveInfo {
        name: "g".into(),
        uid: 1000,
        parked_at: 1,
        page_size: 2 * MIB,
    }
}

/// The entries of `dir` (names), sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn manifest_of(dir: &Path) -> Manifest {
    Manifest::read(dir, 84 * MIB, 2, 64)
        .expect("the manifest reads")
        .expect("a save has a manifest")
}

#[test]
fn a_parked_vm_is_saved_whole_sparse_and_with_its_checksums() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("vm");
    let snapshot = parked();
    let report = write_saved_dir(&dir, &snapshot, &info(), &SaveOptions::default()).expect("save");
    assert_eq!((report.slots, report.memory_bytes), (2, 84 * MIB));
    assert_eq!(
        report.write.written,
        4096 + 8192 + 4096,
        "only the data pages"
    );
    assert_eq!(report.write.written + report.write.holes, 84 * MIB);
    assert_eq!(entries(tmp.path()), ["vm"], "no temporary left beside it");
    let back = read_offload_dir(&dir, Limits::default()).expect("read");
    assert_eq!(
        (back.config.as_slice(), back.state.as_slice()),
        (snapshot.config.as_slice(), snapshot.state.as_slice())
    );
    assert_eq!(back.slots[1].range.file_offset, 2 * MIB);
    let m0 = std::fs::File::open(dir.join("memory-0")).expect("memory-0");
    let m5 = std::fs::File::open(dir.join("memory-5")).expect("memory-5");
    let mut page = [0u8; 4096];
    m0.read_exact_at(&mut page, 70 * MIB + 4096).expect("read");
    assert_eq!(page, [0xBB; 4096]);
    m5.read_exact_at(&mut page, 4096).expect("read");
    assert_eq!(page, [0xCC; 4096], "slot 5 starts at its file offset");
    let blocks = m0.metadata().expect("stat").blocks();
    assert!(blocks * 512 < MIB, "memory-0 is sparse: {blocks} blocks");
    for name in [
        "migration_config.json",
        "state.json",
        "memory-0",
        "memory-5",
        MANIFEST_FILE,
    ] {
        let mode = std::fs::metadata(dir.join(name))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{name}");
    }
    let m = manifest_of(&dir);
    assert_eq!(
        (m.source.name.as_str(), m.page_size, m.piece_bytes),
        ("g", 2 * MIB, PIECE)
    );
    assert_eq!(m.memory_of(0).map(|f| f.crc32c.len()), Some(40));
    assert_eq!(m.memory_of(5).map(|f| f.size), Some(4 * MIB));
    let mut seen = 0;
    let checked = m
        .check_memory(&dir, &mut |b| seen = b)
        .expect("every piece matches");
    assert_eq!((checked, seen), (84 * MIB, 84 * MIB));
    assert!(matches!(
        write_saved_dir(&dir, &snapshot, &info(), &SaveOptions::default()),
        Err(SavedVmError::Dir(SnapshotDirError::NotEmpty(_)))
    ));
}

#[test]
fn a_save_that_fails_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut s = parked();
    s.memory.pop();
    let refused = write_saved_dir(&tmp.path().join("a"), &s, &info(), &SaveOptions::default());
    assert!(
        matches!(refused, Err(SavedVmError::Unsupported(_))),
        "{refused:?}"
    );
    let mut s = parked();
    s.memory.push((9, memfd(4096)));
    assert!(write_saved_dir(&tmp.path().join("b"), &s, &info(), &SaveOptions::default()).is_err());
    // An empty directory under the final name is taken, and stays when the
    // save fails.
    std::fs::create_dir(tmp.path().join("c")).expect("mkdir");
    let mut s = parked();
    s.memory.pop();
    assert!(write_saved_dir(&tmp.path().join("c"), &s, &info(), &SaveOptions::default()).is_err());
    assert_eq!(entries(tmp.path()), ["c"], "no directory, no temporary");
    assert!(entries(&tmp.path().join("c")).is_empty());
    write_saved_dir(
        &tmp.path().join("c"),
        &parked(),
        &info(),
        &SaveOptions::default(),
    )
    .expect("an empty directory takes a save");
    assert_eq!(entries(&tmp.path().join("c")).len(), 5);
}

#[test]
fn a_stale_temporary_of_a_dead_save_is_removed_and_nothing_else() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let boot: String = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .expect("boot id")
        .trim()
        .chars()
        .take(8)
        .collect();
    let make = |name: &str, files: &[&str]| {
        let d = tmp.path().join(name);
        std::fs::create_dir(&d).expect("mkdir");
        for f in files {
            std::fs::write(d.join(f), b"x").expect("write");
        }
    };
    // Another boot's save, a pid that cannot exist, a save of this
    // process that is running (its own start time), and a stale name
    // holding a file a save never writes.
    let dead_other_boot = ".vm.hugemem-save.00000000.1.1.0";
    let dead_pid = format!(".vm.hugemem-save.{boot}.4194305.7.0");
    let start = super::staging::tests_start_time();
    let alive = format!(".vm.hugemem-save.{boot}.{}.{start}.x", std::process::id());
    let foreign = ".vm.hugemem-save.00000000.2.2.0";
    make(dead_other_boot, &["memory-0", "state.json"]);
    make(&dead_pid, &["migration_config.json", MANIFEST_FILE]);
    make(&alive, &["memory-1"]);
    make(foreign, &["memory-0", "notes.txt"]);
    write_saved_dir(
        &tmp.path().join("vm"),
        &parked(),
        &info(),
        &SaveOptions::default(),
    )
    .expect("save");
    let mut want = vec![alive, foreign.to_string(), "vm".to_string()];
    want.sort();
    assert_eq!(entries(tmp.path()), want);
}

#[test]
fn damage_is_found_with_the_file_the_offset_and_both_checksums() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("vm");
    write_saved_dir(&dir, &parked(), &info(), &SaveOptions::default()).expect("save");
    let m = manifest_of(&dir);
    m.check_sizes(&dir).expect("whole");

    // A flipped byte in memory: its piece, in its file.
    let m0 = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("memory-0"))
        .expect("open");
    m0.write_all_at(&[0xBA], 70 * MIB + 5).expect("damage");
    match m.check_memory(&dir, &mut |_| {}) {
        Err(
            e @ ManifestError::Checksum {
                offset,
                len,
                expected,
                found,
                ..
            },
        ) => {
            println!("{e}");
            assert!(e.to_string().contains("memory-0"));
            assert_eq!((offset, len), (70 * MIB, PIECE));
            assert_ne!(expected, found);
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }

    // A truncated file, a missing one, a changed state.
    m0.set_len(80 * MIB - 4096).expect("truncate");
    assert!(matches!(
        m.check_sizes(&dir),
        Err(ManifestError::Size { expected, found, .. }) if expected == 80 * MIB && found == 80 * MIB - 4096
    ));
    std::fs::remove_file(dir.join("memory-5")).expect("rm");
    m0.set_len(80 * MIB).expect("size back");
    assert!(matches!(
        m.check_sizes(&dir),
        Err(ManifestError::Missing { .. })
    ));
    let state = std::fs::read(dir.join("state.json")).expect("state");
    let mut changed = state.clone();
    changed[1] ^= 1;
    assert!(matches!(
        m.check_whole(&dir, "state.json", &changed),
        Err(ManifestError::Checksum { .. })
    ));
    m.check_whole(&dir, "state.json", &state)
        .expect("the state as saved");
}

#[test]
fn a_manifest_that_does_not_hold_together_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("vm");
    write_saved_dir(&dir, &parked(), &info(), &SaveOptions::default()).expect("save");
    let good = manifest_of(&dir);
    let path = dir.join(MANIFEST_FILE);
    let refused = |m: &Manifest| Manifest::parse(&m.to_bytes(), &path, 64).is_err();
    let mut m = good.clone();
    m.version = 2;
    assert!(refused(&m));
    let mut m = good.clone();
    m.memory[0].crc32c.pop();
    assert!(refused(&m));
    let mut m = good.clone();
    m.memory[1].name = "../memory-5".into();
    assert!(refused(&m));
    let mut m = good.clone();
    m.memory[1].slot = m.memory[0].slot;
    assert!(refused(&m));
    let mut m = good.clone();
    m.piece_bytes = 3 << 20;
    assert!(refused(&m));
    assert!(Manifest::parse(b"{\"format\":\"hugemem-saved-vm\"", &path, 64).is_err());
    let bytes = good.to_bytes();
    assert!(
        Manifest::parse(&bytes[..bytes.len() - 1], &path, 64).is_err(),
        "a torn manifest"
    );
    assert!(
        Manifest::parse(&bytes, &path, 1).is_err(),
        "more memory files than slots allowed"
    );
    assert_eq!(
        Manifest::parse(&bytes, &path, 64).expect("the original"),
        good
    );
}

#[test]
fn a_slot_above_the_hole_is_read_from_the_start_of_its_file() {
    // A 4 GiB cloud-hypervisor VM: slot 0 below the 32-bit hole, slot
    // 1 above it, both from one zone's fd (slot 1 at 3 GiB in it).
    let config = serde_json::json!({
        "memory_manager_data": { "guest_ram_mappings": [
            { "slot": 0, "gpa": 0, "size": 3u64 << 30, "file_offset": 0 },
            { "slot": 1, "gpa": 4u64 << 30, "size": 1u64 << 30, "file_offset": 3u64 << 30 },
        ]},
        "other": "kept",
    });
    let out = with_file_offsets(
        &serde_json::to_vec(&config).expect("json"),
        &[(0, 0), (1, 0)],
    )
    .expect("rewritten");
    let out: serde_json::Value = serde_json::from_slice(&out).expect("json");
    let mappings = &out["memory_manager_data"]["guest_ram_mappings"];
    assert_eq!(mappings[1]["file_offset"], 0);
    assert_eq!(mappings[1]["gpa"], 4u64 << 30);
    assert_eq!(mappings[0]["file_offset"], 0);
    assert_eq!(out["other"], "kept");
}

/// A parked QEMU VM's snapshot as `hugemem launch` parks one (the
/// documents of `cli/src/launch/vmm/qemu/parked.rs`), on `slots` regions of
/// 2 MiB.
fn qemu_parked(slots: u32) -> Snapshot {
    let mut memory = Vec::new();
    let mut mappings = Vec::new();
    for slot in 0..slots {
        let fd = memfd(2 * MIB);
        std::fs::File::from(fd.try_clone().expect("dup"))
            .write_all_at(&[0xD0 + slot as u8; 4096], 4096)
            .expect("write");
        memory.push((slot, fd));
        mappings.push(format!(
            r#"{{"slot":{slot},"gpa":{},"size":{},"file_offset":0}}"#,
            u64::from(slot) * 2 * MIB,
            2 * MIB
        ));
    }
    let config = format!(
        r#"{{"vmm":"qemu","format":1,"program":"qemu-system-x86_64","args":["-M","microvm"],"regions":[],"memory_manager_data":{{"guest_ram_mappings":[{}]}}}}"#,
        mappings.join(",")
    );
    Snapshot {
        memory,
        config: config.into_bytes(),
        state: br#"{"vmm":"qemu","bytes":3,"migration_stream":"UUVW"}"#.to_vec(),
        paused: false,
    }
}

#[test]
fn a_qemu_vm_saves_under_its_vmm_and_loads_with_each_region() {
    use super::manifest::{vmm_of, VMM_CLOUD_HYPERVISOR, VMM_QEMU};
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("q");
    let snapshot = qemu_parked(1);
    write_saved_dir(&dir, &snapshot, &info(), &SaveOptions::default()).expect("save");
    assert_eq!(manifest_of(&dir).vmm, VMM_QEMU);
    let loaded = load::load(&dir).expect("a QEMU save loads");
    assert_eq!(loaded.kind, DirKind::Saved);
    assert_eq!(vmm_of(&loaded.config), Some(VMM_QEMU));
    assert_eq!(loaded.state, snapshot.state, "the state as parked");
    // A manifest that names another VMM than the configuration does.
    let mut m = manifest_of(&dir);
    m.vmm = VMM_CLOUD_HYPERVISOR.into();
    std::fs::write(dir.join(MANIFEST_FILE), m.to_bytes()).expect("write");
    let err = load::load(&dir).err().expect("the manifest's vmm differs");
    assert!(err.to_string().contains("\"cloud-hypervisor\" VM"), "{err}");
    // Two regions load too, each slot's file whole from its start (the
    // daemon gives each its own region).
    let two = tmp.path().join("two");
    write_saved_dir(&two, &qemu_parked(2), &info(), &SaveOptions::default()).expect("save");
    let loaded = load::load(&two).expect("a QEMU save of two regions loads");
    let slots: Vec<u32> = loaded.memory.iter().map(|(s, _)| *s).collect();
    assert_eq!(slots, [0, 1]);
    let config: serde_json::Value = serde_json::from_slice(&loaded.config).expect("json");
    let mappings = config["memory_manager_data"]["guest_ram_mappings"]
        .as_array()
        .expect("mappings");
    assert!(
        mappings.iter().all(|m| m["file_offset"] == 0),
        "{mappings:?}"
    );
    // A configuration naming an unknown VMM is not saved.
    let mut other = qemu_parked(1);
    other.config = br#"{"vmm":"firecracker","memory_manager_data":{"guest_ram_mappings":[{"slot":0,"gpa":0,"size":2097152,"file_offset":0}]}}"#.to_vec();
    let refused = write_saved_dir(
        &tmp.path().join("fc"),
        &other,
        &info(),
        &SaveOptions::default(),
    );
    assert!(
        matches!(refused, Err(SavedVmError::Unsupported(_))),
        "{refused:?}"
    );
    assert_eq!(vmm_of(&parked().config), Some(VMM_CLOUD_HYPERVISOR));
}
