//! QEMU through libvirt: real libvirtd (Debian's libvirt 9 packages, which
//! `.ci/run` installs) starts TCG domains whose `<emulator>` is the shipped
//! `scripts/hugemem-qemu`, i.e. `hugemem qemu-wrapper`, against a daemon on a
//! socket that libvirt's unprivileged QEMU user (`libvirt-qemu`) is allowed
//! to use. With `HUGEMEM_INSTALLED=1` (CI, after `apt-get install
//! ./hugemem_*.deb`) the `<emulator>` is the package's `/usr/bin/hugemem-qemu`
//! as installed, running `/usr/bin/hugemem`, and the daemon serves the
//! socket that script names (`/run/hugemem/hugemem.sock`); from the build
//! tree, the script is rewritten to this build's binary and a private socket. The domains boot the micro-guest (PVH ELF as `<kernel>`) on 2 GiB
//! in two guest NUMA cells of huge pages, and the test checks:
//!
//! * from STATS: two 1 GiB (or 2 MiB) regions in use, on the asked node,
//!   and each is a memfd QEMU holds (the region's inode is one of the QEMU
//!   pid's open files);
//! * from the guest: its serial report (it read zeros everywhere), and the
//!   values it wrote are in the daemon's memfds at the offsets of their
//!   guest-physical addresses, read through QEMU's own fds;
//! * `virsh shutdown` and `virsh reboot` are accepted and change nothing (the
//!   micro-guest has no ACPI: libvirt starts it `-no-acpi`, so neither
//!   request reaches it); `virsh reset` reboots it on the *same* memory (its
//!   second report sees what its first boot wrote);
//! * a libvirtd restart while the domain runs: the new libvirtd finds the
//!   domain running with the same QEMU pid, and the allocation is untouched;
//! * `virsh destroy` frees the memory (pooled, scrubbed); a second domain gets
//!   the pooled pages (`regions_pooled`) and reads no byte of the first
//!   (its report says zeros everywhere); it asks for `<source type='memfd'/>`,
//!   so both of libvirt's huge-page forms (`memory-backend-file` on a
//!   hugetlbfs directory, `memory-backend-memfd` with `hugetlb`) are covered;
//! * a domain asking for `<discard/>` (QEMU `discard-data`) is refused with a
//!   message in libvirt's domain log and nothing is allocated.
//!
//! A second test takes such a domain through a life beyond boot and exit
//! (issue 26): `virsh save` then `virsh restore`, `virsh managedsave` then
//! `virsh start`. Each save releases the allocation (QEMU exits; its regions
//! come back to the pool, scrubbed); each restore is a new QEMU through the
//! wrapper on a fresh allocation that QEMU fills from the image, and the
//! guest's values are at their guest-physical offsets of the new memfds.
//! After the final destroy nothing is allocated, `created − released ==
//! held`, and the next domain reads zeros. It prints the save and restore
//! wall times (`MEASURED …`), without asserting on them.
//!
//! A third test live-migrates such a domain (`virsh migrate --live`) between
//! two libvirtds here, each set up as below in its own mount and UTS
//! namespaces over its own directories, with its own `host_uuid` in
//! `libvirtd.conf` and its own hostname, both with the wrapper on the same
//! daemon. The stream goes over a UNIX socket: while it runs, the test sees
//! the destination listen there and neither QEMU hold a TCP socket. The
//! destination runs on a fresh allocation with the guest's values in it (and
//! the guest, reset, finds them); the source's allocation is released once
//! the source QEMU exits; the totals balance; after the final destroy
//! nothing is allocated. It prints the migration's wall time, the RAM size
//! and the destination's `domjobinfo`, without asserting on them. Both
//! domains' memory is held during the migration: it wants 4 GiB of huge
//! pages.
//!
//! # How libvirtd runs here
//!
//! There is no systemd as PID 1 here, so the test starts `libvirtd --daemon`
//! itself, as root, in a private mount namespace (`unshare -m`) in which
//! `/etc/libvirt`, `/var/lib/libvirt`, `/run/libvirt`, `/var/log/libvirt` and
//! `/var/cache/libvirt` are bind mounts of directories in the test's temporary
//! directory, seeded from the packages' own files (`cp -a`, so
//! `/var/lib/libvirt/qemu` keeps its `libvirt-qemu` owner). The host's libvirt
//! state is untouched, and a restart is another `libvirtd` in another such
//! namespace over the same directories. `qemu.conf` is the package's with
//! one line added, `stdio_handler = "file"` (no virtlogd). virsh reaches it
//! through `qemu:///system?socket=<dir>/run/libvirt/libvirt-sock`. Everything
//! else is libvirt's default: QEMU as `libvirt-qemu`, a private `/dev`
//! (`namespaces = [ "mount" ]`), cgroup device rules.
//!
//! Runs under the machine lock (huge pages, QEMU).

use std::borrow::BorrowMut;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backend::stats::Stats;
use guest_mem::{PageSize, Reservation};
use microguest::{pattern, pvh_elf, PvhConfig};
use test_support::hugepages::hold;
use test_support::prelude::TestDaemon;

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
/// The socket the installed emulator script names (the package's default).
const INSTALLED_SOCKET: &str = test_support::installed::paths::SOCKET;
const QEMU: &str = "/usr/bin/qemu-system-x86_64";
const QEMU_USER: &str = "libvirt-qemu";
const STRIDE: u64 = 2 << 20;
/// Where the guest starts touching memory (QEMU's firmware writes below 1 MiB).
const START_GPA: u64 = 1 << 20;

fn skip_reason() -> Option<String> {
    if id(&["-u"]) != Some(0) {
        return Some("not root (libvirtd, namespaces and huge pages need it)".into());
    }
    for (path, package) in [
        ("/usr/sbin/libvirtd", "libvirt-daemon"),
        ("/usr/bin/virsh", "libvirt-clients"),
        (QEMU, "qemu-system-x86"),
        ("/usr/bin/unshare", "util-linux"),
        (
            "/usr/lib/x86_64-linux-gnu/libvirt/connection-driver/libvirt_driver_qemu.so",
            "libvirt-daemon-driver-qemu",
        ),
        ("/etc/libvirt/qemu.conf", "libvirt-daemon-system"),
    ] {
        if !Path::new(path).exists() {
            return Some(format!("{path} missing (Debian package {package})"));
        }
    }
    if id(&["-u", QEMU_USER]).is_none() {
        return Some(format!(
            "no user {QEMU_USER} (created by Debian's libvirt-daemon-system)"
        ));
    }
    None
}

