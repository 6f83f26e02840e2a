//! Which copy of the shipped files a test runs: the build tree's (the
//! binary cargo built, `scripts/`), or, with `HUGEMEM_INSTALLED=1` (as
//! `.ci/run` sets after `apt-get install ./hugemem_*.deb`), the Debian
//! package's installed files. A test that asks for the installed files and
//! finds one missing fails: CI installed the package to test exactly these.

use std::path::{Path, PathBuf};

/// The environment variable that selects the installed files.
pub const INSTALLED_ENV: &str = "HUGEMEM_INSTALLED";

/// Where the package installs each file.
pub mod paths {
    /// The binary.
    pub const HUGEMEM: &str = "/usr/bin/hugemem";
    /// The libvirt emulator script.
    pub const EMULATOR: &str = "/usr/bin/hugemem-qemu";
    /// The service unit.
    pub const SERVICE: &str = "/lib/systemd/system/hugemem.service";
    /// The socket unit.
    pub const SOCKET_UNIT: &str = "/lib/systemd/system/hugemem.socket";
    /// The configuration (a conffile).
    pub const CONFIG: &str = "/etc/hugemem/hugemem.toml";
    /// The Grafana dashboard.
    pub const DASHBOARD: &str = "/usr/share/hugemem/grafana/hugemem.json";
    /// The socket the installed configuration and emulator script name.
    pub const SOCKET: &str = "/run/hugemem/hugemem.sock";
}

/// The files a test runs, and whether they are the installed ones.
#[derive(Debug, Clone)]
pub struct Shipped {
    /// True with `HUGEMEM_INSTALLED=1`.
    pub installed: bool,
    /// The `hugemem` binary.
    pub hugemem: PathBuf,
    /// `hugemem-qemu`.
    pub emulator: PathBuf,
    /// `hugemem.service`.
    pub service: PathBuf,
    /// `hugemem.socket`.
    pub socket_unit: PathBuf,
    /// The reference configuration.
    pub config: PathBuf,
    /// The Grafana dashboard JSON.
    pub dashboard: PathBuf,
}

/// The files to test: `built` is the test's `CARGO_BIN_EXE_hugemem`, `repo`
/// the workspace root (for `scripts/`).
///
/// # Panics
///
/// With `HUGEMEM_INSTALLED=1`, when an installed file is missing.
pub fn shipped(built: &str, repo: &Path) -> Shipped {
    if std::env::var(INSTALLED_ENV).is_ok_and(|v| v == "1") {
        let s = Shipped {
            installed: true,
            hugemem: paths::HUGEMEM.into(),
            emulator: paths::EMULATOR.into(),
            service: paths::SERVICE.into(),
            socket_unit: paths::SOCKET_UNIT.into(),
            config: paths::CONFIG.into(),
            dashboard: paths::DASHBOARD.into(),
        };
        for p in [
            &s.hugemem,
            &s.emulator,
            &s.service,
            &s.socket_unit,
            &s.config,
            &s.dashboard,
        ] {
            assert!(
                p.exists(),
                "{INSTALLED_ENV}=1 but {} is missing: install the package (apt-get install ./target/debian/hugemem_*.deb)",
                p.display()
            );
        }
        eprintln!("NOTE: testing the installed package's files ({INSTALLED_ENV}=1)");
        return s;
    }
    let scripts = repo.join("scripts");
    Shipped {
        installed: false,
        hugemem: built.into(),
        emulator: scripts.join("hugemem-qemu"),
        service: scripts.join("hugemem.service"),
        socket_unit: scripts.join("hugemem.socket"),
        config: scripts.join("hugemem.toml"),
        dashboard: scripts.join("grafana-dashboard.json"),
    }
}

/// Readies the installed socket's directory (`/run/hugemem`, the unit's
/// RuntimeDirectory=) for a test daemon with `socket_group = gid`: where it
/// exists already (an earlier run), `root:<gid>` 0710 as the daemon makes a
/// directory it creates for that group; where it does not, the daemon
/// creates it so.
///
/// # Panics
///
/// When a daemon already serves the installed socket (stop it first), or
/// the directory cannot be changed.
pub fn runtime_dir_for(gid: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let socket = PathBuf::from(paths::SOCKET);
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_err(),
        "a daemon already serves {}: stop it (systemctl stop hugemem) for this test",
        socket.display()
    );
    let dir = socket.parent().expect("a directory");
    if dir.exists() {
        std::os::unix::fs::chown(dir, Some(0), Some(gid)).expect("chown the runtime directory");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o710))
            .expect("chmod the runtime directory");
    }
    socket
}
