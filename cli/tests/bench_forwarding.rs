//! `hugemem demo …` and `hugemem bench X …` run `hugemem-bench` (which is
//! built and shipped apart from the daemon) with every argument: found
//! beside the `hugemem` executable first, then on PATH, exec'd so that its
//! output and exit status are its own; when it is in neither place, a clear
//! error says how to get it.
//!
//! The binaries are copied into temporary directories (the directory of the
//! running executable is what counts, and `/proc/self/exe` sees through
//! symlinks). One test at a time: a file still open for writing when another
//! test's thread forks cannot be executed (ETXTBSY).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `hugemem` copied alone into a fresh directory.
fn hugemem_alone() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("hugemem");
    fs::copy(HUGEMEM, &bin).expect("copy hugemem");
    (dir, bin)
}

fn write_executable(path: &Path, text: &str) {
    fs::write(path, text).expect("write");
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).expect("chmod");
}

fn run(bin: &Path, args: &[&str], path_var: &str) -> Output {
    Command::new(bin)
        .args(args)
        .env("PATH", path_var)
        .output()
        .expect("run hugemem")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_argument_reaches_the_bench_binary_and_its_exit_status_comes_back() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, bin) = hugemem_alone();
    // A stand-in that prints its arguments, one a line, and exits with 7.
    write_executable(
        &dir.path().join("hugemem-bench"),
        "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\nexit 7\n",
    );
    let out = run(&bin, &["bench", "alloc", "--help", "--size", "1G"], "");
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "alloc\n--help\n--size\n1G\n");
    let out = run(&bin, &["demo", "--json", "-h", "--page-size=4K"], "");
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "demo\n--json\n-h\n--page-size=4K\n");
    let out = run(&bin, &["bench"], "");
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");

    // Not beside it: the one on PATH.
    let elsewhere = tempfile::tempdir().expect("tempdir");
    fs::remove_file(dir.path().join("hugemem-bench")).expect("rm");
    write_executable(
        &elsewhere.path().join("hugemem-bench"),
        "#!/bin/sh\necho \"on PATH: $*\"\n",
    );
    let out = run(
        &bin,
        &["bench", "clear"],
        &elsewhere.path().to_string_lossy(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "on PATH: clear\n");
}

#[test]
fn the_built_bench_binary_answers_through_hugemem() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // After a workspace build both binaries are in target/<profile>/.
    let bench = Path::new(HUGEMEM).with_file_name("hugemem-bench");
    if !bench.is_file() {
        test_support::skip!(
            "{} is not built (cargo build -p hugemem-bench, or cargo test --workspace)",
            bench.display()
        );
        return;
    }
    for args in [
        &["bench", "--help"][..],
        &["bench", "alloc", "--help"],
        &["demo", "--help"],
    ] {
        let via_hugemem = run(Path::new(HUGEMEM), args, "");
        let direct = Command::new(&bench)
            .args(&args[usize::from(args[0] == "bench")..])
            .output()
            .expect("run hugemem-bench");
        assert!(
            via_hugemem.status.success(),
            "{args:?}: {}",
            text(&via_hugemem.stderr)
        );
        assert_eq!(text(&via_hugemem.stdout), text(&direct.stdout), "{args:?}");
        assert!(
            text(&direct.stdout).contains("Usage: hugemem-bench"),
            "{args:?}"
        );
    }
}

#[test]
fn a_missing_bench_binary_says_how_to_get_it() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (_dir, bin) = hugemem_alone();
    for args in [&["demo"][..], &["bench", "alloc", "--size", "1G"]] {
        let out = run(&bin, args, "");
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(
            stderr.contains("cannot find hugemem-bench")
                && stderr.contains("not on PATH")
                && stderr.contains("cargo build --release -p hugemem-bench")
                && stderr.contains("install the package that ships it"),
            "{args:?}: {stderr}"
        );
    }
}
