//! libvirt's side: the user and group `qemu.conf` runs QEMU as against the
//! daemon's `allowed_uids` and `socket_group`, the emulator script, the AMD
//! `svm` CPU-model hint, and AppArmor/SELinux confinement of the emulator.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::accounts::{gid_of, group_label, Account};
use super::inputs::{CheckInputs, DEBIAN_QEMU_GROUP, DEBIAN_QEMU_USER};
use super::report::Item;

/// The keys of `qemu.conf` the checks read (uncommented assignments).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QemuConf {
    /// `user`, as written (a name, `+N` or `N`).
    pub user: Option<String>,
    /// `group`, as written.
    pub group: Option<String>,
    /// `security_driver` (one value or a list).
    pub security_driver: Vec<String>,
}

impl QemuConf {
    /// Parses libvirt's `key = "value"` / `key = [ "a", "b" ]` lines;
    /// comments and other keys are ignored.
    pub fn parse(text: &str) -> Self {
        let mut conf = Self::default();
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            let values: Vec<String> = value
                .split('"')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect();
            match key.trim() {
                "user" => conf.user = values.into_iter().next(),
                "group" => conf.group = values.into_iter().next(),
                "security_driver" => conf.security_driver = values,
                _ => {}
            }
        }
        conf
    }

    /// The user QEMU runs as (Debian's default where unset).
    pub fn user(&self) -> &str {
        self.user.as_deref().unwrap_or(DEBIAN_QEMU_USER)
    }

    /// The group QEMU runs as (Debian's default where unset).
    pub fn group(&self) -> &str {
        self.group.as_deref().unwrap_or(DEBIAN_QEMU_GROUP)
    }
}

/// `qemu.conf` when libvirt is installed and it can be read; else the SKIP
/// that says why not.
pub fn read_qemu_conf(inputs: &CheckInputs) -> Result<QemuConf, Item> {
    match std::fs::read_to_string(&inputs.qemu_conf) {
        Ok(text) => Ok(QemuConf::parse(&text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Item::skip(
            "libvirt",
            format!("libvirt is not installed ({} absent): its items were not checked", inputs.qemu_conf.display()),
            "nothing to do unless VMs run under libvirt (then: apt-get install libvirt-daemon-system)",
        )),
        Err(e) => Err(Item::skip(
            "libvirt",
            format!("cannot read {}: {e}", inputs.qemu_conf.display()),
            "run hugemem check as root",
        )),
    }
}

/// The `qemu.conf` user is allowed on the socket, and its group is
/// `socket_group` (or the user is a member).
pub fn user_and_group(inputs: &CheckInputs, conf: &QemuConf) -> Vec<Item> {
    let cfg = &inputs.config;
    let mut items = Vec::new();
    let source = |key: &str, set: bool| {
        if set {
            format!("{} {key}", inputs.qemu_conf.display())
        } else {
            format!(
                "Debian's default; {key} unset in {}",
                inputs.qemu_conf.display()
            )
        }
    };
    let Some(user) = Account::of_name(conf.user()) else {
        items.push(Item::fail(
            "libvirt-user",
            format!(
                "QEMU's user {:?} ({}) does not exist",
                conf.user(),
                source("user", conf.user.is_some())
            ),
            "install libvirt-daemon-system (it creates libvirt-qemu) or fix user in qemu.conf",
        ));
        return items;
    };
    items.push(if user.uid == 0 || cfg.allowed_uids.contains(&user.uid) {
        Item::pass("libvirt-user", format!("libvirt runs QEMU as {} ({}), which allowed_uids lists", user.label(), source("user", conf.user.is_some())))
    } else {
        Item::fail(
            "libvirt-user",
            format!("libvirt runs QEMU as {} ({}), which allowed_uids lacks ({:?}): the wrapper is refused", user.label(), source("user", conf.user.is_some()), cfg.allowed_uids),
            format!("add {} to allowed_uids in the configuration and restart the daemon", user.uid),
        )
    });
    let group = gid_of(conf.group());
    let src = source("group", conf.group.is_some());
    items.push(match (group, cfg.socket_group) {
        (None, _) => Item::fail(
            "libvirt-group",
            format!("QEMU's group {:?} ({src}) does not exist", conf.group()),
            "fix group in qemu.conf",
        ),
        _ if user.uid == 0 => Item::pass(
            "libvirt-group",
            "QEMU runs as root: the socket's group does not matter",
        ),
        (Some(gid), Some(sg)) if gid == sg || user.in_group(sg) => Item::pass(
            "libvirt-group",
            format!(
                "libvirt runs QEMU with group {} ({src}); socket_group {} lets it reach the socket",
                group_label(gid),
                group_label(sg)
            ),
        ),
        (Some(gid), Some(sg)) => Item::fail(
            "libvirt-group",
            format!(
                "libvirt runs QEMU with group {} ({src}), and {} is not in socket_group {}",
                group_label(gid),
                user.label(),
                group_label(sg)
            ),
            format!(
                "set socket_group = {gid} in the configuration, or add {} to that group",
                user.label()
            ),
        ),
        (Some(gid), None) => Item::fail(
            "libvirt-group",
            format!(
                "socket_group is unset: the socket is root 0600, closed to QEMU's group {} ({src})",
                group_label(gid)
            ),
            format!("set socket_group = {gid} in the configuration and restart the daemon"),
        ),
    });
    items
}

/// The settings of a `hugemem-qemu` script: `NAME=${ENV:-default}` lines.
fn script_default(text: &str, var: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with(&format!("{var}=")))?;
    let value = line.split_once('=')?.1;
    let value = match value.split_once(":-") {
        Some((_, rest)) => rest.trim_end_matches('}'),
        None => value,
    };
    Some(value.trim_matches('"').to_string())
}

