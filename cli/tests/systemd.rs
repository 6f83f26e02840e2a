//! The systemd protocols of `hugemem serve`, spoken to the real binary by
//! this test the way systemd speaks them (systemd itself cannot run here:
//! docs/operations.md, "Testing the unit", says why):
//!
//! * readiness: a real `AF_UNIX` datagram socket named by `NOTIFY_SOCKET`
//!   receives `READY=1` once the daemon serves (a client gets STATS at
//!   once, with no retry) and `STOPPING=1` on SIGTERM;
//! * socket activation: a listening socket bound by the test is passed as
//!   fd 3 with `LISTEN_FDS=1` and `LISTEN_PID` = the daemon's pid (set by
//!   `sh -c 'LISTEN_PID=$$ exec …'`, so the pid is the exec'd daemon's). A
//!   client that connected before the daemon started is served; the daemon
//!   leaves the socket file alone (same inode and mode after a stop), the
//!   uid check still refuses a stranger, and a second daemon on the same
//!   descriptor serves a client that connected while none ran;
//! * `hugemem hugepages --config` (the unit's privileged `ExecStartPre=`)
//!   reserves what the config's `[hugepages]` section says.
//!
//! Each test starts a daemon or changes the 2 MiB pool: run them under the
//! machine lock.

use test_support::prelude::serial;

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backend::client::Client;
use backend::stats::Stats;
use serde_json::Value;

/// The test's end of `NOTIFY_SOCKET`.
struct Notify {
    sock: UnixDatagram,
    path: PathBuf,
}

impl Notify {
    fn new(dir: &Path) -> Self {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).expect("bind the notify socket");
        Self { sock, path }
    }

    /// The next datagram, as text; fails the test after `timeout`.
    fn recv(&self, timeout: Duration) -> String {
        self.sock.set_read_timeout(Some(timeout)).expect("timeout");
        let mut buf = vec![0u8; 4096];
        let n = self
            .sock
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no sd_notify message within {timeout:?}: {e}"));
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }
}

/// `hugemem serve --socket SOCKET` with `NOTIFY_SOCKET`; with `fd3`, as
/// systemd starts a socket-activated service: `fd3` is duplicated onto fd 3
/// and `LISTEN_FDS=1`, `LISTEN_PID=<the daemon's pid>` are set.
fn spawn_serve(socket: &Path, notify: &Notify, fd3: Option<RawFd>) -> Child {
    let bin = env!("CARGO_BIN_EXE_hugemem");
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(if fd3.is_some() {
            "LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" \"$@\""
        } else {
            "exec \"$0\" \"$@\""
        })
        .arg(bin)
        .args(["serve", "--socket"])
        .arg(socket)
        .env("NOTIFY_SOCKET", &notify.path)
        .env_remove("LISTEN_PID")
        .env_remove("LISTEN_FDS")
        .stdin(Stdio::null());
    if let Some(fd) = fd3 {
        // SAFETY: the closure runs in the forked child before exec and only
        // calls `onto_fd3` (dup2/fcntl, async-signal-safe, no allocation).
        unsafe {
            cmd.pre_exec(move || onto_fd3(fd));
        }
    }
    cmd.spawn().expect("spawn hugemem serve")
}

