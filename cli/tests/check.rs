//! `hugemem check` against this host made ready by `hugemem hugepages`
//! (every item PASS), and against hosts made wrong on purpose, each of
//! which must give the FAIL that names its cause: no huge pages (a fake
//! sysfs whose pools are empty: the host's pools are never shrunk), fewer
//! pages than the configuration asks, no hugetlbfs mount (a fake
//! `/proc/mounts`), a closed socket, and a uid the configuration does not
//! allow (libvirt's QEMU user, and a HANDSHAKE as that uid turned away).
//!
//! The daemon runs in this process ([`TestDaemon`]) on the configuration
//! file the check reads. Runs under the machine lock.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use test_support::prelude::{serial, TestDaemon};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

/// `hugemem check --json ARGS`: exit code and report.
fn check(args: &[&str]) -> (i32, Value) {
    check_with(Path::new(HUGEMEM), args)
}

/// [`check`] with the binary `hugemem`.
fn check_with(hugemem: &Path, args: &[&str]) -> (i32, Value) {
    let out = Command::new(hugemem)
        .arg("check")
        .arg("--json")
        .args(args)
        .output()
        .expect("run hugemem check");
    let json: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().expect("an exit code"), json)
}

/// The item named `name`.
fn item<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["items"]
        .as_array()
        .expect("items")
        .iter()
        .find(|i| i["name"] == name)
        .unwrap_or_else(|| panic!("no item {name}: {report:#}"))
}

/// Asserts `name` has `status` and its why contains `needle`.
fn expect(report: &Value, name: &str, status: &str, needle: &str) {
    let i = item(report, name);
    assert_eq!(i["status"], status, "{name}: {i:#}\n{report:#}");
    let why = i["why"].as_str().expect("why");
    assert!(why.contains(needle), "{name}: {why:?} lacks {needle:?}");
    if status != "PASS" {
        assert!(
            !i["fix"].as_str().expect("fix").is_empty(),
            "{name} says no fix: {i:#}"
        );
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A directory others may traverse (the tenant probes run as other uids).
fn open_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

/// The shipped emulator script with this build's binary and `socket`.
fn emulator_for(dir: &Path, socket: &Path) -> PathBuf {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/hugemem-qemu"),
    )
    .expect("scripts/hugemem-qemu");
    assert!(text.contains("/usr/bin/hugemem}") && text.contains("/run/hugemem/hugemem.sock"));
    let text = text
        .replace("/usr/bin/hugemem}", &format!("{HUGEMEM}}}"))
        .replace("/run/hugemem/hugemem.sock", &socket.display().to_string());
    let path = dir.join("hugemem-qemu");
    std::fs::write(&path, text).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// A `qemu.conf` with `user` and `group`.
fn qemu_conf(dir: &Path, user: &str, group: &str) -> PathBuf {
    let path = dir.join("qemu.conf");
    std::fs::write(
        &path,
        format!("# test\nuser = \"{user}\"\ngroup = \"{group}\"\n"),
    )
    .expect("write");
    path
}

/// `uid`, `gid` of an account, by `id`.
fn ids(user: &str) -> Option<(u32, u32)> {
    let get = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, user]).output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    Some((get("-u")?, get("-g")?))
}

/// A configuration file: `socket`, `allowed_uids`, `socket_group`, and
/// `extra` lines (sections).
fn config(dir: &Path, socket: &Path, allowed: &[u32], group: Option<u32>, extra: &str) -> PathBuf {
    let path = dir.join("hugemem.toml");
    let group = group.map_or(String::new(), |g| format!("socket_group = {g}\n"));
    std::fs::write(
        &path,
        format!(
            "socket = \"{}\"\nallowed_uids = {allowed:?}\n{group}\n[pool]\ntarget = \"0\"\n{extra}",
            socket.display()
        ),
    )
    .expect("write");
    path
}

/// The daemon `hugemem serve --config FILE` would run, in this process.
fn daemon_on(config: &Path) -> TestDaemon {
    let cfg = backend::daemon::Config::from_toml_file(config).expect("config");
    TestDaemon::start(move |c| *c = cfg)
}

/// Sets `vm.unprivileged_userfaultfd` for the guard's life.
struct Sysctl {
    path: &'static str,
    before: String,
}

impl Sysctl {
    fn set(path: &'static str, value: &str) -> Self {
        let before = std::fs::read_to_string(path).expect("read sysctl");
        std::fs::write(path, value).expect("write sysctl");
        Self { path, before }
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path, self.before.trim());
    }
}

