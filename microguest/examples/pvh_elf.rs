//! Writes the micro-guest's PVH ELF image to a file, for booting it under
//! QEMU, cloud-hypervisor or Firecracker.
//!
//! ```text
//! cargo run -p microguest --example pvh_elf -- guest.elf [stride] [marker] [start_gpa] [spin]
//! qemu-system-x86_64 -M microvm -cpu max -m 2G -nographic -no-reboot \
//!     -device isa-debug-exit -kernel guest.elf
//! ```
//!
//! QEMU exits with status 1 when the guest read only zeros, 3 when it saw
//! non-zero memory (isa-debug-exit's `(value << 1) | 1`). With a fifth
//! argument `spin` the guest keeps running instead (`microguest::spin`).

use std::process::ExitCode;

fn parse(arg: Option<String>, default: u64) -> Result<u64, String> {
    match arg {
        None => Ok(default),
        Some(s) => {
            let (digits, radix) = match s.strip_prefix("0x") {
                Some(hex) => (hex, 16),
                None => (s.as_str(), 10),
            };
            u64::from_str_radix(digits, radix).map_err(|e| format!("bad number {s:?}: {e}"))
        }
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: pvh_elf OUT.elf [stride] [marker] [start_gpa] [spin]");
        return ExitCode::from(2);
    };
    let defaults = microguest::PvhConfig::default();
    let cfg = match (
        parse(args.next(), defaults.stride),
        parse(args.next(), defaults.marker),
        parse(args.next(), defaults.start_gpa),
    ) {
        (Ok(stride), Ok(marker), Ok(start_gpa)) => microguest::PvhConfig {
            stride,
            marker,
            start_gpa,
            spin: args.next().as_deref() == Some("spin"),
            ..defaults
        },
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let elf = match microguest::pvh_elf(&cfg) {
        Ok(elf) => elf,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = std::fs::write(&path, &elf) {
        eprintln!("error: cannot write {path}: {e}");
        return ExitCode::FAILURE;
    }
    println!("wrote {path} ({} bytes)", elf.len());
    ExitCode::SUCCESS
}
