//! `hugemem bench offload` at 64 MiB, one repetition: the report is
//! complete; hugemem's park copied nothing, every variant's guest counted on
//! with no page changed (the on-demand restore's also on the host's check
//! once every page was filled), the load from disk has a rate and so has
//! the disk, both baselines (cloud-hypervisor's `file://`, its offload
//! daemon) ran, and the save was measured in its round of the disk's own
//! write rates. The guests are dense (`--dense`): every filled byte is
//! found again after the load and the on-demand restore. No timing is
//! asserted.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names and the offload daemon `CH_OFFLOAD_DAEMON`
//! names (`scripts/build-cloud-hypervisor --print-env`), a usable
//! `/dev/kvm`, or 32 free 2 MiB pages.

use std::process::Command;

use serde_json::Value;
use test_support::prelude::serial;

const HUGEMEM_BENCH: &str = env!("CARGO_BIN_EXE_hugemem-bench");

#[test]
fn a_small_run_reports_every_variant() {
    let _serial = serial();
    let Some(built) = test_support::cloud_hypervisor::binaries_or_skip() else {
        return;
    };
    let ch = built.cloud_hypervisor.clone().into_os_string();
    let offload = built.offload_daemon.clone().into_os_string();
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{reason}");
        return;
    }
    let dir = tempfile::tempdir_in("/var/tmp").expect("a directory under /var/tmp");
    let out = Command::new("timeout")
        .args([
            "300",
            HUGEMEM_BENCH,
            "offload",
            "--size",
            "64M",
            "--reps",
            "1",
            "--dense",
        ])
        .arg("--cloud-hypervisor")
        .arg(&ch)
        .arg("--offload-daemon")
        .arg(&offload)
        .arg("--dir")
        .arg(dir.path())
        .arg("--json")
        .output()
        .expect("run hugemem-bench offload");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("free 2 MiB pages needed") {
        test_support::skip!("not enough 2 MiB pages: {stderr}");
        return;
    }
    assert!(out.status.success(), "bench offload failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    eprintln!("{r}");
    assert_eq!(r["bench"], "offload");
    assert_eq!(r["size"], 64u64 << 20);
    let p = &r["from_park"];
    assert_eq!(p["park_ms"]["samples"].as_array().map(Vec::len), Some(1));
    assert_eq!(p["restore_ms"]["samples"].as_array().map(Vec::len), Some(1));
    assert_eq!(p["park_copied_bytes"], 0, "the park moved the memory: {p}");
    assert_eq!(p["stale_guest"], 0, "{p}");
    let d = &r["from_disk"];
    assert!(
        d["load_gbps"]["median"].as_f64().expect("rate") > 0.0,
        "{d}"
    );
    assert!(
        d["disk_read_gbps"]["median"].as_f64().expect("rate") > 0.0,
        "{d}"
    );
    assert_eq!(d["stale_guest"], 0, "{d}");
    assert_eq!(d["stale_dense"], 0, "{d}");
    assert_eq!(r["dense"], true);
    // Every writer ran beside the save; the direct ones unless the file
    // system refuses O_DIRECT (then neither).
    let s = &r["save_over_disk"];
    let direct = !s["single"].is_null();
    assert_eq!(direct, !s["parallel"].is_null(), "{s}");
    for ratio in ["single", "parallel", "buffered"] {
        if direct || ratio == "buffered" {
            assert_eq!(s[ratio]["rounds"], 1, "{ratio}: {s}");
            assert!(s[ratio]["median"].as_f64().expect("ratio") > 0.0, "{s}");
        }
    }
    assert!(
        d["save_line"]
            .as_str()
            .is_some_and(|l| l.contains("direct")),
        "{d}"
    );
    let c = &r["ch_file"];
    assert!(c.is_object(), "file:// ran: {}", r["ch_file_note"]);
    assert_eq!(c["stale_guest"], 0, "{c}");
    let o = &r["offload_daemon"];
    assert!(
        o.is_object(),
        "offload_daemon ran: {}",
        r["offload_daemon_note"]
    );
    assert_eq!(o["stale_guest"], 0, "{o}");
    assert!(r["ch_file_over_from_disk"].is_f64(), "{r}");
    let od = &r["on_demand"];
    assert!(
        od["restore_ms"]["median"].as_f64().expect("time") > 0.0,
        "{od}"
    );
    assert!(
        od["all_filled_ms"]["median"].as_f64().expect("time") > 0.0,
        "{od}"
    );
    assert_eq!(od["stale_host"], 0, "{od}");
    assert_eq!(od["stale_guest"], 0, "{od}");
    assert_eq!(od["stale_dense"], 0, "{od}");
}

/// QEMU's rows at 64 MiB, one repetition (not with `--dense`): hugemem's
/// park copied nothing and QEMU's park stream carried no more than its
/// device state, QEMU's own save wrote most of the guest's RAM, the floor
/// wrote only device state, every QEMU guest counted on with no page
/// changed, and the comparisons are there. No timing is asserted.
#[test]
fn a_small_run_reports_qemus_rows() {
    let _serial = serial();
    let Some(built) = test_support::cloud_hypervisor::binaries_or_skip() else {
        return;
    };
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => {
            test_support::skip!("qemu-system-x86_64 not installed");
            return;
        }
    }
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{reason}");
        return;
    }
    let dir = tempfile::tempdir_in("/var/tmp").expect("a directory under /var/tmp");
    let out = Command::new("timeout")
        .args([
            "300",
            HUGEMEM_BENCH,
            "offload",
            "--size",
            "64M",
            "--reps",
            "1",
        ])
        .args(["--qemu", "qemu-system-x86_64", "--cloud-hypervisor"])
        .arg(&built.cloud_hypervisor)
        .arg("--dir")
        .arg(dir.path())
        .arg("--json")
        .output()
        .expect("run hugemem-bench offload");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("free 2 MiB pages needed") {
        test_support::skip!("not enough 2 MiB pages: {stderr}");
        return;
    }
    assert!(out.status.success(), "bench offload failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let q = &r["qemu"];
    assert!(q.is_object(), "QEMU's rows ran: {}", r["qemu_note"]);
    for figure in [
        "park_ms",
        "park_launcher_ms",
        "restore_ms",
        "file_save_ms",
        "file_restore_ms",
        "floor_save_ms",
        "floor_restore_ms",
    ] {
        assert_eq!(
            q[figure]["samples"].as_array().map(Vec::len),
            Some(1),
            "{figure}: {q}"
        );
    }
    assert_eq!(q["park_copied_bytes"], 0, "the park moved the memory: {q}");
    let state = q["park_state_bytes"].as_u64().expect("state bytes");
    assert!(state > 0, "{q}");
    assert!(
        q["park_ram_transferred_bytes"].as_u64() <= Some(state),
        "{q}"
    );
    // Most of the guest's RAM: it wrote every 4 KiB page (QEMU skips the
    // few it left zero).
    assert!(q["file_bytes"].as_u64() >= Some(48 << 20), "{q}");
    assert!(q["floor_file_bytes"].as_u64() < Some(1 << 20), "{q}");
    assert_eq!(q["stale_guest"], 0, "{q}");
    let c = &r["qemu_comparison"];
    assert!(c["park_over_floor_paired_ms"].is_f64(), "{c}");
    assert!(c["file_restore_over_restore"].is_f64(), "{c}");
}