#[test]
fn every_item_passes_on_a_host_made_ready_by_hugemem_hugepages() {
    let _s = serial();
    if !is_root() {
        test_support::skip!("huge pages, the probes as other uids and the sysctl need root");
        return;
    }
    if !Path::new("/dev/kvm").exists() {
        test_support::skip!("no /dev/kvm: the KVM item cannot pass here");
        return;
    }
    if !test_support::hugepages::reserve_2m(
        8,
        "every_item_passes_on_a_host_made_ready_by_hugemem_hugepages",
    ) {
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let shipped = test_support::installed::shipped(HUGEMEM, &repo);
    // The operator's step: reserve (a floor: nothing shrinks) and mount.
    let total_2m = test_support::hugepages::hugepages_2m("nr_hugepages");
    let out = Command::new(&shipped.hugemem)
        .args(["hugepages", "--2m", &total_2m.to_string()])
        .output()
        .expect("hugemem hugepages");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // libvirt's own qemu.conf where libvirt is installed, else one naming
    // `nobody` (the libvirt items are then about that user).
    let dir = open_tempdir();
    let real_conf = Path::new("/etc/libvirt/qemu.conf");
    let (conf, user, group) = if real_conf.exists() && ids("libvirt-qemu").is_some() {
        (real_conf.to_path_buf(), "libvirt-qemu", "libvirt-qemu")
    } else {
        eprintln!("NOTE: no libvirt here: a qemu.conf naming nobody/nogroup stands in");
        (
            qemu_conf(dir.path(), "nobody", "nogroup"),
            "nobody",
            "nogroup",
        )
    };
    let (uid, _) = ids(user).expect("the QEMU user");
    let gid = group_id(group).expect("the QEMU group");
    // Installed (HUGEMEM_INSTALLED=1): the package's binary checks, with its
    // emulator script as installed, so the daemon serves the socket that
    // script names; from the build tree, a private socket.
    let socket = if shipped.installed {
        test_support::installed::runtime_dir_for(gid)
    } else {
        dir.path().join("run/hugemem.sock")
    };
    let cfg = config(dir.path(), &socket, &[uid], Some(gid), "");
    let _daemon = daemon_on(&cfg);
    let emulator = if shipped.installed {
        shipped.emulator.clone()
    } else {
        emulator_for(dir.path(), &socket)
    };
    // Lazy mode for the non-root tenant: the fix the userfaultfd item names.
    let _uffd = Sysctl::set("/proc/sys/vm/unprivileged_userfaultfd", "1");
    let (code, report) = check_with(
        &shipped.hugemem,
        &[
            "--config",
            cfg.to_str().expect("utf-8"),
            "--qemu-conf",
            conf.to_str().expect("utf-8"),
            "--emulator",
            emulator.to_str().expect("utf-8"),
        ],
    );
    eprintln!("{report:#}");
    let svm_offered = svm_offered_to_guests();
    for i in report["items"].as_array().expect("items") {
        if i["name"] == "cpu-svm" && !svm_offered {
            // This host's CPU decides (never assumed): where KVM offers
            // guests no svm (every Intel host, an AMD one without nested
            // SVM), a CPU model listing svm fails under libvirt: the hint.
            assert_eq!(i["status"], "WARN", "{i:#}");
            assert!(
                i["why"]
                    .as_str()
                    .expect("why")
                    .contains("Host CPU does not provide required features: svm"),
                "{i:#}"
            );
            assert!(
                i["fix"]
                    .as_str()
                    .expect("fix")
                    .contains("<feature policy='disable' name='svm'/>"),
                "{i:#}"
            );
            continue;
        }
        if i["name"] == "cloud-hypervisor"
            && i["status"] == "SKIP"
            && std::env::var_os("CLOUD_HYPERVISOR").is_none()
        {
            // No cloud-hypervisor here (CI names its build; the test of
            // its two items below says what a found one gives).
            eprintln!("NOTE: no cloud-hypervisor on this host: {i}");
            continue;
        }
        if i["name"] == "hugepages-1G" && i["status"] == "WARN" {
            // A host without 1 GiB pages (not CI's: it reserves two).
            eprintln!("NOTE: no 1G pages on this host: {i}");
            continue;
        }
        assert_eq!(i["status"], "PASS", "{i:#}");
    }
    assert_eq!(code, 0, "{report:#}");
    expect(
        &report,
        &format!("daemon-uid-{uid}"),
        "PASS",
        "gets HANDSHAKE and STATS",
    );
    expect(&report, "libvirt-user", "PASS", "which allowed_uids lists");
    expect(
        &report,
        "userfaultfd",
        "PASS",
        "vm.unprivileged_userfaultfd = 1",
    );
    println!(
        "OBSERVED: hugemem check on a ready host: {}",
        report["summary"]
    );
}

/// Whether this host's KVM offers svm to guests: an AMD CPU with `svm` and
/// `kvm_amd` loaded with `nested=1` (read here independently of the check).
fn svm_offered_to_guests() -> bool {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let amd = cpuinfo
        .lines()
        .any(|l| l.starts_with("vendor_id") && l.ends_with("AuthenticAMD"));
    let svm = cpuinfo
        .lines()
        .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "svm"));
    let nested = std::fs::read_to_string("/sys/module/kvm_amd/parameters/nested")
        .is_ok_and(|n| matches!(n.trim(), "1" | "Y"));
    amd && svm && nested
}

