//! `hugemem hugepages` as an operator runs it: the built binary copied out
//! of the build tree (as `install` puts it in /usr/local/bin), run from
//! another directory with an empty environment, and, where `unshare` works,
//! with the source tree hidden under an empty tmpfs in a private mount
//! namespace. Nothing it needs at run time may come from the source tree.
//!
//! The test changes the host's 2 MiB pool (grows it by 2 pages and gives them
//! back); run it under the machine lock like every test that touches pools.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
// Both tests read and change the host's 2 MiB pool: one at a time (in
// parallel, the other's grow could already cover the unprivileged request,
// which then needs no write and succeeds).
use test_support::prelude::serial;

const POOL_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

fn sysfs(name: &str) -> u64 {
    fs::read_to_string(Path::new(POOL_2M).join(name))
        .expect("read the 2 MiB pool")
        .trim()
        .parse()
        .expect("a number")
}

/// The binary copied into a fresh directory (mode 0755, so that an
/// unprivileged user can run it too).
struct Installed {
    _dir: tempfile::TempDir,
    bin: PathBuf,
}

fn install() -> Installed {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod dir");
    let bin = dir.path().join("hugemem");
    fs::copy(env!("CARGO_BIN_EXE_hugemem"), &bin).expect("copy the binary");
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).expect("chmod binary");
    Installed { _dir: dir, bin }
}

/// The source tree: the workspace root, parent of this crate.
fn source_tree() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

/// Runs `program args` with an empty environment from `/`.
fn run(program: &Path, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env_clear()
        .current_dir("/")
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
}

/// `hugemem ARGS` from `bin`, inside a private mount namespace where the
/// source tree is an empty tmpfs when `unshare` can do that; plainly
/// otherwise. Returns the output and whether the tree was hidden.
fn run_without_tree(bin: &Path, args: &[&str]) -> (Output, bool) {
    let tree = source_tree();
    let script = format!(
        "mount -t tmpfs hugemem-test-hidden '{}' && test ! -e '{}' && exec \"$0\" \"$@\"",
        tree.display(),
        tree.join("Cargo.toml").display()
    );
    let mut full: Vec<&str> = vec!["--mount", "--propagation", "private", "sh", "-c", &script];
    let bin_str = bin.to_str().expect("utf-8 temp path");
    full.push(bin_str);
    full.extend_from_slice(args);
    let hidden = run(Path::new("/usr/bin/unshare"), &full);
    let unshare_failed = hidden.status.code() != Some(0)
        && hidden.status.code() != Some(3)
        && String::from_utf8_lossy(&hidden.stdout).is_empty();
    if !unshare_failed {
        return (hidden, true);
    }
    test_support::skip!(
        "cannot hide the source tree in a mount namespace ({}); running the copy plainly",
        String::from_utf8_lossy(&hidden.stderr).trim()
    );
    (run(bin, args), false)
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "hugemem hugepages --json printed no JSON ({e}); status {}, stderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn installed_binary_reserves_and_gives_back_2m_pages() {
    let _serial = serial();
    if !Path::new(POOL_2M).is_dir() {
        test_support::skip!("no 2 MiB huge-page pool on this kernel");
        return;
    }
    if !is_root() {
        test_support::skip!("reserving huge pages needs root");
        return;
    }
    let installed = install();
    let before = sysfs("nr_hugepages");
    let want = (before + 2).to_string();

    let (out, hidden) = run_without_tree(&installed.bin, &["hugepages", "--2m", &want, "--json"]);
    let report = json(&out);
    let pool = &report["pools"][0];
    if out.status.code() == Some(3) {
        // Give back what we got before saying why.
        run(
            &installed.bin,
            &[
                "hugepages",
                "--2m",
                &before.to_string(),
                "--exact",
                "--no-mount",
            ],
        );
        test_support::skip!("the kernel gave fewer 2 MiB pages than asked: {pool}");
        return;
    }
    assert_eq!(
        out.status.code(),
        Some(0),
        "stderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("source tree hidden: {hidden}; report: {report}");
    assert_eq!(pool["size"], "2M");
    assert_eq!(pool["page_kb"], 2048);
    assert_eq!(pool["node"], Value::Null);
    assert_eq!(pool["mode"], "total");
    assert_eq!(pool["requested"], before + 2);
    assert_eq!(pool["total_before"], before);
    assert_eq!(pool["total"], sysfs("nr_hugepages"));
    assert_eq!(pool["total"], before + 2);
    assert_eq!(pool["met"], true);
    assert_eq!(pool["shortfall"], 0);
    assert_eq!(report["all_met"], true);
    let node_sum: u64 = pool["nodes"]
        .as_array()
        .expect("per-node list")
        .iter()
        .map(|n| n["total"].as_u64().expect("node total"))
        .sum();
    assert_eq!(
        node_sum,
        before + 2,
        "the nodes' pools add up to the host's"
    );
    let mounts = report["mounts"].as_array().expect("mounts");
    assert_eq!(
        mounts.iter().map(|m| m["path"].clone()).collect::<Vec<_>>(),
        ["/dev/hugepages-1G", "/dev/hugepages-2M"]
    );

    // Give back, from the copy, with no mount.
    let out = run(
        &installed.bin,
        &[
            "hugepages",
            "--2m",
            &before.to_string(),
            "--exact",
            "--no-mount",
            "--json",
        ],
    );
    let back = json(&out);
    assert_eq!(back["pools"][0]["total"], sysfs("nr_hugepages"));
    assert_eq!(back["mounts"], Value::Array(vec![]));
    // Pages someone maps meanwhile would stay (exit 3); under the machine
    // lock nobody does.
    assert_eq!(out.status.code(), Some(0), "{back}");
    assert_eq!(sysfs("nr_hugepages"), before);
}

#[test]
fn installed_binary_names_the_problem() {
    let _serial = serial();
    let installed = install();
    // A node that does not exist: usage error, exit 2, the nodes listed.
    let out = run(
        &installed.bin,
        &["hugepages", "--2m", "1", "--node", "4096", "--no-mount"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("no NUMA node 4096; this host has nodes [0"),
        "{stderr}"
    );

    // Not root: exit 1 and says so (when we can drop privileges to try).
    if !is_root() || !Path::new("/usr/bin/setpriv").exists() {
        test_support::skip!("not root or no setpriv: the unprivileged case is not tried");
        return;
    }
    let want = (sysfs("nr_hugepages") + 1).to_string();
    let bin = installed.bin.to_str().expect("utf-8 temp path");
    let out = run(
        Path::new("/usr/bin/setpriv"),
        &[
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            bin,
            "hugepages",
            "--2m",
            &want,
            "--no-mount",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("need root"), "{stderr}");
}
