//! Boots the PVH ELF image under QEMU (`-M microvm`, TCG) when
//! `qemu-system-x86_64` is installed; otherwise prints `SKIP: <reason>`.
//!
//! The deadline is enforced by coreutils `timeout`, so no test sleeps.

use std::process::Command;

use microguest::{pvh_elf, PvhConfig};

/// Writes the image for `cfg` to a temporary file and boots it with `extra`
/// QEMU arguments; returns (exit code, serial output), or `None` after
/// printing why the test is skipped.
fn boot(cfg: &PvhConfig, extra: &[&str], tag: &str) -> Option<(i32, String)> {
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        test_support::skip!("qemu-system-x86_64 not installed");
        return None;
    }
    let elf = pvh_elf(cfg).expect("elf");
    let path = std::env::temp_dir().join(format!("microguest-{}-{tag}.elf", std::process::id()));
    std::fs::write(&path, elf).expect("write elf");
    let out = Command::new("timeout")
        .args([
            "60",
            "qemu-system-x86_64",
            "-M",
            "microvm",
            "-accel",
            "tcg",
            "-cpu",
            "max",
        ])
        .args([
            "-m",
            "256M",
            "-nographic",
            "-nodefaults",
            "-no-reboot",
            "-serial",
            "stdio",
        ])
        .args(extra)
        .arg("-kernel")
        .arg(&path)
        .output();
    let _ = std::fs::remove_file(&path);
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            test_support::skip!("cannot run timeout/qemu: {e}");
            return None;
        }
    };
    let code = out.status.code().unwrap_or(-1);
    assert_ne!(code, 124, "QEMU did not finish within 60 s");
    Some((code, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// `start_gpa` = 1 MiB: page 0 holds the real-mode interrupt vector table
/// that QEMU's firmware writes, so it is not clean memory.
fn cfg() -> PvhConfig {
    PvhConfig {
        stride: 2 << 20,
        marker: 0x1234,
        start_gpa: 1 << 20,
        ..Default::default()
    }
}

#[test]
fn microvm_isa_debug_exit() {
    let Some((code, serial)) = boot(&cfg(), &["-device", "isa-debug-exit"], "exit") else {
        return;
    };
    eprintln!("serial: {serial:?}, exit {code}");
    // 256 MiB / 2 MiB = 128 pages, page 0 below start_gpa.
    assert!(
        serial.contains("HUGEMEM-GUEST pages=127 nonzero=0 status=0\n"),
        "{serial:?}"
    );
    // isa-debug-exit: (0 << 1) | 1.
    assert_eq!(code, 1);
}

#[test]
fn microvm_ged_poweroff() {
    let Some((code, serial)) = boot(&cfg(), &[], "ged") else {
        return;
    };
    assert!(
        serial.contains("HUGEMEM-GUEST pages=127 nonzero=0 status=0\n"),
        "{serial:?}"
    );
    // No isa-debug-exit device: the ACPI GED sleep register powers off cleanly.
    assert_eq!(code, 0);
}