/// Makes `fd` (the test's open listening socket) the child's fd 3,
/// inherited across exec. Runs between fork and exec.
fn onto_fd3(fd: RawFd) -> std::io::Result<()> {
    let r = if fd == 3 {
        // dup2(3, 3) would keep FD_CLOEXEC: clear it instead.
        // SAFETY: fcntl(F_SETFD) on an open descriptor of this process.
        unsafe { libc::fcntl(3, libc::F_SETFD, 0) }
    } else {
        // SAFETY: dup2 of an open descriptor onto 3; whatever 3 was in the
        // child (nothing the child uses: it execs right after) is replaced.
        unsafe { libc::dup2(fd, 3) }
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn sigterm(child: &Child) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
}

/// Waits for `child` to exit (at most `timeout`), returning its status.
fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("hugemem serve did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A client on its own thread that connects now and asks STATS; its
/// connection waits in the listening socket's backlog until a daemon serves.
fn early_client(socket: &Path) -> std::thread::JoinHandle<Stats> {
    let stream = std::os::unix::net::UnixStream::connect(socket).expect("connect before serve");
    std::thread::spawn(move || {
        let mut c = Client::from_stream(stream).expect("handshake once a daemon serves");
        c.set_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        c.stats().expect("stats")
    })
}

#[test]
fn serve_notifies_ready_when_serving_and_stopping_on_sigterm() {
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("run").join("hugemem.sock");
    let notify = Notify::new(dir.path());
    let mut child = spawn_serve(&socket, &notify, None);
    let msg = notify.recv(Duration::from_secs(60));
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    assert!(
        msg.lines()
            .any(|l| l == format!("STATUS=serving {}", socket.display())),
        "{msg:?}"
    );
    // Ready means serving: no retry, no wait.
    let stats = Client::connect(&socket)
        .expect("connect right after READY=1")
        .stats()
        .expect("stats");
    assert_eq!(stats.pid, child.id());
    sigterm(&child);
    let msg = notify.recv(Duration::from_secs(30));
    assert!(msg.lines().any(|l| l == "STOPPING=1"), "{msg:?}");
    assert!(
        msg.lines().any(|l| l == "STATUS=stopping on SIGTERM"),
        "{msg:?}"
    );
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(status.success(), "hugemem serve exited with {status}");
    assert!(!socket.exists(), "a socket the daemon bound is removed");
}

#[test]
fn serve_takes_the_socket_systemd_passes_and_leaves_it_in_place() {
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    // Others may traverse the directory and connect: the uid check, not
    // the file mode, must be what refuses a stranger below.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let socket = dir.path().join("hugemem.sock");
    let listener = UnixListener::bind(&socket).expect("bind, as hugemem.socket does");
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let before = std::fs::metadata(&socket).expect("meta");
    let notify = Notify::new(dir.path());

    // A VMM that connects before the daemon runs is served once it does.
    let early = early_client(&socket);
    let mut child = spawn_serve(&socket, &notify, Some(listener.as_raw_fd()));
    let msg = notify.recv(Duration::from_secs(60));
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    assert!(
        msg.lines()
            .any(|l| l == format!("STATUS=serving {} (socket-activated)", socket.display())),
        "{msg:?}"
    );
    let stats = early.join().expect("early client");
    assert_eq!(stats.pid, child.id());
    let after = std::fs::metadata(&socket).expect("meta");
    assert_eq!(
        (after.ino(), after.mode()),
        (before.ino(), before.mode()),
        "the daemon neither re-created nor chmod-ed the passed socket"
    );

    // The peer check applies unchanged: uid 65534 reaches the socket (mode
    // 0666) but is not allowed.
    let out = Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["status", "--socket"])
        .arg(&socket)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("hugemem status as uid 65534");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a stranger got STATS: {err}");
    assert!(err.contains("uid 65534 is not allowed"), "{err}");

    sigterm(&child);
    let msg = notify.recv(Duration::from_secs(30));
    assert!(msg.lines().any(|l| l == "STOPPING=1"), "{msg:?}");
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(status.success(), "hugemem serve exited with {status}");
    let left = std::fs::metadata(&socket).expect("the socket file stays with systemd");
    assert_eq!(left.ino(), before.ino());

    // Between two daemons (a restart) a VMM still connects; the next daemon
    // on the same descriptor serves it.
    let early = early_client(&socket);
    let mut child = spawn_serve(&socket, &notify, Some(listener.as_raw_fd()));
    let msg = notify.recv(Duration::from_secs(60));
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    let stats = early.join().expect("client of the restart");
    assert_eq!(stats.pid, child.id());
    sigterm(&child);
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(status.success(), "hugemem serve exited with {status}");
    assert!(socket.exists());
}

#[test]
fn serve_refuses_a_passed_socket_bound_elsewhere() {
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let other = dir.path().join("other.sock");
    let listener = UnixListener::bind(&other).expect("bind");
    let notify = Notify::new(dir.path());
    let socket = dir.path().join("hugemem.sock");
    let mut child = spawn_serve(&socket, &notify, Some(listener.as_raw_fd()));
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(
        !status.success(),
        "a daemon served a socket bound elsewhere"
    );
    assert!(!socket.exists(), "nor did it bind its own");
    notify.sock.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 512];
    assert!(
        notify.sock.recv(&mut buf).is_err(),
        "no READY=1 from a daemon that did not start"
    );
}