/// `getent group NAME`'s gid.
fn group_id(name: &str) -> Option<u32> {
    let out = Command::new("getent").args(["group", name]).output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .split(':')
        .nth(2)?
        .trim()
        .parse()
        .ok()
}

/// A fake sysfs whose 1G and 2M pools (host-wide and node 0) are empty,
/// and a procfs root with the host's files but `mounts` as given.
fn fake_roots(dir: &Path, empty_pools: bool, mounts: Option<&str>) -> (PathBuf, PathBuf) {
    let sys = dir.join("sys");
    for kb in [1_048_576u64, 2048] {
        for base in [
            sys.join("kernel/mm/hugepages"),
            sys.join("devices/system/node/node0/hugepages"),
        ] {
            let pool = base.join(format!("hugepages-{kb}kB"));
            std::fs::create_dir_all(&pool).expect("mkdir");
            let n = if empty_pools { 0 } else { 4 };
            for f in [
                "nr_hugepages",
                "free_hugepages",
                "surplus_hugepages",
                "resv_hugepages",
            ] {
                let v = if f.starts_with("nr") || f.starts_with("free") {
                    n
                } else {
                    0
                };
                std::fs::write(pool.join(f), format!("{v}\n")).expect("write");
            }
        }
    }
    let proc = dir.join("proc");
    std::fs::create_dir_all(proc.join("sys/vm")).expect("mkdir");
    for f in ["meminfo", "buddyinfo", "cpuinfo"] {
        let text = std::fs::read_to_string(Path::new("/proc").join(f)).unwrap_or_default();
        std::fs::write(proc.join(f), text).expect("write");
    }
    std::fs::write(proc.join("sys/vm/unprivileged_userfaultfd"), "1\n").expect("write");
    let host_mounts = std::fs::read_to_string("/proc/mounts").expect("mounts");
    let fake_mounts = mounts.map_or(
        "hugetlbfs /dev/hugepages-1G hugetlbfs rw,relatime,mode=1770,pagesize=1024M 0 0\n\
         hugetlbfs /dev/hugepages-2M hugetlbfs rw,relatime,mode=1770,pagesize=2M 0 0\n"
            .to_string()
            + &host_mounts,
        str::to_string,
    );
    std::fs::write(proc.join("mounts"), fake_mounts).expect("write");
    (sys, proc)
}

