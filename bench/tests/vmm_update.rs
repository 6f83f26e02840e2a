//! `hugemem bench vmm-update` at 64 MiB with 2 updates: the report is
//! complete, the hugemem side sent under 1% of RAM by HANDOFF, cleared
//! nothing, lost no page and balanced its allocation; the floor (plain
//! QEMUs on one memfd) did the same updates without the daemon, sent no
//! RAM and lost no page; the copying baseline sent the guest's pages and
//! lost none. No timing is asserted.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64` or a
//! usable `/dev/kvm`; the cloud-hypervisor run without the binary that
//! `CLOUD_HYPERVISOR` names (`scripts/build-cloud-hypervisor`).

use std::process::Command;

use serde_json::Value;
use test_support::prelude::serial;

const HUGEMEM_BENCH: &str = env!("CARGO_BIN_EXE_hugemem-bench");

#[test]
fn a_small_run_reports_both_sides() {
    let _serial = serial();
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
    let out = Command::new("timeout")
        .args(["300", HUGEMEM_BENCH, "vmm-update", "--vmm", "qemu"])
        .args(["--size", "64M", "--updates", "2", "--json"])
        .output()
        .expect("run hugemem-bench vmm-update");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("free 2 MiB pages needed") {
        test_support::skip!("not enough 2 MiB pages: {stderr}");
        return;
    }
    assert!(out.status.success(), "bench vmm-update failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    eprintln!("{r}");
    assert_eq!(r["bench"], "vmm-update");
    assert_eq!(r["size"], 64u64 << 20);
    let u = &r["update"];
    assert_eq!(u["updates"], 2);
    assert_eq!(u["downtime_ms"].as_array().map(Vec::len), Some(2));
    assert_eq!(u["handoff"], true);
    assert!(
        u["ram_transferred_max_pct"].as_f64().expect("pct") < 1.0,
        "{u}"
    );
    assert_eq!(u["cleared_bytes"], 0, "{u}");
    assert_eq!(u["balanced"], true, "{u}");
    assert_eq!(u["released_after_exit"], true, "{u}");
    assert_eq!(
        (u["stale_guest"].as_u64(), u["stale_host"].as_u64()),
        (Some(0), Some(0)),
        "{u}"
    );
    let f = &r["floor"];
    assert!(f.is_object(), "the floor ran: {}", r["floor_note"]);
    assert_eq!(f["updates"], 2, "{f}");
    assert!(
        f["ram_transferred_max_pct"].as_f64().expect("pct") < 1.0,
        "{f}"
    );
    assert_eq!(
        (f["stale_guest"].as_u64(), f["stale_host"].as_u64()),
        (Some(0), Some(0)),
        "{f}"
    );
    assert!(r["update_over_floor_ms"].is_f64(), "{r}");
    let c = &r["copy"];
    assert!(c.is_object(), "the baseline ran: {}", r["copy_note"]);
    // The guest wrote every 4 KiB page from 1 MiB on: the copy sent them all.
    let pages = (64u64 << 20) - (1 << 20);
    assert!(
        c["ram_transferred_bytes"].as_u64().expect("bytes") >= pages,
        "{c}"
    );
    assert_eq!(
        (c["stale_guest"].as_u64(), c["stale_host"].as_u64()),
        (Some(0), Some(0)),
        "{c}"
    );
}

/// `--vmm cloud-hypervisor` at 64 MiB with 2 updates: hugemem's updates
/// (the fds moved, the allocation on the launcher's connection, no
/// HANDOFF) wrote under 1 % of RAM and lost no page; the floor (two plain
/// cloud-hypervisors on one memfd) did the same; the copying migration
/// wrote at least the guest's pages. No timing is asserted.
#[test]
fn a_small_cloud_hypervisor_run_reports_floor_and_copy() {
    let _serial = serial();
    let Some(built) = test_support::cloud_hypervisor::binaries_or_skip() else {
        return;
    };
    let ch = built.cloud_hypervisor.clone().into_os_string();
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{reason}");
        return;
    }
    let out = Command::new("timeout")
        .args([
            "300",
            HUGEMEM_BENCH,
            "vmm-update",
            "--vmm",
            "cloud-hypervisor",
        ])
        .arg("--cloud-hypervisor")
        .arg(&ch)
        .args(["--size", "64M", "--updates", "2", "--json"])
        .output()
        .expect("run hugemem-bench vmm-update");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("free 2 MiB pages needed") {
        test_support::skip!("not enough 2 MiB pages: {stderr}");
        return;
    }
    assert!(out.status.success(), "bench vmm-update failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    eprintln!("{r}");
    assert_eq!(r["vmm"], "cloud-hypervisor");
    let u = &r["update"];
    assert_eq!(u["updates"], 2, "{u}");
    assert_eq!(u["handoff"], false, "the fds move, no HANDOFF: {u}");
    assert!(
        u["ram_transferred_max_pct"].as_f64().expect("pct") < 1.0,
        "{u}"
    );
    assert_eq!(u["cleared_bytes"], 0, "{u}");
    assert_eq!(u["balanced"], true, "{u}");
    assert_eq!(u["released_after_exit"], true, "{u}");
    assert_eq!(
        (u["stale_guest"].as_u64(), u["stale_host"].as_u64()),
        (Some(0), Some(0)),
        "{u}"
    );
    let f = &r["floor"];
    assert!(f.is_object(), "the floor ran: {}", r["floor_note"]);
    assert_eq!(f["updates"], 2, "{f}");
    assert!(
        f["ram_transferred_max_pct"].as_f64().expect("pct") < 1.0,
        "{f}"
    );
    assert!(
        f["update_median_ms"].as_f64().is_some_and(|t| t > 0.0),
        "{f}"
    );
    assert_eq!(
        (f["stale_guest"].as_u64(), f["stale_host"].as_u64()),
        (Some(0), Some(0)),
        "{f}"
    );
    assert!(r["update_over_floor_ms"].is_f64(), "{r}");
    let c = &r["copy"];
    assert!(c.is_object(), "the baseline ran: {}", r["copy_note"]);
    let pages = (64u64 << 20) - (1 << 20);
    assert!(
        c["ram_transferred_bytes"].as_u64().expect("bytes") >= pages,
        "{c}"
    );
    assert!(c["update_ms"].as_f64().is_some_and(|t| t > 0.0), "{c}");
    assert_eq!(
        (c["stale_guest"].as_u64(), c["stale_host"].as_u64()),
        (Some(0), Some(0)),
        "{c}"
    );
}
