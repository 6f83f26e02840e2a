use std::time::Duration;

use super::report::{plot_script, run_plot_script};
use super::results::Figure;
use super::variant::{Memory, Runner, Variant, BASELINE};
use super::vmm::*;
use crate::harness::vmm::VmmRun;

/// The compiled-in plot script runs with no source tree: `--check` exits
/// 0 with matplotlib, 2 (and says so) without; either way it ran.
#[test]
fn the_compiled_in_plot_script_runs() {
    if plot_script().is_some() {
        test_support::skip!("HUGEMEM_PLOT_SCRIPT is set; the built-in copy is not used");
        return;
    }
    let out = match run_plot_script(&[std::ffi::OsStr::new("--check")]) {
        Ok(out) => out,
        Err(e) => {
            test_support::skip!("cannot run python3: {e}");
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(2) => assert!(stderr.contains("matplotlib is not installed"), "{stderr}"),
        other => panic!("plot-compare --check: {other:?}: {stderr}"),
    }
}

#[test]
fn figures_and_ratios() {
    let f = Figure::of(&[3.0, 1.0, 2.0]).expect("figure");
    assert_eq!((f.best, f.median), (1.0, 2.0));
    assert!(Figure::of(&[]).is_none());
}

#[test]
fn variants_have_distinct_keys_and_kinds() {
    let mut keys: Vec<&str> = Variant::ALL.iter().map(|v| v.key()).collect();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), Variant::ALL.len());
    assert_eq!(BASELINE.memory(), Memory::Own);
    assert_eq!(Variant::ClientPool.memory(), Memory::Pool);
    assert_eq!(
        Variant::ChHugememPool.runner(),
        Runner::Vmm(hugemem::launch::Vmm::CloudHypervisor)
    );
}

#[test]
fn every_variant_has_a_floor_of_its_own_vmm() {
    for v in Variant::ALL {
        let floor = v.floor();
        assert_eq!(floor.memory(), Memory::Floor, "{v:?}");
        assert_eq!(floor.runner(), v.runner(), "{v:?}");
        assert_eq!(floor.floor(), floor);
    }
}

#[test]
fn skips_say_why() {
    let ok = Ok(String::new());
    let all = skip_reasons(&Err("no /dev/kvm".into()), &ok, None);
    assert_eq!(all.len(), Variant::ALL.len());
    assert!(all.values().all(|w| w.contains("no /dev/kvm")));
    let no_ch = skip_reasons(&Ok(()), &ok, None);
    assert_eq!(
        no_ch.keys().copied().collect::<Vec<_>>(),
        [
            Variant::ChPrefault,
            Variant::ChHugememPool,
            Variant::ChFloor
        ]
    );
    assert!(no_ch.values().all(|w| w.contains("CLOUD_HYPERVISOR")));
    let no_qemu = skip_reasons(&Ok(()), &Err("qemu not found".into()), Some(&ok));
    assert_eq!(no_qemu.len(), 5);
    assert!(!no_qemu.contains_key(&Variant::ClientFresh));
}

#[test]
fn guest_line_is_found_after_port_marks() {
    let run = VmmRun {
        ready: Some(Duration::from_millis(5)),
        touched: Some(Duration::from_millis(9)),
        elapsed: Duration::from_millis(10),
        status: std::os::unix::process::ExitStatusExt::from_raw(1 << 8),
        stdout: "{|HUGEMEM-GUEST pages=255 nonzero=0 status=0\n".into(),
        stderr: String::new(),
    };
    assert_eq!(
        run.guest_line(),
        Some("HUGEMEM-GUEST pages=255 nonzero=0 status=0")
    );
    let s = check_vmm(Variant::QemuLazy, &run, None).expect("sample");
    assert_eq!((s.first_instruction, s.ready), (0.005, 0.009));
    let s = check_vmm(Variant::QemuPrealloc, &run, None).expect("sample");
    assert_eq!(s.ready, 0.005);
    let bad = VmmRun {
        stdout: "{|HUGEMEM-GUEST pages=255 nonzero=1 status=0\n".into(),
        ..run
    };
    assert!(check_vmm(Variant::QemuPrealloc, &bad, None).is_err());
}