/// The emulator script exists, is executable, and runs an existing hugemem
/// and QEMU on the configured socket.
pub fn emulator(inputs: &CheckInputs) -> Item {
    let path = &inputs.emulator;
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            return Item::fail(
                "libvirt-emulator",
                format!("{}: {e}", path.display()),
                "install the hugemem package (it ships /usr/bin/hugemem-qemu), or give check --emulator PATH",
            )
        }
    };
    let executable = std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o111 != 0);
    let (Some(hugemem), Some(qemu), Some(socket)) = (
        script_default(&text, "HUGEMEM"),
        script_default(&text, "QEMU"),
        script_default(&text, "SOCKET"),
    ) else {
        return Item::fail(
            "libvirt-emulator",
            format!(
                "{} is no hugemem-qemu script (no HUGEMEM=, QEMU= and SOCKET= lines)",
                path.display()
            ),
            "reinstall the hugemem package",
        );
    };
    let mut wrong = Vec::new();
    if !executable {
        wrong.push(format!("{} is not executable", path.display()));
    }
    for (what, p) in [("hugemem", &hugemem), ("QEMU", &qemu)] {
        if !Path::new(p).is_file() {
            wrong.push(format!("its {what} {p} does not exist"));
        }
    }
    if Path::new(&socket) != inputs.config.socket {
        wrong.push(format!(
            "its socket {socket} is not the configured {}",
            inputs.config.socket.display()
        ));
    }
    if wrong.is_empty() {
        Item::pass(
            "libvirt-emulator",
            format!("{} runs {hugemem} qemu-wrapper with {qemu} on {socket}: name it in a domain's <emulator>", path.display()),
        )
    } else {
        Item::fail(
            "libvirt-emulator",
            wrong.join("; "),
            format!("edit HUGEMEM=, QEMU= and SOCKET= in {} (or the socket in the configuration) to match", path.display()),
        )
    }
}

