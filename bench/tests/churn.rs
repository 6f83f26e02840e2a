//! `hugemem bench churn` against a live daemon on a temporary socket: a
//! small churn (4 VMs x 64 MiB on 2 MiB pages) with hugemem's own KVM runner
//! (two at once), with QEMU when it is installed, and with cloud-hypervisor
//! when `CLOUD_HYPERVISOR` names one. Checks that every guest ran and ended
//! normally on all three sides (hugemem, baseline, floor), that no guest
//! read an earlier guest's marker (on the floor: that its memfd was zeroed
//! again between launches), that every hugemem launch went through the
//! daemon, and that the JSON report is complete and consistent. No timing
//! is asserted.

use std::process::Command;

use backend::stats::Stats;
use serde_json::Value;

/// `hugemem-bench`, what `hugemem bench` runs.
const HUGEMEM_BENCH: &str = env!("CARGO_BIN_EXE_hugemem-bench");
const VMS: u64 = 4;

/// Runs the churn on `daemon` and checks the report; returns it.
fn churn(
    daemon: &test_support::prelude::TestDaemon,
    vmm: &str,
    parallel: u64,
    extra_env: &[(&str, &str)],
) -> Value {
    let before = daemon.stats();
    let socket = daemon.socket();
    let out = Command::new("timeout")
        .args(["300", HUGEMEM_BENCH, "churn", "--vms"])
        .arg(VMS.to_string())
        .args(["--size", "64M", "--page-size", "2M", "--vmm", vmm, "--json"])
        .args(["--parallel", &parallel.to_string(), "--socket"])
        .arg(&socket)
        .envs(extra_env.iter().copied())
        .output()
        .expect("run hugemem-bench churn");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{vmm}: bench churn failed ({}):\n{stderr}",
        out.status
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{vmm}: not JSON ({e}): {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    eprintln!("{vmm}: {report}");

    let num = |k: &str| -> f64 {
        report[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{vmm}: field {k} missing: {report}"))
    };
    let (p50, p99) = (num("p50_ms"), num("p99_ms"));
    let (b50, b99) = (num("baseline_p50_ms"), num("baseline_p99_ms"));
    assert!(p50 > 0.0 && p99 >= p50, "{vmm}: p50 {p50}, p99 {p99}");
    assert!(
        b50 > 0.0 && b99 >= b50,
        "{vmm}: baseline p50 {b50}, p99 {b99}"
    );
    assert!(num("max_ms") >= p99 && num("baseline_max_ms") >= b99);
    assert_eq!(report["vmm"], vmm);
    assert_eq!(report["stale_reads"].as_u64(), Some(0), "{vmm}: {report}");
    assert_eq!(
        report["baseline_stale_reads"].as_u64(),
        Some(0),
        "{vmm}: {report}"
    );
    // A strict 2M policy never serves another size.
    assert_eq!(report["downgrades"].as_u64(), Some(0), "{vmm}: {report}");
    assert_eq!(report["expected_page_size"], "2M");
    assert_eq!(report["page_sizes"], serde_json::json!({ "2M": VMS }));

    // Every guest ran and ended normally, walked the same RAM, read zeros:
    // on the floor, each guest reads the markers of the one before unless
    // the memfd was zeroed again in between.
    for side in ["launches", "baseline", "floor_launches"] {
        let list = report[side].as_array().expect(side);
        assert_eq!(list.len() as u64, VMS, "{vmm} {side}");
        for l in list {
            // 64 MiB from 1 MiB up in 2 MiB strides: 2 MiB .. 62 MiB.
            assert_eq!(l["guest_pages"].as_u64(), Some(31), "{vmm} {side}: {l}");
            assert_eq!(l["stale"], false, "{vmm} {side}: {l}");
            let exit = l["exit"].as_str().expect("exit");
            let normal = match vmm {
                // isa-debug-exit: (nonzero << 1) | 1.
                "qemu" => "exit status: 1",
                "cloud-hypervisor" => "exit status: 0",
                _ => "guest exit port",
            };
            assert_eq!(exit, normal, "{vmm} {side}: {l}");
            assert!(l["ms"].as_f64().is_some_and(|ms| ms > 0.0), "{l}");
        }
    }
    for l in report["launches"].as_array().expect("launches") {
        assert_eq!(l["page_sizes"], serde_json::json!([2 << 20]), "{vmm}: {l}");
        assert!(l["alloc_ms"].as_f64().is_some(), "{vmm}: {l}");
    }
    // Both spans, on every launch of every side, in order: the guest's
    // first instruction, then all of its RAM touched, then the launch's end.
    for side in ["launches", "baseline", "floor_launches"] {
        for l in report[side].as_array().expect(side) {
            let span = |k: &str| {
                l[k].as_f64()
                    .unwrap_or_else(|| panic!("{vmm}: {side}: no {k}: {l}"))
            };
            let (ready, touched, end) = (span("ready_ms"), span("touched_ms"), span("ms"));
            assert!(
                0.0 < ready && ready <= touched && touched <= end,
                "{vmm}: {side}: {l}"
            );
        }
    }
    for span in ["ready", "touched"] {
        let s = &report[span];
        assert!(
            s["hugemem"]["p50"].as_f64().is_some_and(|x| x > 0.0),
            "{vmm}: {span}: {s}"
        );
        assert!(
            s["baseline"]["p50"].as_f64().is_some_and(|x| x > 0.0),
            "{vmm}: {span}: {s}"
        );
        assert!(
            s["speedup_p50"].as_f64().is_some_and(|x| x > 0.0),
            "{vmm}: {span}: {s}"
        );
        assert!(
            s["floor"]["p50"].as_f64().is_some_and(|x| x > 0.0),
            "{vmm}: {span}: {s}"
        );
    }
    assert!(report["host_vm_fits"].as_u64().is_some(), "{vmm}");

    // The floor ran (the test's pages leave room for it beside the live
    // daemon), and the report carries its figures and the limit.
    assert!(report.get("floor_skipped").is_none(), "{vmm}: {report}");
    let floor = &report["floor"];
    assert_eq!(floor["stale_reads"].as_u64(), Some(0), "{vmm}: {floor}");
    assert_eq!(floor["page_size"], "2M", "{vmm}: {floor}");
    let (f50, f99) = (floor["p50_ms"].as_f64(), floor["p99_ms"].as_f64());
    assert!(f50.is_some_and(|x| x > 0.0) && f99 >= f50, "{vmm}: {floor}");
    assert!(floor["warmup_ms"].as_f64().is_some(), "{vmm}: {floor}");
    for k in ["p50_ms", "ready_p50_ms", "touched_p50_ms"] {
        assert!(
            report["over_floor"][k].as_f64().is_some(),
            "{vmm}: over_floor.{k}: {report}"
        );
    }
    let limits = &report["limits"];
    assert!(
        limits["kernel_zeroing_1_thread_ms"]
            .as_f64()
            .is_some_and(|x| x > 0.0),
        "{vmm}: {limits}"
    );
    assert_eq!(
        limits["kernel_zeroing_1_thread_samples_ms"]
            .as_array()
            .map(Vec::len),
        Some(3),
        "{vmm}: {limits}"
    );

    // Every hugemem launch, the warm-up included, went through this daemon
    // and was freed.
    let after = daemon.stats();
    for (c, count) in [
        (
            "allocs_ok",
            (|s: &Stats| s.counters.allocs_ok) as fn(&Stats) -> u64,
        ),
        ("frees", |s: &Stats| s.counters.frees),
    ] {
        assert_eq!(
            count(&after) - count(&before),
            VMS + 1,
            "{vmm}: {c}: {after}"
        );
    }
    assert_eq!(after.counters.allocs_failed, before.counters.allocs_failed);
    report
}

fn kvm_ok() -> bool {
    match microguest::kvm_available() {
        Ok(()) => true,
        Err(reason) => {
            test_support::skip!("{reason}");
            false
        }
    }
}

#[test]
fn micro_runner_churn_two_at_once() {
    let _serial = test_support::prelude::serial();
    if !kvm_ok() || !test_support::prelude::reserve_2m(80, "micro churn") {
        return;
    }
    let daemon = test_support::prelude::TestDaemon::start(|_| {});
    let report = churn(&daemon, "micro", 2, &[]);
    assert_eq!(report["parallel"].as_u64(), Some(2));
    daemon.shutdown();
}

#[test]
fn qemu_churn() {
    let _serial = test_support::prelude::serial();
    let qemu = Command::new("qemu-system-x86_64").arg("--version").output();
    if !qemu.is_ok_and(|o| o.status.success()) {
        test_support::skip!("qemu-system-x86_64 not installed");
        return;
    }
    if !kvm_ok() || !test_support::prelude::reserve_2m(80, "QEMU churn") {
        return;
    }
    let daemon = test_support::prelude::TestDaemon::start(|_| {});
    churn(&daemon, "qemu", 1, &[]);
    daemon.shutdown();
}

#[test]
fn cloud_hypervisor_churn() {
    let _serial = test_support::prelude::serial();
    let Some(built) = test_support::cloud_hypervisor::binaries_or_skip() else {
        return;
    };
    let ch = built.cloud_hypervisor.to_string_lossy().into_owned();
    if !kvm_ok() || !test_support::prelude::reserve_2m(80, "cloud-hypervisor churn") {
        return;
    }
    let daemon = test_support::prelude::TestDaemon::start(|_| {});
    churn(
        &daemon,
        "cloud-hypervisor",
        1,
        &[("CLOUD_HYPERVISOR", ch.as_str())],
    );
    daemon.shutdown();
}
