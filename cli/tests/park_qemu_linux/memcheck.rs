//! The memory checker of `cli/tests/park_qemu_linux.rs`, run as a static
//! program in a stock Linux guest under QEMU (TCG).
//!
//! `memcheck MIB` fills MIB MiB of its own memory with a known pattern of
//! generation 0 (every 8-byte word a function of its index and the
//! generation), then makes passes for ever: pass N checks that every word
//! holds generation N−1 and rewrites it with generation N, so the memory
//! changes all the time, park or not. After each pass it prints
//! `MEMCHECK pass=N words=W`; on the first word that is wrong it prints
//! `MEMCHECK MISMATCH …` and exits 1. Built by the test with `rustc`
//! alone (no crates): std, statically linked.

use std::hint::black_box;
use std::io::Write;

/// Word `index` of generation `generation`.
fn pattern(generation: u64, index: u64) -> u64 {
    (index ^ generation.rotate_left(40)).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ generation
}

fn main() {
    let mib: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        Some(Ok(mib)) if mib > 0 => mib,
        _ => {
            eprintln!("usage: memcheck MIB");
            std::process::exit(2);
        }
    };
    let words = mib << 17;
    let mut buf: Vec<u64> = (0..words as u64).map(|i| pattern(0, i)).collect();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "MEMCHECK filled mib={mib} words={words}");
    for pass in 1u64.. {
        // The compiler may assume nothing about the buffer between passes.
        black_box(&mut buf);
        for (i, word) in (0u64..).zip(buf.iter_mut()) {
            let want = pattern(pass - 1, i);
            if *word != want {
                let _ = writeln!(
                    out,
                    "MEMCHECK MISMATCH pass={pass} word={i} got={:#018x} want={want:#018x}",
                    *word
                );
                std::process::exit(1);
            }
            *word = pattern(pass, i);
        }
        let _ = writeln!(out, "MEMCHECK pass={pass} words={words}");
    }
}