/// Whether KVM offers `svm` (AMD's nested virtualisation) to guests: a
/// custom CPU model that lists it (libvirt's `qemu64`, the EPYC and Opteron
/// models) fails under libvirt with "Host CPU does not provide required
/// features: svm" where it does not — on an AMD host without nested SVM
/// (seen on an AMD EPYC development host) and on every Intel host (KVM offers `vmx` there; seen on the
/// development host's Intel Xeon with `qemu64` under libvirt 9.0).
pub fn cpu_svm(inputs: &CheckInputs) -> Item {
    let cpuinfo = std::fs::read_to_string(inputs.proc.join("cpuinfo")).unwrap_or_default();
    let field = |key: &str| {
        cpuinfo
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let Some(vendor) = field("vendor_id") else {
        return Item::skip(
            "cpu-svm",
            "no vendor_id in /proc/cpuinfo",
            "run on an x86 host",
        );
    };
    let has_svm = field("flags").is_some_and(|f| f.split_whitespace().any(|x| x == "svm"));
    let nested_path = inputs.sys.join("module/kvm_amd/parameters/nested");
    let nested = std::fs::read_to_string(&nested_path)
        .ok()
        .map(|s| s.trim().to_string());
    let amd = vendor == "AuthenticAMD";
    if amd && has_svm && matches!(nested.as_deref(), Some("1" | "Y")) {
        return Item::pass(
            "cpu-svm",
            "AMD host; KVM offers svm to guests (kvm_amd nested = 1): CPU models that list svm run",
        );
    }
    let why = if amd {
        format!(
            "AMD host whose KVM offers guests no svm (svm flag {}, kvm_amd nested {})",
            if has_svm { "present" } else { "absent" },
            nested.as_deref().unwrap_or("absent")
        )
    } else {
        format!("{vendor} host: KVM offers guests vmx, never svm")
    };
    Item::warn(
        "cpu-svm",
        format!("{why}: a KVM domain whose custom CPU model lists svm (qemu64, EPYC, Opteron) fails with \"Host CPU does not provide required features: svm\""),
        "add <feature policy='disable' name='svm'/> to such a domain's <cpu>, or use <cpu mode='host-model'/> (docs/operations.md, \"libvirt\")",
    )
}

/// Whether AppArmor or SELinux confines libvirt's QEMU, and so the wrapper.
pub fn confinement(inputs: &CheckInputs, conf: &QemuConf) -> Item {
    let read = |p: PathBuf| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    };
    let apparmor =
        read(inputs.sys.join("module/apparmor/parameters/enabled")).as_deref() == Some("Y");
    let selinux = read(inputs.sys.join("fs/selinux/enforce"));
    let driver = if conf.security_driver.is_empty() {
        "unset (libvirt uses the first active one)".to_string()
    } else {
        conf.security_driver.join(", ")
    };
    if conf.security_driver.iter().any(|d| d == "none") {
        return Item::pass(
            "confinement",
            "qemu.conf security_driver = \"none\": the emulator runs unconfined",
        );
    }
    if !apparmor && selinux.is_none() {
        return Item::pass("confinement", format!("neither AppArmor nor SELinux is active (security_driver {driver}): the emulator runs unconfined"));
    }
    if apparmor {
        let local = Path::new("/etc/apparmor.d/local/abstractions/libvirt-qemu");
        let has_rules = std::fs::read_to_string(local).is_ok_and(|t| t.contains("hugemem"));
        return if has_rules {
            Item::pass(
                "confinement",
                format!(
                    "AppArmor confines QEMU; {} has hugemem rules",
                    local.display()
                ),
            )
        } else {
            Item::warn(
                "confinement",
                format!("AppArmor confines libvirt's QEMU (security_driver {driver}) and {} has no hugemem rules: the wrapper may be denied running hugemem or connecting to the socket", local.display()),
                format!(
                    "add to {}: \"/usr/bin/hugemem rix,\" and \"{} rw,\", then restart libvirtd",
                    local.display(),
                    inputs.config.socket.display()
                ),
            )
        };
    }
    Item::warn(
        "confinement",
        format!("SELinux is active (enforce = {}): sVirt confines QEMU, which must run hugemem and connect to the socket", selinux.unwrap_or_default()),
        "label /usr/bin/hugemem-qemu and /usr/bin/hugemem qemu_exec_t (chcon or a file context) and allow svirt_t to connect to the socket (a local policy module)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_conf_keys_are_read_and_comments_skipped() {
        let c = QemuConf::parse(
            "#user = \"nobody\"\nuser = \"+0\"\n group = \"kvm\" \nsecurity_driver = [ \"selinux\", \"apparmor\" ]\n",
        );
        assert_eq!(c.user.as_deref(), Some("+0"));
        assert_eq!(c.group(), "kvm");
        assert_eq!(c.security_driver, ["selinux", "apparmor"]);
        let d = QemuConf::parse("#user = \"root\"\n");
        assert_eq!((d.user(), d.group()), ("libvirt-qemu", "libvirt-qemu"));
    }

    #[test]
    fn script_defaults_are_read() {
        let text = "HUGEMEM=${HUGEMEM:-/usr/bin/hugemem}\nQEMU=/usr/bin/qemu-system-x86_64\n";
        assert_eq!(
            script_default(text, "HUGEMEM").as_deref(),
            Some("/usr/bin/hugemem")
        );
        assert_eq!(
            script_default(text, "QEMU").as_deref(),
            Some("/usr/bin/qemu-system-x86_64")
        );
        assert_eq!(script_default(text, "SOCKET"), None);
    }
}