#[test]
fn no_huge_pages_fails_naming_the_empty_pools() {
    let dir = open_tempdir();
    let (sys, proc) = fake_roots(dir.path(), true, None);
    let cfg = config(dir.path(), &dir.path().join("none.sock"), &[], None, "");
    let (code, report) = check(&[
        "--config",
        cfg.to_str().expect("utf-8"),
        "--sys",
        sys.to_str().expect("utf-8"),
        "--proc",
        proc.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 1, "{report:#}");
    expect(
        &report,
        "hugepages",
        "FAIL",
        "no huge pages reserved at all",
    );
    expect(&report, "hugepages-1G", "WARN", "no 1G pages reserved");
    expect(&report, "hugepages-2M", "WARN", "no 2M pages reserved");
}

#[test]
fn fewer_pages_than_the_configuration_asks_fails_naming_the_key() {
    let dir = open_tempdir();
    let (sys, proc) = fake_roots(dir.path(), false, None);
    let cfg = config(
        dir.path(),
        &dir.path().join("none.sock"),
        &[],
        None,
        "\n[hugepages]\npages_1g = 6\n",
    );
    let (code, report) = check(&[
        "--config",
        cfg.to_str().expect("utf-8"),
        "--sys",
        sys.to_str().expect("utf-8"),
        "--proc",
        proc.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 1, "{report:#}");
    expect(
        &report,
        "hugepages-1G",
        "FAIL",
        "4 of the 6 x 1G pages [hugepages] pages_1g asks for",
    );
    expect(&report, "hugepages-2M", "PASS", "4 reserved host-wide");
}

#[test]
fn no_hugetlbfs_mount_fails_naming_the_page_size() {
    let dir = open_tempdir();
    let (sys, proc) = fake_roots(dir.path(), false, Some("proc /proc proc rw 0 0\n"));
    let cfg = config(dir.path(), &dir.path().join("none.sock"), &[], None, "");
    let (code, report) = check(&[
        "--config",
        cfg.to_str().expect("utf-8"),
        "--sys",
        sys.to_str().expect("utf-8"),
        "--proc",
        proc.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 1, "{report:#}");
    expect(
        &report,
        "hugetlbfs-1G",
        "FAIL",
        "no hugetlbfs mounted for 1G pages",
    );
    expect(
        &report,
        "hugetlbfs-2M",
        "FAIL",
        "no hugetlbfs mounted for 2M pages",
    );
}

#[test]
fn a_closed_socket_fails_naming_the_socket() {
    let dir = open_tempdir();
    let socket = dir.path().join("hugemem.sock");
    // A socket file nothing listens on any more (a daemon that died).
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
    let cfg = config(dir.path(), &socket, &[], None, "");
    let (code, report) = check(&["--config", cfg.to_str().expect("utf-8")]);
    assert_eq!(code, 1, "{report:#}");
    expect(
        &report,
        "daemon",
        "FAIL",
        &format!(
            "nothing answers on {}: Connection refused",
            socket.display()
        ),
    );
}

#[test]
fn a_uid_not_allowed_fails_naming_the_uid() {
    let _s = serial();
    let dir = open_tempdir();
    let socket = dir.path().join("run/hugemem.sock");
    let (nobody, nogroup) = ids("nobody").expect("user nobody");
    // The daemon's configuration allows nobody no access; libvirt (this
    // test's qemu.conf) runs QEMU as nobody.
    let cfg = config(dir.path(), &socket, &[], Some(nogroup), "");
    let _daemon = daemon_on(&cfg);
    let conf = qemu_conf(dir.path(), "nobody", "nogroup");
    let emulator = emulator_for(dir.path(), &socket);
    let (code, report) = check(&[
        "--config",
        cfg.to_str().expect("utf-8"),
        "--qemu-conf",
        conf.to_str().expect("utf-8"),
        "--emulator",
        emulator.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 1, "{report:#}");
    expect(&report, "daemon", "PASS", "answers on");
    expect(
        &report,
        "libvirt-user",
        "FAIL",
        &format!("libvirt runs QEMU as nobody (uid {nobody})"),
    );
    assert!(
        item(&report, "libvirt-user")["fix"]
            .as_str()
            .expect("fix")
            .contains(&format!("add {nobody} to allowed_uids")),
        "{report:#}"
    );
    if is_root() {
        // The HANDSHAKE as nobody, turned away by the daemon's uid check.
        expect(
            &report,
            &format!("daemon-uid-{nobody}"),
            "FAIL",
            &format!("uid {nobody} is not allowed"),
        );
    } else {
        expect(
            &report,
            &format!("daemon-uid-{nobody}"),
            "SKIP",
            "needs root",
        );
    }
}

#[test]
fn the_text_form_says_the_same_and_the_exit_code_follows_the_fails() {
    let dir = open_tempdir();
    let socket = dir.path().join("hugemem.sock");
    let cfg = config(dir.path(), &socket, &[], None, "");
    let out = Command::new(HUGEMEM)
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .expect("hugemem check");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("FAIL daemon"), "{text}");
    assert!(text.contains("-> systemctl start hugemem"), "{text}");
    assert!(
        text.lines().last().is_some_and(|l| l.contains("failed")),
        "{text}"
    );
    // A configuration the daemon would refuse is a FAIL of its own.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "no_such_key = 1\n").expect("write");
    let (code, report) = check(&["--config", bad.to_str().expect("utf-8")]);
    assert_eq!(code, 1);
    expect(&report, "config", "FAIL", "no_such_key");
}

#[test]
fn checks_it_cannot_make_say_why() {
    let dir = open_tempdir();
    let cfg = config(
        dir.path(),
        &dir.path().join("none.sock"),
        &[65534],
        Some(65534),
        "",
    );
    // No libvirt: its items are one SKIP that says so.
    let missing = dir.path().join("no-libvirt/qemu.conf");
    let (_, report) = check(&[
        "--config",
        cfg.to_str().expect("utf-8"),
        "--qemu-conf",
        missing.to_str().expect("utf-8"),
    ]);
    expect(&report, "libvirt", "SKIP", "libvirt is not installed");
    assert!(report["items"]
        .as_array()
        .expect("items")
        .iter()
        .all(|i| i["name"] != "libvirt-user"));
    if !is_root() {
        expect(&report, "privileges", "SKIP", "need root");
        return;
    }
    // Not root: the probes as other uids are not made, and it says so.
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(HUGEMEM)
        .args(["check", "--json", "--config"])
        .arg(&cfg)
        .args(["--qemu-conf"])
        .arg(&missing)
        .output()
        .expect("hugemem check as nobody");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    expect(&report, "privileges", "SKIP", "running as uid 65534");
    // Whether uid 65534 may open /dev/userfaultfd is a probe as that uid:
    // skipped, and said so, unless the sysctl opens it to everyone.
    let uffd = item(&report, "userfaultfd");
    if uffd["status"] != "PASS" {
        expect(&report, "userfaultfd", "SKIP", "needs root to test");
    }
}

/// `hugemem check --json` with `CLOUD_HYPERVISOR` set to `ch`.
fn check_ch(ch: &Path) -> Value {
    let dir = open_tempdir();
    let cfg = config(dir.path(), &dir.path().join("none.sock"), &[], None, "");
    let out = Command::new(HUGEMEM)
        .args(["check", "--json", "--config"])
        .arg(&cfg)
        .env("CLOUD_HYPERVISOR", ch)
        .output()
        .expect("hugemem check");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn the_cloud_hypervisor_found_is_named_with_its_protocol_and_build() {
    let Some(built) = test_support::cloud_hypervisor::binaries_or_skip() else {
        return;
    };
    let ch = built.cloud_hypervisor.clone();
    let report = check_ch(&ch);
    let version = Command::new(&ch)
        .arg("--version")
        .output()
        .expect("cloud-hypervisor --version");
    let release = String::from_utf8_lossy(&version.stdout)
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("cloud-hypervisor "))
        .expect("cloud-hypervisor vX")
        .to_owned();
    expect(
        &report,
        "cloud-hypervisor",
        "PASS",
        &format!(
            "{} (from CLOUD_HYPERVISOR): cloud-hypervisor {release}, migration protocol versions",
            ch.display()
        ),
    );
    let built = hugemem::check::cloud_hypervisor::build_entry(&ch).is_some_and(|(_, commit)| {
        ch_migration::version::CLOUD_HYPERVISOR_COMMIT.starts_with(commit.as_str())
    });
    if built && Path::new("/dev/kvm").exists() {
        // The project's build of the commit hugemem speaks: the one the
        // cloud-hypervisor tests pass with on this host.
        expect(
            &report,
            "ch-migration",
            "PASS",
            "local migration and offload work: protocol version 0",
        );
    } else {
        let i = item(&report, "ch-migration");
        assert_ne!(i["status"], "FAIL", "{i:#}");
        eprintln!("NOTE: not the project's build: {i}");
    }
    println!(
        "OBSERVED: hugemem check of {}: {} / {}",
        ch.display(),
        item(&report, "cloud-hypervisor")["why"],
        item(&report, "ch-migration")["why"]
    );
}

#[test]
fn a_cloud_hypervisor_that_dropped_the_protocol_fails_naming_the_version_hugemem_speaks() {
    let dir = open_tempdir();
    let newer = dir.path().join("cloud-hypervisor");
    std::fs::write(
        &newer,
        "#!/bin/sh\necho 'cloud-hypervisor v57.0.0'\necho 'Migration Protocol Versions: 1, 2'\n",
    )
    .expect("write");
    std::fs::set_permissions(&newer, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let report = check_ch(&newer);
    expect(
        &report,
        "cloud-hypervisor",
        "PASS",
        "cloud-hypervisor v57.0.0",
    );
    expect(
        &report,
        "ch-migration",
        "FAIL",
        ch_migration::version::SPOKEN,
    );
    // Something that is no cloud-hypervisor says so.
    let report = check_ch(Path::new("/bin/true"));
    expect(
        &report,
        "cloud-hypervisor",
        "FAIL",
        "is it cloud-hypervisor?",
    );
}