const POOL_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

fn nr_2m() -> u64 {
    std::fs::read_to_string(Path::new(POOL_2M).join("nr_hugepages"))
        .expect("read the 2 MiB pool")
        .trim()
        .parse()
        .expect("a number")
}

/// `hugemem hugepages --config FILE --json` with FILE holding `section`.
fn hugepages_with_config(dir: &Path, section: &str) -> (Option<i32>, Value, String) {
    let config = dir.join("hugemem.toml");
    std::fs::write(
        &config,
        format!("[pool]\ntarget = \"0\"\n\n[hugepages]\n{section}"),
    )
    .expect("config");
    let out = Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["hugepages", "--json", "--config"])
        .arg(&config)
        .output()
        .expect("hugemem hugepages");
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (
        out.status.code(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn hugepages_reserves_what_the_config_section_says() {
    let _s = serial();
    if !Path::new(POOL_2M).is_dir() {
        test_support::skip!("no 2 MiB huge-page pool on this kernel");
        return;
    }
    if std::fs::metadata("/proc/self").map(|m| m.uid()).ok() != Some(0) {
        test_support::skip!("reserving huge pages needs root");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let before = nr_2m();
    let (code, report, err) = hugepages_with_config(
        dir.path(),
        &format!(
            "pages_2m = {}\nmode = \"total\"\nmount = false\n",
            before + 2
        ),
    );
    let pool = &report["pools"][0];
    if code == Some(3) {
        hugepages_with_config(
            dir.path(),
            &format!("pages_2m = {before}\nmode = \"exact\"\nmount = false\n"),
        );
        test_support::skip!("the kernel gave fewer 2 MiB pages than asked: {pool}");
        return;
    }
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(pool["size"], "2M");
    assert_eq!(pool["mode"], "total");
    assert_eq!(pool["requested"], before + 2);
    assert_eq!(pool["total"], before + 2);
    assert_eq!(nr_2m(), before + 2);
    assert_eq!(report["mounts"], Value::Array(vec![]), "mount = false");
    let (code, report, err) = hugepages_with_config(
        dir.path(),
        &format!("pages_2m = {before}\nmode = \"exact\"\nmount = false\n"),
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(report["pools"][0]["mode"], "exact");
    assert_eq!(nr_2m(), before);
    // A section the daemon would refuse is refused here too (usage, 2).
    let (code, _, err) = hugepages_with_config(dir.path(), "pages_3m = 1\n");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("pages_3m"), "{err}");
}

/// The shipped units under a real systemd (252 on the development host),
/// booted as PID 1 of a private PID + mount namespace (`unshare`), with
/// `/run` a fresh tmpfs there so nothing of the host's `/run` is touched.
/// From the build tree, a drop-in points the units of `scripts/` at the
/// built binary and a test config; with `HUGEMEM_INSTALLED=1` (CI, after
/// `apt-get install ./hugemem_*.deb`) the installed units and binary run
/// with every command line as installed, the test config bind-mounted over
/// `/etc/hugemem/hugemem.toml` in the namespace. Either way the drop-in
/// turns off the default dependencies (sysinit.target would start udev,
/// journald and the host's mounts); everything else — `Type=notify`, the
/// sandbox, `ExecStartPre=-+… hugepages --config`, `RuntimeDirectory=`, the
/// socket unit — is the shipped file. An extra sandboxed
/// `ExecStartPre=` (no `+`) rewrites a sysfs file with its own value and
/// reports whether /sys was writable.
///
/// Skipped where PID 1 is systemd (a second manager on the same cgroup tree
/// would fight the host's; use `systemd-run` there) or where systemd,
/// `unshare` or root are missing. The cgroups the nested manager creates
/// (`init.scope`, `system.slice`) are removed again when empty.
#[test]
fn shipped_units_start_notify_and_stop_under_a_real_systemd() {
    let _s = serial();
    const SYSTEMD: &str = "/lib/systemd/systemd";
    if std::fs::metadata("/proc/self").map(|m| m.uid()).ok() != Some(0) {
        test_support::skip!("booting a systemd in a namespace needs root");
        return;
    }
    if Path::new("/run/systemd/system").exists() {
        test_support::skip!("the host runs systemd: a nested manager would share its cgroup tree");
        return;
    }
    for p in [SYSTEMD, "/usr/bin/unshare", "/usr/bin/nsenter"] {
        if !Path::new(p).exists() {
            test_support::skip!("{p} is missing");
            return;
        }
    }
    // Two regions of 16 MiB for the restart and crash steps.
    if !test_support::hugepages::reserve_2m(
        16,
        "shipped_units_start_notify_and_stop_under_a_real_systemd",
    ) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let shipped = test_support::installed::shipped(env!("CARGO_BIN_EXE_hugemem"), &repo);
    let nr = nr_2m();
    std::fs::write(
        d.join("hugemem.toml"),
        format!("[pool]\ntarget = \"0\"\n\n[hugepages]\npages_2m = {nr}\nmount = false\n"),
    )
    .expect("config");
    let probe = "f=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_overcommit_hugepages; \
                 v=$(cat $f); (echo $v > $f) 2>/dev/null && echo sysfs-writable || echo sysfs-readonly";
    let (units, bin) = if shipped.installed {
        (
            installed_units(d, probe),
            shipped.hugemem.display().to_string(),
        )
    } else {
        (
            build_tree_units(d, &shipped, probe),
            "/run/hugemem-test/hugemem".to_string(),
        )
    };
    let bin = bin.as_str();
    let inner = format!(
        r#"set -e
mount -t proc proc /proc
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p /run/hugemem-test /run/systemd/system/hugemem.service.d /run/systemd/system/hugemem.socket.d
{units}
printf '[Unit]\nDefaultDependencies=no\n' > /run/systemd/system/hugemem.socket.d/test.conf
printf '[Unit]\nDefaultDependencies=no\nWants=hugemem.socket\n' > /run/systemd/system/hugemem-test.target
export container=hugemem-test
exec {SYSTEMD} --system --unit=hugemem-test.target --log-target=console
"#
    );
    std::fs::write(d.join("inner.sh"), inner).expect("script");
    let cgroups_before: Vec<PathBuf> = cgroup_dirs();
    let mut ns = Command::new("/usr/bin/unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--propagation",
            "private",
            "/bin/sh",
        ])
        .arg(d.join("inner.sh"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("unshare");
    // The child handle is only waited on after a panic: nothing of it is
    // left half-updated.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        drive_units(&mut ns, bin, d, shipped.installed)
    }));
    // Stop the manager (and with it the namespace) whatever happened.
    if let Some(pid) = child_of(ns.id()) {
        let _ = Command::new("/usr/bin/nsenter")
            .args(["-t", &pid.to_string(), "-m", "-p", "systemctl", "exit"])
            .output();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = ns.wait();
    for c in cgroup_dirs() {
        if !cgroups_before.contains(&c) {
            remove_empty_cgroup(&c);
        }
    }
    match result {
        Ok(Ok(())) => {}
        Ok(Err(why)) => test_support::skip!("no systemd could run here: {why}"),
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// `RuntimeDirectoryMode=0711` lets every uid traverse `/run/hugemem` (not
/// list it), so that `socket_group` reaches the socket: then nothing in it
/// may be more open than its owner and that group. With a daemon running,
/// its entries are the daemon's socket (systemd's, `SocketMode=0600`) and
/// its takeover control socket (`hugemem.sock.takeover`, bound under
/// `UMask=0077` and chmod'ed 0600), both sockets, 0600 or 0660; each also
/// checks its peer's uid (`SO_PEERCRED`). Beside them the note of parked
/// VMs (`hugemem.sock.parked`, a 0600 file) may be there.
fn runtime_directory_holds_only_closed_sockets(ns: &dyn Fn(&[&str]) -> String) {
    assert_eq!(ns(&["stat", "-c", "%a", "/run/hugemem"]).trim(), "711");
    let entries = ns(&[
        "find",
        "/run/hugemem",
        "-mindepth",
        "1",
        "-printf",
        "%P %m %y\n",
    ]);
    let names: Vec<&str> = entries
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            // Sockets, and the daemon's note of parked VMs (a 0600 file).
            assert!(
                matches!(fields.as_slice(), [_, "600" | "660", "s"])
                    || matches!(fields.as_slice(), [name, "600", "f"] if name.ends_with(".parked")),
                "an entry of /run/hugemem more open than a 0600/0660 socket: {line}"
            );
            fields[0]
        })
        .collect();
    assert!(
        names.contains(&"hugemem.sock") && names.contains(&"hugemem.sock.takeover"),
        "{entries}"
    );
}

/// The build tree's units (`scripts/`) and binary, copied into the
/// namespace's `/run` (the unit runs with PrivateTmp= and ProtectHome=: a
/// binary built under /tmp or /home, a fresh clone anywhere, is invisible to
/// it; /run is not), with a drop-in pointing every command at them and at
/// the test's configuration, and a sandboxed probe of /sys.
fn build_tree_units(d: &Path, shipped: &test_support::installed::Shipped, probe: &str) -> String {
    format!(
        r#"cp {d}/hugemem.toml /run/hugemem-test/
cp {bin} /run/hugemem-test/hugemem
cp {service} {socket} /run/systemd/system/
cat > /run/systemd/system/hugemem.service.d/test.conf <<'X'
[Unit]
DefaultDependencies=no
[Service]
ExecStartPre=
ExecStartPre=-+/run/hugemem-test/hugemem hugepages --config /run/hugemem-test/hugemem.toml
ExecStartPre=/bin/sh -c '{probe}'
ExecStart=
ExecStart=/run/hugemem-test/hugemem serve --fd-store --config /run/hugemem-test/hugemem.toml
ExecReload=
ExecReload=/run/hugemem-test/hugemem serve --takeover --detach --fd-store --config /run/hugemem-test/hugemem.toml
StandardOutput=append:{d}/service.log
StandardError=append:{d}/service.log
X"#,
        d = d.display(),
        bin = shipped.hugemem.display(),
        service = shipped.service.display(),
        socket = shipped.socket_unit.display(),
    )
}

/// The installed package's maintainer scripts under this systemd: the
/// prerm of a removal stops the service and the socket unit, the postinst
/// of a first install starts the service, the postinst of an upgrade
/// reloads the running daemon (a takeover: a new main process, no restart),
/// and the prerm of an upgrade leaves it running.
fn maintainer_scripts(
    ns: &dyn Fn(&[&str]) -> String,
    show: &dyn Fn(&str, &str) -> std::collections::HashMap<String, String>,
    log: &Path,
) {
    let script = |name: &str, args: &str| {
        let out = ns(&[
            "sh",
            "-c",
            &format!("/var/lib/dpkg/info/hugemem.{name} {args}; echo rc=$?"),
        ]);
        assert!(
            out.trim_end().ends_with("rc=0"),
            "hugemem.{name} {args}: {out}"
        );
    };
    script("prerm", "remove");
    for unit in ["hugemem.service", "hugemem.socket"] {
        let u = show(unit, "ActiveState,Result");
        assert_eq!(
            (u["ActiveState"].as_str(), u["Result"].as_str()),
            ("inactive", "success"),
            "{unit} after prerm remove: {u:?}\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    script("postinst", "configure");
    let before = show("hugemem.service", "MainPID,ActiveState,NRestarts");
    assert_eq!(
        before["ActiveState"], "active",
        "a first install's postinst starts the service"
    );
    script("postinst", "configure 0.1.0-1");
    let s = show("hugemem.service", "MainPID,ActiveState,SubState,NRestarts");
    assert_eq!(
        (s["ActiveState"].as_str(), s["SubState"].as_str()),
        ("active", "running"),
        "{s:?}"
    );
    assert_ne!(
        s["MainPID"], before["MainPID"],
        "the upgrade's postinst reloads (a takeover): {s:?}"
    );
    assert_eq!(
        s["NRestarts"], before["NRestarts"],
        "a reload, not a restart: {s:?}"
    );
    script("prerm", "upgrade 0.1.0-1");
    let t = show("hugemem.service", "MainPID,ActiveState");
    assert_eq!(
        (t["ActiveState"].as_str(), t["MainPID"].as_str()),
        ("active", s["MainPID"].as_str()),
        "an upgrade's prerm stops nothing"
    );
    // The main process is now one systemd did not fork (the takeover's,
    // announced with MAINPID=). Stopping such a process under this nested
    // systemd (container mode on cgroup v1, where systemd does not wait for
    // the cgroup to empty) can SIGKILL it mid-shutdown: seen in 2 of 6
    // `systemctl reload` + `systemctl stop` runs here, ending failed with
    // Result=signal. The caller's final stop must see a clean one, so the
    // unit gets a main process of its own first.
    ns(&["systemctl", "restart", "hugemem.service"]);
    println!("OBSERVED: the package's prerm stopped both units on removal, a first install's postinst started the service, an upgrade's postinst reloaded (took over) it and an upgrade's prerm left it running");
}

/// The installed package's units and binary as they are: only the test's
/// configuration is bind-mounted over `/etc/hugemem/hugemem.toml` (in the
/// namespace's private mount table), and the drop-in adds the sandboxed
/// probe of /sys and the log file; every command line is the unit's own.
fn installed_units(d: &Path, probe: &str) -> String {
    format!(
        r#"mount --bind {d}/hugemem.toml {config}
# Debian container images deny every maintainer-script start with a
# policy-rc.d (exit 101); this namespace's systemd may be driven by them.
if [ -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 0\n' > {d}/policy-rc.d; chmod 755 {d}/policy-rc.d; mount --bind {d}/policy-rc.d /usr/sbin/policy-rc.d; fi
cat > /run/systemd/system/hugemem.service.d/test.conf <<'X'
[Unit]
DefaultDependencies=no
[Service]
ExecStartPre=/bin/sh -c '{probe}'
StandardOutput=append:{d}/service.log
StandardError=append:{d}/service.log
X"#,
        d = d.display(),
        config = test_support::installed::paths::CONFIG,
    )
}

/// A tenant (this process, on the namespace's socket through
/// `/proc/<manager>/root`) holds a written allocation and the pool a clean
/// region; `systemctl restart hugemem` and then `systemctl kill -s KILL
/// hugemem` (restarted by `Restart=on-failure`) keep both: the tenant
/// re-attaches with its token and reads its bytes, and after the restart the
/// pool is served warm with nothing zeroed again.
fn keeps_across_restart_and_kill(
    ns: &dyn Fn(&[&str]) -> String,
    show: &dyn Fn(&str, &str) -> std::collections::HashMap<String, String>,
    served_by: &dyn Fn() -> u64,
    manager: i32,
) {
    use test_support::tenant::{alloc_2m, MIB};
    let size = 16 * MIB;
    let socket = PathBuf::from(format!("/proc/{manager}/root/run/hugemem/hugemem.sock"));
    let mut tenant = Client::connect(&socket).expect("the tenant connects");
    let a = tenant.alloc(alloc_2m(size, false)).expect("tenant ALLOC");
    let token = a.token().expect("a re-attach token");
    let map =
        test_support::prelude::Map::shared(std::os::fd::AsFd::as_fd(&a.fds[0]), size as usize);
    map.fill(0, map.len(), 0x5A);
    let mut other = Client::connect(&socket).expect("connect");
    let b = other.alloc(alloc_2m(size, false)).expect("a second ALLOC");
    let bid = b.id;
    drop(b);
    other.free(bid).expect("FREE");
    test_support::process::wait_clean_and_present(&mut other, size);
    drop(other);

    // systemctl reload: a takeover in place. The tenant's connection goes on
    // (no reconnect), the unit's main process is the new daemon, nothing
    // restarted.
    let main_before = show("hugemem.service", "MainPID")["MainPID"].clone();
    let reload_started = Instant::now();
    ns(&["systemctl", "reload", "hugemem.service"]);
    let reload_ms = reload_started.elapsed().as_secs_f64() * 1e3;
    let s = show("hugemem.service", "MainPID,ActiveState,SubState,NRestarts");
    assert_ne!(s["MainPID"], main_before, "a new main process");
    assert_eq!(
        (s["ActiveState"].as_str(), s["SubState"].as_str()),
        ("active", "running"),
        "{s:?}"
    );
    assert_eq!(s["NRestarts"], "0");
    let after_reload = tenant.stats().expect("the same connection, served on");
    assert_eq!(after_reload.pid.to_string(), s["MainPID"], "{after_reload}");
    assert_eq!(after_reload.allocations.active, 1, "{after_reload}");
    assert!(
        map.all(0, map.len(), 0x5A),
        "the tenant's bytes survived the reload"
    );
    println!("OBSERVED: systemctl reload (takeover) took {reload_ms:.0} ms; the tenant's connection went on");

    // The periodic sync has stored the regions and a document.
    std::thread::sleep(Duration::from_millis(800));
    let before = tenant.stats().expect("stats");

    ns(&["systemctl", "restart", "hugemem.service"]);
    let restarted = served_by();
    let tenant = Client::reconnect(
        &socket,
        &[(a.id, token)],
        Instant::now() + Duration::from_secs(30),
    )
    .expect("re-attach after systemctl restart");
    assert!(
        map.all(0, map.len(), 0x5A),
        "the tenant's bytes survived the restart"
    );
    let mut next = Client::connect(&socket).expect("connect");
    let c = next
        .alloc(alloc_2m(size, false))
        .expect("ALLOC after the restart");
    let s = next.stats().expect("stats");
    assert_eq!(u64::from(s.pid), restarted);
    assert_eq!(s.allocations.active, 2, "the tenant's and the new one: {s}");
    assert_eq!(
        s.counters.regions_pooled,
        before.counters.regions_pooled + 1,
        "served warm from the kept pool: {s}"
    );
    assert_eq!(s.scrub.bytes, 0, "nothing zeroed again: {s}");
    assert_eq!(
        s.counters.bytes_created, before.counters.bytes_created,
        "{s}"
    );
    let cid = c.id;
    drop(c);
    next.free(cid).expect("FREE");
    drop(next);
    std::thread::sleep(Duration::from_millis(800));

    // A crash: systemd restarts the service (Restart=on-failure) with the
    // stored fds.
    ns(&["systemctl", "kill", "-s", "KILL", "hugemem.service"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while show("hugemem.service", "NRestarts")["NRestarts"] != "1" {
        assert!(
            Instant::now() < deadline,
            "no automatic restart after kill -9"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let crashed = served_by();
    assert_ne!(crashed, restarted);
    let mut tenant2 = Client::reconnect(
        &socket,
        &[(a.id, token)],
        Instant::now() + Duration::from_secs(30),
    )
    .expect("re-attach after kill -9");
    assert!(
        map.all(0, map.len(), 0x5A),
        "the tenant's bytes survived the crash"
    );
    let s = tenant2.stats().expect("stats");
    assert_eq!(s.allocations.active, 1, "{s}");
    drop(map);
    let id = a.id;
    drop(a);
    tenant2.free(id).expect("FREE after the crash");
    drop(tenant);
    println!(
        "OBSERVED: under systemd: restart and kill -9 kept the allocation (re-attached twice) and the pool (served warm after the restart, regions_pooled {} -> {})",
        before.counters.regions_pooled, before.counters.regions_pooled + 1
    );
}

/// `init.scope` and `system.slice` under every mounted cgroup hierarchy.
fn cgroup_dirs() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(hier) = std::fs::read_dir("/sys/fs/cgroup") else {
        return out;
    };
    for h in hier.flatten() {
        for name in ["init.scope", "system.slice"] {
            let p = h.path().join(name);
            if p.is_dir() {
                out.push(p);
            }
        }
    }
    out
}

/// Removes `dir` and its sub-cgroups, deepest first, where they are empty.
fn remove_empty_cgroup(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_empty_cgroup(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// The first child process of `pid` (the namespace's PID 1 under unshare).
fn child_of(pid: u32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The steps of [`shipped_units_start_notify_and_stop_under_a_real_systemd`];
/// `Err` (the test skips) when no systemd comes up: `unshare` cannot make
/// the namespaces, or the manager exits before its socket unit listens.
fn drive_units(unshare: &mut Child, bin: &str, d: &Path, installed: bool) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = loop {
        if let Some(p) = child_of(unshare.id()) {
            break p;
        }
        if let Ok(Some(status)) = unshare.try_wait() {
            return Err(format!("unshare --pid --fork --mount exited with {status}"));
        }
        assert!(Instant::now() < deadline, "no systemd under unshare");
        std::thread::sleep(Duration::from_millis(20));
    };
    let ns = |args: &[&str]| -> String {
        let out = Command::new("/usr/bin/nsenter")
            .args(["-t", &pid.to_string(), "-m", "-p"])
            .args(args)
            .output()
            .expect("nsenter");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let show = |unit: &str, props: &str| -> std::collections::HashMap<String, String> {
        ns(&["systemctl", "show", unit, "-p", props])
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let sock = "/run/hugemem/hugemem.sock";
    let served_by = || -> u64 {
        let out = ns(&["timeout", "30", bin, "status", "--json", "--socket", sock]);
        let v: Stats = serde_json::from_str(&out).unwrap_or_else(|e| panic!("STATS ({e}): {out}"));
        u64::from(v.pid)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while ns(&["systemctl", "is-active", "hugemem.socket"]).trim() != "active" {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            return Err(format!(
                "{} exited before hugemem.socket listened",
                "/lib/systemd/systemd"
            ));
        }
        assert!(Instant::now() < deadline, "hugemem.socket never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        ns(&["systemctl", "is-active", "hugemem.service"]).trim(),
        "inactive"
    );
    let inode = ns(&["stat", "-c", "%i %a", sock]);
    assert!(inode.trim().ends_with(" 600"), "SocketMode=0600: {inode}");

    // The first connection starts the service; READY=1 makes it active.
    let first = served_by();
    let s = show(
        "hugemem.service",
        "Type,ActiveState,SubState,StatusText,MainPID,NRestarts",
    );
    assert_eq!(s["Type"], "notify");
    assert_eq!(
        (s["ActiveState"].as_str(), s["SubState"].as_str()),
        ("active", "running")
    );
    assert_eq!(
        s["StatusText"],
        format!("serving {sock} (socket-activated)")
    );
    assert_eq!(s["MainPID"], first.to_string());
    assert_eq!(s["NRestarts"], "0");

    // Stop: STOPPING=1, clean exit, the socket stays with systemd.
    ns(&["systemctl", "stop", "hugemem.service"]);
    let s = show(
        "hugemem.service",
        "ActiveState,Result,ExecMainStatus,StatusText",
    );
    assert_eq!(s["ActiveState"], "inactive");
    assert_eq!(s["Result"], "success");
    assert_eq!(s["ExecMainStatus"], "0");
    assert_eq!(s["StatusText"], "stopping on SIGTERM");
    assert_eq!(
        ns(&["stat", "-c", "%i %a", sock]),
        inode,
        "socket file untouched"
    );
    assert_eq!(
        ns(&["systemctl", "is-active", "hugemem.socket"]).trim(),
        "active"
    );

    // A client while no daemon runs activates a new one; restart works.
    let second = served_by();
    assert_ne!(second, first);
    ns(&["systemctl", "restart", "hugemem.service"]);
    let third = served_by();
    assert_ne!(third, second);
    runtime_directory_holds_only_closed_sockets(&ns);

    // Restart and kill -9 keep the pool and a running tenant's allocation
    // (issue 20): the fd store (FileDescriptorStoreMax=, --fd-store).
    keeps_across_restart_and_kill(&ns, &show, &served_by, pid);
    if installed {
        maintainer_scripts(&ns, &show, &d.join("service.log"));
    }
    ns(&["systemctl", "stop", "hugemem.service", "hugemem.socket"]);
    assert_eq!(show("hugemem.service", "Result")["Result"], "success");

    let log = std::fs::read_to_string(d.join("service.log")).expect("service log");
    // ExecStartPre=+ read the config's [hugepages] section (a floor equal
    // to the pool: nothing to do) ...
    assert!(log.contains("met (unchanged)"), "{log}");
    // ... and the sandbox (ProtectKernelTunables=yes) made /sys read-only
    // for the rest of the unit: the reason that line needs "+". One line
    // per start: activation, re-activation, restart, restart with a tenant,
    // the automatic restart after kill -9 (and, installed, the first-install
    // postinst's start and the restart after the upgrade's reload).
    let starts = 5 + 2 * usize::from(installed);
    assert_eq!(log.matches("sysfs-readonly").count(), starts, "{log}");
    assert!(!log.contains("sysfs-writable"), "{log}");
    Ok(())
}