/// `id ARGS` as a number.
fn id(args: &[&str]) -> Option<u32> {
    let out = Command::new("id").args(args).output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Whether `user` may read and write `path` (`test -r -a -w` as that user).
fn accessible_to(user: &str, path: &str) -> bool {
    Command::new("setpriv")
        .args([
            "--reuid",
            user,
            "--regid",
            user,
            "--init-groups",
            "test",
            "-r",
            path,
            "-a",
            "-w",
            path,
        ])
        .status()
        .is_ok_and(|s| s.success())
}

/// 1 GiB pages when two can be reserved, else 2 MiB ones.
fn pages_for_2g() -> Option<(&'static str, u64, Reservation)> {
    pages_for_gib(2)
}

/// `gib` GiB of huge pages held: 1 GiB pages when they can be reserved, else
/// 2 MiB ones; `None`, with a recorded skip, when neither can.
fn pages_for_gib(gib: u64) -> Option<(&'static str, u64, Reservation)> {
    match hold(PageSize::Huge1G, gib) {
        Ok(r) => return Some(("G", 1 << 30, r)),
        Err(why) => eprintln!("NOTE: {why}; trying 2M pages"),
    }
    match hold(PageSize::Huge2M, gib * 512) {
        Ok(r) => Some(("M", 2 << 20, r)),
        Err(why) => {
            test_support::skip!("no {gib} x 1G pages, and {why}");
            None
        }
    }
}

fn run(mut cmd: impl BorrowMut<Command>) -> Output {
    let cmd = cmd.borrow_mut();
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn ok(mut cmd: impl BorrowMut<Command>) -> String {
    let cmd = cmd.borrow_mut();
    let out = run(&mut *cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The directories libvirt keeps its state in, bind-mounted from the test's.
const LIBVIRT_DIRS: &[&str] = &[
    "/etc/libvirt",
    "/var/lib/libvirt",
    "/run/libvirt",
    "/var/log/libvirt",
    "/var/cache/libvirt",
];

/// A libvirtd in a private mount namespace over the test's directories.
struct Libvirt {
    base: PathBuf,
    /// Its own host identity, for a migration between two libvirtds here.
    host: Option<Host>,
}

/// What makes a libvirtd another host: `host_uuid` in its `libvirtd.conf`
/// (libvirt refuses a migration to the same host UUID) and its own hostname
/// in a private UTS namespace.
struct Host {
    uuid: &'static str,
    hostname: &'static str,
}

impl Libvirt {
    fn setup(base: &Path) -> Self {
        Self::setup_as(base, None)
    }

    /// [`Libvirt::setup`], as the host `host` when given.
    fn setup_as(base: &Path, host: Option<Host>) -> Self {
        for d in LIBVIRT_DIRS {
            let private = base.join(d.trim_start_matches('/'));
            std::fs::create_dir_all(&private).expect("private dir");
            // The mount point itself, on the host (empty where libvirt is not in use).
            std::fs::create_dir_all(d).expect("mount point");
        }
        for d in ["/etc/libvirt", "/var/lib/libvirt"] {
            ok(Command::new("cp")
                .arg("-a")
                .arg(format!("{d}/."))
                .arg(base.join(d.trim_start_matches('/'))));
        }
        let conf = base.join("etc/libvirt/qemu.conf");
        let mut text = std::fs::read_to_string(&conf).expect("qemu.conf");
        text.push_str("\n# hugemem libvirt test: no virtlogd\nstdio_handler = \"file\"\n");
        std::fs::write(&conf, text).expect("write qemu.conf");
        if let Some(host) = &host {
            let conf = base.join("etc/libvirt/libvirtd.conf");
            let mut text = std::fs::read_to_string(&conf).expect("libvirtd.conf");
            text.push_str(&format!(
                "\n# hugemem libvirt test: another host\nhost_uuid = \"{}\"\n",
                host.uuid
            ));
            std::fs::write(&conf, text).expect("write libvirtd.conf");
        }
        let lv = Self {
            base: base.to_path_buf(),
            host,
        };
        lv.start();
        lv
    }

    fn pidfile(&self) -> PathBuf {
        self.base.join("run/libvirt/libvirtd.pid")
    }

    fn socket(&self) -> PathBuf {
        self.base.join("run/libvirt/libvirt-sock")
    }

    /// `libvirtd --daemon` in a new private mount namespace; returns once
    /// virsh gets an answer.
    fn start(&self) {
        // libvirtd must not inherit the test's fds (bash: dash cannot close fd 10 and up): an inherited
        // `flock /tmp/hugemem-machine.lock` fd would keep the machine lock
        // held by the daemon after the test.
        let mut script = String::from(
            "set -e\nfor fd in $(ls /proc/$$/fd); do [ \"$fd\" -le 2 ] || eval \"exec $fd>&-\"; done\n",
        );
        for d in LIBVIRT_DIRS {
            script.push_str(&format!(
                "mount --bind '{}' '{d}'\n",
                self.base.join(d.trim_start_matches('/')).display()
            ));
        }
        let mut unshare = Command::new("unshare");
        unshare.args(["-m", "--propagation", "private"]);
        if let Some(host) = &self.host {
            unshare.arg("-u");
            script.push_str(&format!("hostname '{}'\n", host.hostname));
        }
        script.push_str("exec libvirtd --daemon --pid-file /run/libvirt/libvirtd.pid\n");
        ok(unshare.args(["bash", "-c", &script]));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = run(self.virsh(&["version"]));
            if out.status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "libvirtd did not answer within 30 s: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn libvirtd_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.pidfile())
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// SIGTERM to libvirtd; waits until it is gone. Its domains keep running.
    fn stop(&self) {
        let Some(pid) = self.libvirtd_pid() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(pid);
        if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).is_err() {
            return;
        }
        test_support::prelude::wait_until("libvirtd exited", Duration::from_secs(30), || {
            nix::sys::signal::kill(pid, None).is_err()
        });
    }

    /// The URI virsh connects to this libvirtd by.
    fn uri(&self) -> String {
        format!("qemu:///system?socket={}", self.socket().display())
    }

    fn virsh(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("timeout");
        cmd.args(["60", "virsh", "-c"]).arg(self.uri()).args(args);
        cmd
    }

    /// QEMU's pid for a running domain (libvirt's pid file for it).
    fn qemu_pid(&self, name: &str) -> i32 {
        let path = self.base.join(format!("run/libvirt/qemu/{name}.pid"));
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .trim()
            .parse()
            .expect("pid")
    }

    fn domain_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.base.join(format!("var/log/libvirt/qemu/{name}.log")))
            .unwrap_or_default()
    }

    fn domstate(&self, name: &str) -> String {
        ok(self.virsh(&["domstate", name])).trim().to_string()
    }
}

impl Drop for Libvirt {
    fn drop(&mut self) {
        // Destroy what still runs (a failed assertion), then stop libvirtd.
        if let Ok(out) = self.virsh(&["list", "--name"]).output() {
            for name in String::from_utf8_lossy(&out.stdout).lines() {
                if !name.trim().is_empty() {
                    let _ = self.virsh(&["destroy", name.trim()]).output();
                }
            }
        }
        self.stop();
    }
}

/// A domain's files.
struct Domain {
    name: String,
    xml: PathBuf,
    serial: PathBuf,
    marker: u64,
}

/// Writes the guest ELF and the domain XML: 2 GiB in two guest NUMA cells of
/// `page_unit` huge pages, both on host node 0, `extra` added to
/// `<memoryBacking>`.
fn domain(dir: &Path, name: &str, emulator: &Path, unit: &str, marker: u64, extra: &str) -> Domain {
    let cfg = PvhConfig {
        stride: STRIDE,
        marker,
        start_gpa: START_GPA,
        ..Default::default()
    };
    let elf = dir.join(format!("{name}.elf"));
    std::fs::write(&elf, pvh_elf(&cfg).expect("pvh elf")).expect("write elf");
    let serial = dir.join(format!("{name}.serial"));
    let page = if unit == "G" { "1" } else { "2" };
    let xml = format!(
        r#"<domain type='qemu'>
  <name>{name}</name>
  <memory unit='GiB'>2</memory>
  <memoryBacking>
    <hugepages><page size='{page}' unit='{unit}'/></hugepages>
    <access mode='shared'/>{extra}
  </memoryBacking>
  <vcpu>2</vcpu>
  <numatune>
    <memnode cellid='0' mode='strict' nodeset='0'/>
    <memnode cellid='1' mode='strict' nodeset='0'/>
  </numatune>
  <os><type arch='x86_64' machine='pc'>hvm</type><kernel>{elf}</kernel></os>
  <cpu mode='custom' match='exact'><model fallback='allow'>qemu64</model>
    <numa>
      <cell id='0' cpus='0' memory='1' unit='GiB'/>
      <cell id='1' cpus='1' memory='1' unit='GiB'/>
    </numa>
  </cpu>
  <devices>
    <emulator>{emulator}</emulator>
    <serial type='file'><source path='{serial}'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
</domain>
"#,
        elf = elf.display(),
        emulator = emulator.display(),
        serial = serial.display(),
    );
    let path = dir.join(format!("{name}.xml"));
    std::fs::write(&path, xml).expect("write xml");
    Domain {
        name: name.to_string(),
        xml: path,
        serial,
        marker,
    }
}

/// The guest's serial report lines so far.
fn reports(d: &Domain) -> Vec<String> {
    // Whole lines only: the guest may be halfway through writing one (a
    // report read as "HUGEMEM-GUEST pages=" failed a run).
    std::fs::read_to_string(&d.serial)
        .unwrap_or_default()
        .split_inclusive('\n')
        .filter_map(|l| l.strip_suffix('\n'))
        .map(|l| l.trim_end_matches('\r'))
        .filter(|l| l.starts_with("HUGEMEM-GUEST "))
        .map(str::to_string)
        .collect()
}

/// Waits until the guest has written `n` reports; returns them.
fn wait_reports(lv: &Libvirt, d: &Domain, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = reports(d);
        if r.len() >= n {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "{}: {} guest report(s) after 60 s, want {n}; domain log:\n{}",
            d.name,
            r.len(),
            lv.domain_log(&d.name)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The shipped `scripts/hugemem-qemu` with this build's binary and the test
/// daemon's socket in place of the installed defaults.
fn install_shim(dir: &Path, socket: &Path) -> PathBuf {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/hugemem-qemu");
    let text = std::fs::read_to_string(&shipped).expect("scripts/hugemem-qemu");
    assert!(text.contains("/usr/bin/hugemem}") && text.contains(INSTALLED_SOCKET));
    let text = text
        .replace("/usr/bin/hugemem}", &format!("{HUGEMEM}}}"))
        .replace(INSTALLED_SOCKET, &socket.display().to_string());
    let path = dir.join("hugemem-qemu");
    std::fs::write(&path, text).expect("write shim");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// The in-use regions of STATS, sorted by id.
fn in_use(stats: &Stats) -> Vec<backend::stats::RegionStats> {
    let mut r: Vec<_> = stats
        .regions
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r.state == "in_use")
        .collect();
    r.sort_by_key(|r| r.id);
    r
}

/// The memory-backend mem-paths QEMU got, per backend id, from its cmdline.
fn mem_paths(pid: i32) -> Vec<(String, String)> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let mut out = Vec::new();
    for arg in cmdline.split(|b| *b == 0) {
        let arg = String::from_utf8_lossy(arg);
        if !arg.starts_with('{') || !arg.contains("memory-backend") {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&arg).expect("json object");
        out.push((
            v["id"].as_str().expect("id").to_string(),
            v["mem-path"].as_str().expect("mem-path").to_string(),
        ));
    }
    out.sort();
    out
}

/// Checks that the running domain's RAM is the daemon's: STATS has two
/// in-use regions of `page` pages on node 0 whose inodes are QEMU's
/// `/proc/self/fd/N` mem-paths, and the values the guest wrote are in them.
fn check_ram_is_the_daemons(lv: &Libvirt, daemon: &TestDaemon, d: &Domain, page: u64) -> Vec<u64> {
    let pid = lv.qemu_pid(&d.name);
    let stats = daemon.stats();
    let regions = in_use(&stats);
    assert_eq!(stats.allocations.active, 2, "{stats}");
    assert_eq!(regions.len(), 2, "{stats}");
    let page_name = guest_mem::size::format_size(page);
    for r in &regions {
        assert_eq!((r.bytes, r.node), (1 << 30, 0), "{stats}");
        assert_eq!(r.page_size, page_name, "{stats}");
    }
    let paths = mem_paths(pid);
    assert_eq!(
        paths.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(),
        ["ram-node0", "ram-node1"],
        "QEMU's backends: {paths:?}"
    );
    let mut ids = Vec::new();
    for (cell, (id, path)) in paths.iter().enumerate() {
        let fd = path
            .strip_prefix("/proc/self/fd/")
            .unwrap_or_else(|| panic!("{id}: mem-path {path} is not an inherited fd"));
        let file = std::fs::File::open(format!("/proc/{pid}/fd/{fd}")).expect("QEMU's memfd");
        let ino = file.metadata().expect("stat").ino();
        let region = regions.iter().find(|r| r.inode == ino).unwrap_or_else(|| {
            panic!("{id}: QEMU's fd {fd} (inode {ino}) is no in-use region: {stats}")
        });
        ids.push(region.id);
        // Cell `cell` is guest-physical [cell GiB, cell+1 GiB): what the guest
        // wrote at a page there is at that offset of the memfd.
        let base = cell as u64 * (1 << 30);
        let mut checked = 0;
        for offset in [4 * STRIDE, 300 * STRIDE, 511 * STRIDE] {
            let gpa = base + offset;
            let mut buf = [0u8; 8];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, offset).expect("read");
            assert_eq!(
                u64::from_le_bytes(buf),
                pattern(d.marker, gpa),
                "{id}: the guest's value at GPA {gpa:#x} is not at offset {offset:#x} of the daemon's region {}",
                region.id
            );
            checked += 1;
        }
        assert_eq!(checked, 3);
    }
    ids
}

/// What every test here stands on: a temporary directory libvirt's QEMU
/// user can reach (guest files, the shim, the socket), a daemon on a socket
/// that user may use, and the shipped wrapper installed against it.
struct Stage {
    tmp: tempfile::TempDir,
    daemon: TestDaemon,
    guests: PathBuf,
    shim: PathBuf,
    qemu_uid: u32,
}

impl Stage {
    fn new() -> Stage {
        if !accessible_to(QEMU_USER, "/dev/kvm") && Path::new("/dev/kvm").exists() {
            // libvirt 9 probes QEMU with its capabilities kept (so the probe sees
            // KVM) but checks /dev/kvm as the QEMU user: on a host where that user
            // cannot open /dev/kvm it re-probes QEMU on every API call (about 4 s
            // each; its debug log: "KVM was enabled when probing ..., but it is
            // not available now"). Correct, only slow; .ci/run gives /dev/kvm
            // the group and mode Debian's udev rules give it (root:kvm 0660).
            eprintln!("NOTE: {QEMU_USER} cannot open /dev/kvm: libvirt re-probes QEMU on every call, the test takes minutes");
        }
        let qemu_uid = id(&["-u", QEMU_USER]).expect("uid");
        let qemu_gid = id(&["-g", QEMU_USER]).expect("gid");
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        // libvirt-qemu must reach the guest files, the shim and the socket.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let guests = dir.join("guests");
        std::fs::create_dir(&guests).expect("guests dir");
        std::fs::set_permissions(&guests, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let shipped = test_support::installed::shipped(HUGEMEM, &repo);
        // Installed (CI, HUGEMEM_INSTALLED=1): the package's emulator script
        // as installed, so the daemon serves the socket it names; from the
        // build tree: the script rewritten to this build and a private socket.
        let socket = if shipped.installed {
            test_support::installed::runtime_dir_for(qemu_gid)
        } else {
            dir.join("hugemem/hugemem.sock")
        };
        let daemon = TestDaemon::start(|c| {
            c.socket = socket.clone();
            c.allowed_uids = vec![qemu_uid];
            c.socket_group = Some(qemu_gid);
            c.pool.recheck_ms = 20;
        });
        let shim = if shipped.installed {
            shipped.emulator.clone()
        } else {
            install_shim(dir, &socket)
        };
        Stage {
            tmp,
            daemon,
            guests,
            shim,
            qemu_uid,
        }
    }
}

#[test]
fn libvirt_domains_run_on_daemon_memory() {
    let _serial = test_support::prelude::serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    let Some((unit, page, _pages)) = pages_for_2g() else {
        return;
    };
    // Bound left to right, dropped right to left: the directory goes last.
    let Stage {
        tmp,
        daemon,
        guests,
        shim,
        qemu_uid,
    } = Stage::new();
    let dir = tmp.path();
    let lv = Libvirt::setup(&dir.join("libvirt"));
    let t0 = Instant::now();
    let step = |what: &str| eprintln!("[{:7.1} s] {what}", t0.elapsed().as_secs_f64());
    step(&format!(
        "libvirtd up; {page}-byte pages; QEMU user uid {qemu_uid}"
    ));

    // Domain A: start, check its RAM from STATS and from the guest.
    let a = domain(&guests, "hm-a", &shim, unit, 0xA5A5_0000_0000_0000, "");
    ok(lv.virsh(&["define", a.xml.to_str().expect("utf-8")]));
    ok(lv.virsh(&["start", &a.name]));
    let r = wait_reports(&lv, &a, 1);
    assert!(
        r[0].contains("nonzero=0"),
        "fresh daemon memory must read as zeros: {r:?}"
    );
    let log = lv.domain_log(&a.name);
    assert!(log.contains("memory backend on hugemem memory"), "{log}");
    let ids_a = check_ram_is_the_daemons(&lv, &daemon, &a, page);
    let pid_a = lv.qemu_pid(&a.name);

    step("A checked");
    // shutdown / reboot: accepted by libvirt, never reach a guest without ACPI.
    for verb in ["shutdown", "reboot"] {
        ok(lv.virsh(&[verb, &a.name]));
        assert_eq!(lv.domstate(&a.name), "running", "after virsh {verb}");
    }
    step("shutdown/reboot done");
    // reset: the guest boots again on the same memory and sees its own writes.
    ok(lv.virsh(&["reset", &a.name]));
    let r = wait_reports(&lv, &a, 2);
    assert!(
        r[1].contains("nonzero=1"),
        "after reset the guest must find what its first boot wrote: {r:?}"
    );
    assert_eq!(lv.qemu_pid(&a.name), pid_a);
    assert_eq!(check_ram_is_the_daemons(&lv, &daemon, &a, page), ids_a);

    step("reset checked");
    // libvirtd restart while the domain runs.
    lv.stop();
    lv.start();
    assert_eq!(lv.domstate(&a.name), "running", "after a libvirtd restart");
    assert_eq!(lv.qemu_pid(&a.name), pid_a);
    assert_eq!(check_ram_is_the_daemons(&lv, &daemon, &a, page), ids_a);

    step("libvirtd restarted, A checked");
    // destroy: the memory comes back to the pool, scrubbed.
    let before = daemon.stats();
    ok(lv.virsh(&["destroy", &a.name]));
    daemon.wait_stats(Duration::from_secs(30), "destroy frees and scrubs", |s| {
        s.allocations.active == 0
            && s.pool_sum(|p| p.clean_bytes) >= 2 << 30
            && s.pool_sum(|p| p.dirty_bytes) == 0
    });

    step("A destroyed and scrubbed");
    // Domain B: the pooled pages, and no byte of A. Its memory is libvirt's
    // other huge-page form, memfd (`memory-backend-memfd` with `hugetlb`).
    let b = domain(
        &guests,
        "hm-b",
        &shim,
        unit,
        0x5A5A_0000_0000_0000,
        "\n    <source type='memfd'/>",
    );
    ok(lv.virsh(&["define", b.xml.to_str().expect("utf-8")]));
    ok(lv.virsh(&["start", &b.name]));
    let r = wait_reports(&lv, &b, 1);
    assert!(
        r[0].contains("nonzero=0"),
        "the second domain read memory the first wrote: {r:?}"
    );
    let after = daemon.stats();
    assert!(
        after.counters.regions_pooled >= before.counters.regions_pooled + 2,
        "the second domain was not served from the pool: {after}"
    );
    check_ram_is_the_daemons(&lv, &daemon, &b, page);
    let log = lv.domain_log(&b.name);
    assert!(
        log.contains(r#""qom-type":"memory-backend-memfd""#) && log.contains(r#""hugetlb":true"#),
        "libvirt did not write a hugetlb memfd backend for <source type='memfd'/>: {log}"
    );
    ok(lv.virsh(&["destroy", &b.name]));
    daemon.wait_stats(Duration::from_secs(30), "destroy of B frees", |s| {
        s.allocations.active == 0
    });

    step("B checked and destroyed");
    // Domain C asks for discard-data: refused, logged, nothing allocated.
    let allocs = daemon.stats().counters.allocs_ok;
    let c = domain(&guests, "hm-c", &shim, unit, 1, "\n    <discard/>");
    ok(lv.virsh(&["define", c.xml.to_str().expect("utf-8")]));
    let out = run(lv.virsh(&["start", &c.name]));
    assert!(!out.status.success(), "a discard domain must not start");
    let log = lv.domain_log(&c.name);
    assert!(
        log.contains("discard-data") && log.contains("not started"),
        "the domain log must say why: {log}"
    );
    assert_eq!(daemon.stats().counters.allocs_ok, allocs);

    step("C refused");
    for d in [&a, &b, &c] {
        ok(lv.virsh(&["undefine", &d.name]));
    }
    drop(lv);
    daemon.shutdown();
}

/// `created − released == held` in STATS's totals.
fn assert_balanced(stats: &Stats, when: &str) {
    let t = &stats.totals;
    assert_eq!(
        t.created_bytes - t.released_bytes,
        t.held_bytes,
        "{when}: created − released ≠ held: {stats}"
    );
}

/// The allocation ids of the in-use regions.
fn alloc_ids(stats: &Stats) -> Vec<u64> {
    let mut ids: Vec<u64> = in_use(stats).iter().filter_map(|r| r.alloc_id).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Waits until a saved domain's allocation is released: no allocation is
/// left, and each of its `regions` is back in the pool, scrubbed, or given
/// back to the kernel (none in use, quarantined or dirty).
fn wait_released(daemon: &TestDaemon, regions: &[u64], what: &str) -> Stats {
    let stats = daemon.wait_stats(Duration::from_secs(30), what, |s| {
        let given_back = s.given_back.clone().unwrap_or_default();
        s.allocations.active == 0
            && in_use(s).is_empty()
            && regions.iter().all(|id| match s.region(*id) {
                Some(r) => r.state == "clean",
                None => given_back.iter().any(|g| g.region == *id),
            })
    });
    assert_balanced(&stats, what);
    stats
}

/// The wrapper's allocation time (its `ms=`) at the domain's latest start,
/// from the domain log.
fn wrapper_alloc_ms(log: &str) -> String {
    log.lines()
        .rev()
        .find(|l| l.contains("allocated; starting QEMU"))
        .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("ms=")))
        .and_then(|ms| ms.parse::<f64>().ok())
        .map_or_else(|| "?".into(), |ms| format!("{ms:.1}"))
}

/// Where an allocation's regions came from, from the counters before and
/// after it: `pooled N, fresh M`.
fn served_from(before: &Stats, after: &Stats) -> String {
    let (b, a) = (&before.counters, &after.counters);
    format!(
        "pooled {}, fresh {}",
        a.regions_pooled - b.regions_pooled,
        a.regions_fresh - b.regions_fresh
    )
}

/// Seconds `f` took.
fn timed(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// A VM's life beyond boot and exit on pool memory (issue 26): a domain on
/// daemon memory is `virsh save`d and `virsh restore`d, then
/// `virsh managedsave`d and `virsh start`ed again. Each save releases its
/// allocation (QEMU exits); each restore runs on a fresh allocation that
/// QEMU fills from the image, so the guest's values are at their
/// guest-physical offsets of the new memfds. After the final destroy
/// nothing is allocated, the totals balance, and the next domain reads no
/// byte of this one. The save and restore wall times are printed, not
/// asserted.
#[test]
fn libvirt_save_restore_and_managedsave_on_daemon_memory() {
    let _serial = test_support::prelude::serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    let Some((unit, page, _pages)) = pages_for_2g() else {
        return;
    };
    // Bound left to right, dropped right to left: the directory goes last.
    let Stage {
        tmp,
        daemon,
        guests,
        shim,
        ..
    } = Stage::new();
    let dir = tmp.path();
    let lv = Libvirt::setup(&dir.join("libvirt"));
    let t0 = Instant::now();
    let step = |what: &str| eprintln!("[{:7.1} s] {what}", t0.elapsed().as_secs_f64());
    let ram = guest_mem::size::format_size(2 << 30);
    step(&format!("libvirtd up; {ram} of RAM on {page}-byte pages"));

    let d = domain(&guests, "hm-life", &shim, unit, 0xC3C3_0000_0000_0000, "");
    ok(lv.virsh(&["define", d.xml.to_str().expect("utf-8")]));
    ok(lv.virsh(&["start", &d.name]));
    let r = wait_reports(&lv, &d, 1);
    assert!(r[0].contains("nonzero=0"), "fresh daemon memory: {r:?}");
    let mut regions = check_ram_is_the_daemons(&lv, &daemon, &d, page);
    let mut allocs = alloc_ids(&daemon.stats());
    let mut pid = lv.qemu_pid(&d.name);
    step("booted on daemon memory");

    // 1. virsh save / virsh restore.
    let image = guests.join("hm-life.save");
    let image_arg = image.to_str().expect("utf-8");
    let save_s = timed(|| {
        ok(lv.virsh(&["save", &d.name, image_arg]));
    });
    assert_eq!(lv.domstate(&d.name), "shut off", "after virsh save");
    let image_bytes = std::fs::metadata(&image).expect("save image").len();
    let saved = wait_released(&daemon, &regions, "virsh save releases the allocation");
    step(&format!(
        "saved ({save_s:.2} s, image {image_bytes} bytes); allocation released"
    ));
    let restore_s = timed(|| {
        ok(lv.virsh(&["restore", image_arg]));
    });
    assert_eq!(lv.domstate(&d.name), "running", "after virsh restore");
    let restored_pid = lv.qemu_pid(&d.name);
    assert_ne!(restored_pid, pid, "a restore starts a new QEMU");
    let log = lv.domain_log(&d.name);
    assert!(log.contains("memory backend on hugemem memory"), "{log}");
    // The guest's values are in the new allocation (check_ram_is_the_daemons).
    regions = check_ram_is_the_daemons(&lv, &daemon, &d, page);
    let restored_allocs = alloc_ids(&daemon.stats());
    assert!(
        restored_allocs.iter().all(|a| !allocs.contains(a)),
        "the restore must run on a fresh allocation: {allocs:?} before, {restored_allocs:?} after"
    );
    let restored = daemon.stats();
    assert_balanced(&restored, "after virsh restore");
    (allocs, pid) = (restored_allocs, restored_pid);
    let restore_alloc_ms = wrapper_alloc_ms(&log);
    step(&format!(
        "restored ({restore_s:.2} s; the wrapper's allocation {restore_alloc_ms} ms, regions {}) \
         on daemon memory, the guest's values in it",
        served_from(&saved, &restored)
    ));

    // 2. virsh managedsave / virsh start.
    let managed_s = timed(|| {
        ok(lv.virsh(&["managedsave", &d.name]));
    });
    assert_eq!(lv.domstate(&d.name), "shut off", "after virsh managedsave");
    let info = ok(lv.virsh(&["dominfo", &d.name]));
    assert!(
        info.lines()
            .any(|l| l.starts_with("Managed save:") && l.ends_with("yes")),
        "{info}"
    );
    let saved = wait_released(
        &daemon,
        &regions,
        "virsh managedsave releases the allocation",
    );
    step(&format!(
        "managedsaved ({managed_s:.2} s); allocation released"
    ));
    let start_s = timed(|| {
        ok(lv.virsh(&["start", &d.name]));
    });
    assert_eq!(lv.domstate(&d.name), "running", "after virsh start");
    let info = ok(lv.virsh(&["dominfo", &d.name]));
    assert!(
        info.lines()
            .any(|l| l.starts_with("Managed save:") && l.ends_with("no")),
        "virsh start must have used (and removed) the managed save: {info}"
    );
    assert_ne!(
        lv.qemu_pid(&d.name),
        pid,
        "the start restores into a new QEMU"
    );
    regions = check_ram_is_the_daemons(&lv, &daemon, &d, page);
    let started_allocs = alloc_ids(&daemon.stats());
    assert!(
        started_allocs.iter().all(|a| !allocs.contains(a)),
        "the managed restore must run on a fresh allocation: {allocs:?} before, {started_allocs:?} after"
    );
    let started = daemon.stats();
    assert_balanced(&started, "after virsh start from the managed save");
    let start_alloc_ms = wrapper_alloc_ms(&lv.domain_log(&d.name));
    step(&format!(
        "started from the managed save ({start_s:.2} s; the wrapper's allocation {start_alloc_ms} ms, regions {})",
        served_from(&saved, &started)
    ));

    // The guest itself sees its pre-save writes: reset, and its next boot's
    // report says it found nonzero memory.
    let seen = reports(&d).len();
    ok(lv.virsh(&["reset", &d.name]));
    let r = wait_reports(&lv, &d, seen + 1);
    assert!(
        r[seen].contains("nonzero=1"),
        "after the restores the guest must find what it wrote before the saves: {r:?}"
    );
    step("reset: the guest found its pre-save writes");

    // 3. destroy: nothing left, totals balance.
    ok(lv.virsh(&["destroy", &d.name]));
    wait_released(&daemon, &regions, "virsh destroy releases the allocation");
    let before = daemon.stats();
    step("destroyed; nothing allocated");

    // The next allocation reads no stale byte of the saved and restored domain.
    let next = domain(&guests, "hm-next", &shim, unit, 0x3C3C_0000_0000_0000, "");
    ok(lv.virsh(&["define", next.xml.to_str().expect("utf-8")]));
    ok(lv.virsh(&["start", &next.name]));
    let r = wait_reports(&lv, &next, 1);
    assert!(
        r[0].contains("nonzero=0"),
        "the next domain read memory the restored one wrote: {r:?}"
    );
    let after = daemon.stats();
    assert!(
        after.counters.regions_pooled >= before.counters.regions_pooled + 2,
        "the next domain was not served from the pool: {after}"
    );
    let next_regions = check_ram_is_the_daemons(&lv, &daemon, &next, page);
    ok(lv.virsh(&["destroy", &next.name]));
    wait_released(&daemon, &next_regions, "destroy of the next domain");
    step("next domain read zeros; destroyed");

    for name in [&d.name, &next.name] {
        ok(lv.virsh(&["undefine", name]));
    }
    eprintln!(
        "MEASURED libvirt on hugemem memory: RAM {ram} ({page}-byte pages, TCG): \
         virsh save {save_s:.2} s (image {image_bytes} bytes), virsh restore {restore_s:.2} s \
         (of which the wrapper's allocation {restore_alloc_ms} ms), virsh managedsave {managed_s:.2} s, \
         virsh start (managed restore) {start_s:.2} s (allocation {start_alloc_ms} ms)"
    );
    drop(lv);
    daemon.shutdown();
}

/// `virsh migrate --live` between two libvirtds on this machine (issue 26):
/// each in its own mount and UTS namespaces over its own state directories,
/// with its own host UUID, and both with the shipped emulator wrapper on the
/// same daemon. The migration stream goes over a UNIX socket
/// (`--migrateuri unix://…`), never an address. The destination QEMU runs on
/// its own allocation, which the stream fills: the guest's values are at
/// their guest-physical offsets of its memfds, and after a `virsh reset` the
/// guest finds what it wrote on the source. The source's allocation is
/// released once the source QEMU exits, the totals balance at each step, and
/// after the final destroy nothing is allocated. The migration's wall time is
/// printed, not asserted.
#[test]
fn libvirt_live_migration_between_two_libvirtds_on_daemon_memory() {
    let _serial = test_support::prelude::serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    // The source's and the destination's 2 GiB, both held during the migration.
    let Some((unit, page, _pages)) = pages_for_gib(4) else {
        return;
    };
    // Bound left to right, dropped right to left: the directory goes last.
    let Stage {
        tmp,
        daemon,
        guests,
        shim,
        ..
    } = Stage::new();
    let dir = tmp.path();
    let src = Libvirt::setup_as(
        &dir.join("libvirt-src"),
        Some(Host {
            uuid: "6d1c3e0a-6f2b-4c59-9d8e-5a0000000001",
            hostname: "hugemem-src",
        }),
    );
    let dst = Libvirt::setup_as(
        &dir.join("libvirt-dst"),
        Some(Host {
            uuid: "6d1c3e0a-6f2b-4c59-9d8e-5a0000000002",
            hostname: "hugemem-dst",
        }),
    );
    let t0 = Instant::now();
    let step = |what: &str| eprintln!("[{:7.1} s] {what}", t0.elapsed().as_secs_f64());
    let ram = guest_mem::size::format_size(2 << 30);
    step(&format!(
        "two libvirtds up; {ram} of RAM on {page}-byte pages"
    ));

    let d = domain(&guests, "hm-mig", &shim, unit, 0x7E7E_0000_0000_0000, "");
    ok(src.virsh(&["define", d.xml.to_str().expect("utf-8")]));
    ok(src.virsh(&["start", &d.name]));
    let r = wait_reports(&src, &d, 1);
    assert!(r[0].contains("nonzero=0"), "fresh daemon memory: {r:?}");
    let src_regions = check_ram_is_the_daemons(&src, &daemon, &d, page);
    let src_allocs = alloc_ids(&daemon.stats());
    let src_pid = src.qemu_pid(&d.name);
    assert_balanced(&daemon.stats(), "source running");
    step("source booted on daemon memory");

    // The destination's domain: the source's migratable XML with its serial
    // in a file of its own (the source QEMU still has its file open).
    let moved = Domain {
        name: d.name.clone(),
        xml: guests.join("hm-mig-dst.xml"),
        serial: guests.join("hm-mig-dst.serial"),
        marker: d.marker,
    };
    let xml = ok(src.virsh(&["dumpxml", "--migratable", &d.name]));
    let src_serial = d.serial.to_str().expect("utf-8");
    assert!(xml.contains(src_serial), "{xml}");
    let xml = xml.replace(src_serial, moved.serial.to_str().expect("utf-8"));
    std::fs::write(&moved.xml, xml).expect("write destination xml");

    // The destination libvirtd has not seen the wrapper yet: its first use
    // of an emulator probes its capabilities (seconds here, then cached in
    // /var/cache/libvirt), which would count in the migration's time.
    let shim_arg = shim.to_str().expect("utf-8");
    let probe_s = timed(|| {
        ok(dst.virsh(&[
            "domcapabilities",
            "--emulatorbin",
            shim_arg,
            "--virttype",
            "qemu",
        ]));
    });
    step(&format!(
        "destination libvirtd probed the wrapper ({probe_s:.2} s)"
    ));
    let before_migration = daemon.stats();
    let stream = guests.join("migrate.sock");
    let (migrate_s, watched) = migrate_watched(&src, &dst, &d.name, &moved.xml, &stream);
    assert_eq!(
        dst.domstate(&d.name),
        "running",
        "destination after the migration"
    );
    assert_eq!(
        src.domstate(&d.name),
        "shut off",
        "source after the migration"
    );
    assert!(
        watched.unix_socket_seen,
        "the destination never listened at {} ({} looks)",
        stream.display(),
        watched.looks
    );
    assert!(
        watched.tcp_sockets.is_empty(),
        "a QEMU held TCP sockets during the migration: {:?}",
        watched.tcp_sockets
    );
    let [job_ms, downtime_ms, memory_sent] = completed_job(
        &dst,
        &d.name,
        ["Time elapsed", "Total downtime", "Memory processed"],
    );
    step(&format!("migrated ({migrate_s:.2} s)"));

    // The source QEMU exits and its allocation is released; only the
    // destination's is held.
    test_support::prelude::wait_until("source QEMU exited", Duration::from_secs(30), || {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(src_pid), None).is_err()
    });
    let released = daemon.wait_stats(
        Duration::from_secs(30),
        "the source's allocation released",
        |s| {
            let given_back = s.given_back.clone().unwrap_or_default();
            s.allocations.active == 2
                && src_regions.iter().all(|id| match s.region(*id) {
                    Some(r) => r.state == "clean",
                    None => given_back.iter().any(|g| g.region == *id),
                })
        },
    );
    assert_balanced(&released, "after the migration");
    let dst_alloc_ms = wrapper_alloc_ms(&dst.domain_log(&d.name));
    let dst_served = served_from(&before_migration, &released);
    step("source QEMU exited; its allocation released");

    // The destination runs on daemon memory, with the guest's values in it.
    let dst_regions = check_ram_is_the_daemons(&dst, &daemon, &moved, page);
    let dst_allocs = alloc_ids(&daemon.stats());
    assert!(
        dst_allocs.iter().all(|a| !src_allocs.contains(a)),
        "the destination runs on its own allocation: {src_allocs:?} source, {dst_allocs:?} destination"
    );
    assert!(
        dst.domain_log(&d.name)
            .contains("memory backend on hugemem memory"),
        "{}",
        dst.domain_log(&d.name)
    );
    ok(dst.virsh(&["reset", &d.name]));
    let r = wait_reports(&dst, &moved, 1);
    assert!(
        r[0].contains("nonzero=1"),
        "after the migration the guest must find what it wrote on the source: {r:?}"
    );
    step("destination on daemon memory; the guest found its writes");

    ok(dst.virsh(&["destroy", &d.name]));
    wait_released(&daemon, &dst_regions, "destroy on the destination");
    step("destroyed; nothing allocated");
    ok(src.virsh(&["undefine", &d.name]));
    eprintln!(
        "MEASURED libvirt live migration on hugemem memory: RAM {ram} ({page}-byte pages, TCG), \
         over a UNIX socket between two libvirtds: virsh migrate --live {migrate_s:.2} s; \
         the destination's domjobinfo: migration {job_ms}, downtime {downtime_ms}, \
         memory sent {memory_sent} (zero pages go as flags); the destination wrapper's \
         allocation {dst_alloc_ms} ms (regions {dst_served}); before it, the destination libvirtd's \
         capabilities probe of the wrapper {probe_s:.2} s"
    );
    drop(dst);
    drop(src);
    daemon.shutdown();
}

/// `virsh migrate --live` of `name` from `src` to `dst` (its domain XML there
/// `dst_xml`), the stream over the UNIX socket `stream`; returns its wall
/// time and what a watcher saw meanwhile: the destination QEMU's listening
/// socket at `stream`, and any TCP socket of either QEMU.
fn migrate_watched(
    src: &Libvirt,
    dst: &Libvirt,
    name: &str,
    dst_xml: &Path,
    stream: &Path,
) -> (f64, StreamWatch) {
    let migrate_uri = format!("unix://{}", stream.display());
    let dst_uri = dst.uri();
    let src_pid = src.qemu_pid(name);
    let dst_pidfile = dst.base.join(format!("run/libvirt/qemu/{name}.pid"));
    let migrating = AtomicBool::new(true);
    std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let mut watched = StreamWatch::default();
            while migrating.load(Ordering::Relaxed) {
                watched.look(stream, &[Some(src_pid), read_pid(&dst_pidfile)]);
                std::thread::sleep(Duration::from_millis(5));
            }
            watched
        });
        let migrate_s = timed(|| {
            ok(src.virsh(&[
                "migrate",
                "--live",
                name,
                &dst_uri,
                "--migrateuri",
                &migrate_uri,
                "--xml",
                dst_xml.to_str().expect("utf-8"),
            ]));
        });
        migrating.store(false, Ordering::Relaxed);
        (migrate_s, watcher.join().expect("watcher"))
    })
}

