//! Loads the configuration and runs every check in order.

use std::path::{Path, PathBuf};

use backend::daemon::Config;

use super::accounts::Account;
use super::inputs::{CheckInputs, DEFAULT_CONFIG};
use super::report::{Item, Report};
use super::{cloud_hypervisor, daemon, host, libvirt};

/// The daemon's configuration as `hugemem serve --config` loads it: the
/// file named, else [`DEFAULT_CONFIG`] when it exists, else the defaults.
/// An unreadable or invalid file is a FAIL (the daemon would refuse it
/// too), and the checks go on against the defaults.
pub fn load_config(named: Option<&Path>) -> (Config, Option<PathBuf>, Item) {
    let path = match named {
        Some(p) => p.to_path_buf(),
        None if Path::new(DEFAULT_CONFIG).exists() => PathBuf::from(DEFAULT_CONFIG),
        None => {
            return (
                Config::default(),
                None,
                Item::warn(
                    "config",
                    format!(
                        "{DEFAULT_CONFIG} does not exist: checked against the built-in defaults"
                    ),
                    "install the package (it ships that file), or give --config FILE",
                ),
            )
        }
    };
    match Config::from_toml_file(&path) {
        Ok(c) => (
            c,
            Some(path.clone()),
            Item::pass("config", format!("{} loads as the daemon loads it", path.display())),
        ),
        Err(e) => (
            Config::default(),
            None,
            Item::fail(
                "config",
                format!("{}: {:#}; the daemon would refuse it too (the rest is checked against the defaults)", path.display(), anyhow::Error::from(e)),
                "fix the file (scripts/hugemem.toml documents every key)",
            ),
        ),
    }
}

/// The non-root uids that use the socket: `allowed_uids`, and libvirt's
/// QEMU user where libvirt is installed.
fn tenants(inputs: &CheckInputs, qemu: Option<&libvirt::QemuConf>) -> Vec<Account> {
    let mut out: Vec<Account> = inputs
        .config
        .allowed_uids
        .iter()
        .filter(|&&u| u != 0)
        .map(|&u| Account::of_uid(u))
        .collect();
    if let Some(a) = qemu.and_then(|c| Account::of_name(c.user())) {
        if a.uid != 0 && !out.iter().any(|t| t.uid == a.uid) {
            out.push(a);
        }
    }
    out
}

/// Every check, in order: configuration, huge pages, hugetlbfs,
/// userfaultfd, KVM, the socket, libvirt, cloud-hypervisor.
pub fn run(inputs: &CheckInputs, config_item: Item) -> Report {
    let mut report = Report {
        config: inputs.config_path.as_ref().map(|p| p.display().to_string()),
        items: vec![config_item],
    };
    if !inputs.is_root() {
        report.push(Item::skip(
            "privileges",
            format!(
                "running as uid {}: the checks as each tenant uid need root",
                inputs.euid
            ),
            "sudo hugemem check",
        ));
    }
    let qemu = libvirt::read_qemu_conf(inputs);
    let tenants = tenants(inputs, qemu.as_ref().ok());
    let (items, seen) = host::hugepages(inputs);
    report.extend(items);
    report.extend(host::mounts(inputs, &seen));
    report.push(host::userfaultfd(inputs, &tenants));
    report.push(host::kvm(inputs, &tenants));
    report.push(daemon::socket_access(inputs, &tenants));
    report.extend(daemon::answers(inputs, &tenants));
    match qemu {
        Ok(conf) => {
            report.extend(libvirt::user_and_group(inputs, &conf));
            report.push(libvirt::emulator(inputs));
            report.push(libvirt::cpu_svm(inputs));
            report.push(libvirt::confinement(inputs, &conf));
        }
        Err(skip) => report.push(skip),
    }
    report.extend(cloud_hypervisor::items(
        inputs.cloud_hypervisor.as_ref(),
        &inputs.sys,
    ));
    report
}