/// Fields of `virsh domjobinfo --completed` (`?` where libvirt gave none).
fn completed_job<const N: usize>(lv: &Libvirt, name: &str, fields: [&str; N]) -> [String; N] {
    let info = ok(lv.virsh(&["domjobinfo", "--completed", name]));
    fields.map(|field| {
        info.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .map_or_else(
                || "?".into(),
                |v| v.split_whitespace().collect::<Vec<_>>().join(" "),
            )
    })
}

/// What a watcher saw while a migration ran.
#[derive(Default)]
struct StreamWatch {
    looks: u32,
    /// The UNIX socket the stream was told to use existed as a socket.
    unix_socket_seen: bool,
    /// `pid: socket inode` of each TCP socket a QEMU held.
    tcp_sockets: Vec<String>,
}

impl StreamWatch {
    fn look(&mut self, stream: &Path, pids: &[Option<i32>]) {
        self.looks += 1;
        self.unix_socket_seen |= std::fs::symlink_metadata(stream)
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
        let tcp = tcp_socket_inodes();
        for pid in pids.iter().flatten() {
            for inode in socket_inodes(*pid) {
                let seen = format!("{pid}: {inode}");
                if tcp.contains(&inode) && !self.tcp_sockets.contains(&seen) {
                    self.tcp_sockets.push(seen);
                }
            }
        }
    }
}

/// The inodes of this network namespace's TCP sockets (IPv4 and IPv6).
fn tcp_socket_inodes() -> Vec<u64> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            if let Some(inode) = line.split_whitespace().nth(9).and_then(|i| i.parse().ok()) {
                inodes.push(inode);
            }
        }
    }
    inodes
}

/// The inodes of the sockets among a process's open files.
fn socket_inodes(pid: i32) -> Vec<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// A pid from a pid file, once it is there.
fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}
