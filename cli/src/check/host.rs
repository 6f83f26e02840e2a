//! The host's side: huge pages reserved per node (and room for more),
//! hugetlbfs mounts per page size, userfaultfd for the tenants, KVM.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use numa::hugepages::size_label;
use numa::{HugePages, ReserveMode, HUGE_PAGE_1G, HUGE_PAGE_2M};

use super::accounts::{group_name, Account};
use super::inputs::CheckInputs;
use super::report::Item;
use super::sys::kvm_api_version;

/// What the reservation check saw of one page size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSeen {
    /// Page size in bytes.
    pub page_size: u64,
    /// Pages reserved host-wide.
    pub total: u64,
}

const GIB: u64 = 1 << 30;

/// One item per page size the kernel has (`hugepages-1G`, `hugepages-2M`),
/// and one `hugepages` FAIL when no pool has a page; returns what it saw.
pub fn hugepages(inputs: &CheckInputs) -> (Vec<Item>, Vec<PoolSeen>) {
    let pages = HugePages::with_roots(&inputs.sys, &inputs.proc);
    let section = &inputs.config.hugepages;
    let mut items = Vec::new();
    let mut seen = Vec::new();
    for (size, wanted, key) in [
        (HUGE_PAGE_1G, section.pages_1g, "pages_1g"),
        (HUGE_PAGE_2M, section.pages_2m, "pages_2m"),
    ] {
        let name = format!("hugepages-{}", size_label(size));
        let host_dir = inputs
            .sys
            .join(format!("kernel/mm/hugepages/hugepages-{}kB", size / 1024));
        if !host_dir.is_dir() {
            items.push(Item::skip(
                name,
                format!(
                    "{} has no such pool (the kernel or CPU lacks this page size)",
                    host_dir.display()
                ),
                "nothing to do unless you need this size",
            ));
            continue;
        }
        let pool = match pages.pool(size, section.node) {
            Ok(p) => p,
            Err(e) => {
                items.push(Item::fail(
                    name,
                    format!("cannot read the pool: {e}"),
                    "check /sys is mounted",
                ));
                continue;
            }
        };
        let per_node = pages.node_pools(size).unwrap_or_default();
        let nodes = per_node
            .iter()
            .map(|n| format!("node {}: {} total/{} free", n.node, n.total, n.free))
            .collect::<Vec<_>>()
            .join(", ");
        let room = more_room(inputs, size);
        let mode: ReserveMode = section.mode.into();
        let got = if mode == ReserveMode::Free {
            pool.available()
        } else {
            pool.total
        };
        let where_ = section
            .node
            .map_or("host-wide".to_string(), |n| format!("on node {n}"));
        let counts = format!(
            "{} reserved {where_}, {} free, {} available ({nodes}); more: {room}",
            pool.total,
            pool.free,
            pool.available()
        );
        seen.push(PoolSeen {
            page_size: size,
            total: pool.total,
        });
        let label = size_label(size);
        items.push(match wanted {
            Some(w) if got < w => Item::fail(
                name,
                format!("{got} of the {w} x {label} pages [hugepages] {key} asks for ({}): {counts}", mode.as_str()),
                format!("hugemem hugepages --config {} (or reserve at boot: hugepagesz={label} hugepages={w})", config_name(inputs)),
            ),
            _ if pool.total == 0 => Item::warn(
                name,
                format!("no {label} pages reserved: ALLOCs asking for {label} fall back (page size best) or fail (strict); {counts}"),
                format!("set [hugepages] {key} and run hugemem hugepages --config {}", config_name(inputs)),
            ),
            _ => Item::pass(name, counts),
        });
    }
    if !seen.is_empty() && seen.iter().all(|p| p.total == 0) {
        items.push(Item::fail(
            "hugepages",
            "no huge pages reserved at all: every ALLOC gets 4 KiB pages (or fails with a strict page size)",
            format!(
                "reserve some: hugemem hugepages --1g N --2m M, or [hugepages] pages_1g/pages_2m in {} (the unit's ExecStartPre= applies it)",
                config_name(inputs)
            ),
        ));
    }
    (items, seen)
}

/// The configuration file's name for a fix line.
fn config_name(inputs: &CheckInputs) -> String {
    inputs
        .config_path
        .as_ref()
        .map_or("/etc/hugemem/hugemem.toml".into(), |p| {
            p.display().to_string()
        })
}

/// Whether more pages of `size` could be reserved now, as far as the
/// kernel says without trying: 2 MiB pages from the buddy allocator's free
/// blocks of 2 MiB and up (`/proc/buddyinfo`); 1 GiB pages need an aligned
/// free 1 GiB block, which no file shows, so only free memory bounds them.
fn more_room(inputs: &CheckInputs, size: u64) -> String {
    let free = mem_free(&inputs.proc.join("meminfo"));
    if size == HUGE_PAGE_2M {
        match blocks_2m(&inputs.proc.join("buddyinfo")) {
            Some(n) => format!("about {n} x 2M now (free blocks of 2M and up)"),
            None => "unknown (no /proc/buddyinfo)".into(),
        }
    } else {
        match free {
            Some(f) => format!(
                "at most {} x 1G by free memory ({:.1} GiB free), if contiguous aligned blocks remain: only trying tells (hugemem hugepages --1g N)",
                f / GIB,
                f as f64 / GIB as f64
            ),
            None => "unknown (no /proc/meminfo)".into(),
        }
    }
}

/// `MemFree` of a meminfo file, in bytes.
fn mem_free(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with("MemFree:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Free 2 MiB blocks the buddy allocator has (order 9 and up, 4 KiB base
/// pages), summed over nodes and zones.
fn blocks_2m(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut blocks = 0u64;
    for line in text.lines() {
        // "Node 0, zone   Normal  20402 11221 … " : counts per order from 0.
        let Some((_, after)) = line.split_once("zone") else {
            continue;
        };
        let counts = after.split_whitespace().skip(1);
        for (order, count) in counts.enumerate() {
            let count: u64 = count.parse().ok()?;
            if order >= 9 {
                blocks += count << (order - 9);
            }
        }
    }
    Some(blocks)
}

/// A hugetlbfs mount: where, and its page size.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    path: PathBuf,
    page_size: u64,
}

/// hugetlbfs mounts from the procfs root's `mounts`; a mount without
/// `pagesize=` has the default size (`Hugepagesize` in meminfo).
fn hugetlbfs_mounts(inputs: &CheckInputs) -> Option<Vec<Mount>> {
    let text = std::fs::read_to_string(inputs.proc.join("mounts")).ok()?;
    let default = std::fs::read_to_string(inputs.proc.join("meminfo"))
        .ok()
        .and_then(|m| {
            let l = m
                .lines()
                .find(|l| l.starts_with("Hugepagesize:"))?
                .to_string();
            l.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(HUGE_PAGE_2M, |kb| kb * 1024);
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || f[2] != "hugetlbfs" {
            continue;
        }
        let page_size = f[3]
            .split(',')
            .find_map(|o| o.strip_prefix("pagesize="))
            .and_then(parse_mount_size)
            .unwrap_or(default);
        out.push(Mount {
            path: PathBuf::from(f[1].replace("\\040", " ")),
            page_size,
        });
    }
    Some(out)
}

/// `2M`, `1024M`, `1G` as bytes.
fn parse_mount_size(s: &str) -> Option<u64> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = num.parse().ok()?;
    match unit {
        "K" | "k" => Some(n << 10),
        "M" | "m" => Some(n << 20),
        "G" | "g" => Some(n << 30),
        _ => None,
    }
}

/// One item per page size that has pages or a configured directory: a
/// hugetlbfs of that size is mounted (and holds the configured directory).
pub fn mounts(inputs: &CheckInputs, seen: &[PoolSeen]) -> Vec<Item> {
    let Some(mounts) = hugetlbfs_mounts(inputs) else {
        return vec![Item::skip(
            "hugetlbfs",
            format!("cannot read {}", inputs.proc.join("mounts").display()),
            "run on the host (procfs mounted)",
        )];
    };
    let section = &inputs.config.hugepages;
    let dirs = &inputs.config.hugetlbfs;
    let mut items = Vec::new();
    for (size, dir) in [(HUGE_PAGE_1G, &dirs.dir_1g), (HUGE_PAGE_2M, &dirs.dir_2m)] {
        let label = size_label(size);
        let name = format!("hugetlbfs-{label}");
        let has_pages = seen.iter().any(|p| p.page_size == size && p.total > 0);
        let of_size: Vec<&Mount> = mounts.iter().filter(|m| m.page_size == size).collect();
        let listed = of_size
            .iter()
            .map(|m| m.path.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        if let Some(dir) = dir {
            let on = of_size.iter().find(|m| dir.starts_with(&m.path));
            items.push(match on {
                Some(m) => Item::pass(
                    name,
                    format!(
                        "[hugetlbfs] dir_{} {} is on the {label} mount {}",
                        label.to_lowercase(),
                        dir.display(),
                        m.path.display()
                    ),
                ),
                None => Item::fail(
                    name,
                    format!(
                        "[hugetlbfs] dir_{} {} is on no {label} hugetlbfs (mounted: {})",
                        label.to_lowercase(),
                        dir.display(),
                        if listed.is_empty() { "none" } else { &listed }
                    ),
                    format!(
                        "mount -t hugetlbfs -o pagesize={label} none {}, or fix the path",
                        dir.display()
                    ),
                ),
            });
            continue;
        }
        if !has_pages {
            continue;
        }
        let expected = section.mount_root.join(format!("hugepages-{label}"));
        items.push(if !of_size.is_empty() {
            Item::pass(name, format!("mounted at {listed}"))
        } else if section.mount {
            Item::fail(
                name,
                format!("no hugetlbfs mounted for {label} pages ([hugepages] mount = true wants {}); libvirt domains with <hugepages> and ALLOCs with paths need one", expected.display()),
                format!("hugemem hugepages --config {} mounts it (the unit's ExecStartPre= does at start)", config_name(inputs)),
            )
        } else {
            Item::warn(
                name,
                format!("no hugetlbfs mounted for {label} pages ([hugepages] mount = false): libvirt domains with <hugepages> and ALLOCs with paths need one"),
                format!("mount -t hugetlbfs -o pagesize={label},mode=1770 none {}", expected.display()),
            )
        });
    }
    items
}

/// userfaultfd for non-root tenants (lazy mode needs one with kernel
/// faults allowed): `vm.unprivileged_userfaultfd = 1`, or `/dev/userfaultfd`
/// open to each of them.
pub fn userfaultfd(inputs: &CheckInputs, tenants: &[Account]) -> Item {
    let sysctl_path = inputs.proc.join("sys/vm/unprivileged_userfaultfd");
    let sysctl = std::fs::read_to_string(&sysctl_path)
        .ok()
        .map(|s| s.trim().to_string());
    let dev = inputs.dev.join("userfaultfd");
    let dev_mode = std::fs::metadata(&dev)
        .ok()
        .map(|m| format!("{} {}", dev.display(), owner_and_mode(&m)));
    let setting = format!(
        "vm.unprivileged_userfaultfd = {}, {}",
        sysctl.as_deref().unwrap_or("absent"),
        dev_mode.as_deref().unwrap_or("no /dev/userfaultfd")
    );
    if sysctl.as_deref() == Some("1") {
        return Item::pass(
            "userfaultfd",
            format!("{setting}: every tenant may use lazy mode"),
        );
    }
    if tenants.is_empty() {
        return Item::pass(
            "userfaultfd",
            format!("{setting}: only root tenants (allowed_uids is empty), who may use lazy mode"),
        );
    }
    if !inputs.is_root() {
        return Item::skip(
            "userfaultfd",
            format!("{setting}; whether the tenants may open /dev/userfaultfd needs root to test"),
            "run hugemem check as root",
        );
    }
    let blocked: Vec<String> = tenants
        .iter()
        .filter(|t| dev_mode.is_none() || t.can_read_write(&dev) != Some(true))
        .map(Account::label)
        .collect();
    if blocked.is_empty() {
        Item::pass("userfaultfd", format!("{setting}: open to every tenant"))
    } else {
        Item::warn(
            "userfaultfd",
            format!("lazy mode (clear_mode = lazy) is closed to {}: {setting}; eager ALLOCs are unaffected", blocked.join(", ")),
            "sysctl -w vm.unprivileged_userfaultfd=1 (persist in /etc/sysctl.d/), or a udev rule giving /dev/userfaultfd to a group the tenants are in",
        )
    }
}

/// `user:group mode` of a file, by name where the system has one.
fn owner_and_mode(meta: &std::fs::Metadata) -> String {
    let user = Account::of_uid(meta.uid())
        .name
        .unwrap_or_else(|| meta.uid().to_string());
    let group = group_name(meta.gid()).unwrap_or_else(|| meta.gid().to_string());
    format!("{user}:{group} {:04o}", meta.permissions().mode() & 0o7777)
}

/// `/dev/kvm` opens and answers `KVM_GET_API_VERSION` (12); each tenant can
/// open it.
pub fn kvm(inputs: &CheckInputs, tenants: &[Account]) -> Item {
    let path = inputs.dev.join("kvm");
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) => {
            return Item::fail(
                "kvm",
                format!("{}: {e}: VMMs can only emulate (TCG, slow)", path.display()),
                "load kvm_intel or kvm_amd (modprobe), enable virtualisation in the firmware, or give the VM nested virtualisation",
            )
        }
    };
    let owner = format!("{} {}", path.display(), owner_and_mode(&meta));
    let version = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .and_then(|f| kvm_api_version(&f));
    match version {
        Ok(12) => {}
        Ok(v) => {
            return Item::fail(
                "kvm",
                format!("{owner}: KVM API version {v}, not 12"),
                "use a kernel with a standard KVM",
            )
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Item::skip(
                "kvm",
                format!("{owner}: cannot open it as uid {}: {e}", inputs.euid),
                "run hugemem check as root",
            )
        }
        Err(e) => return Item::fail("kvm", format!("{owner}: {e}"), "load kvm_intel or kvm_amd"),
    }
    if !inputs.is_root() {
        return Item::pass(
            "kvm",
            format!("{owner}: KVM API 12 (the tenants' access not checked: not root)"),
        );
    }
    let blocked: Vec<String> = tenants
        .iter()
        .filter(|t| t.can_read_write(&path) != Some(true))
        .map(Account::label)
        .collect();
    if blocked.is_empty() {
        Item::pass("kvm", format!("{owner}: KVM API 12, open to every tenant"))
    } else {
        Item::warn(
            "kvm",
            format!("{owner}: KVM API 12, but {} cannot open it (their VMMs get no KVM; libvirt re-probes QEMU on every call)", blocked.join(", ")),
            "chgrp kvm /dev/kvm && chmod 0660 /dev/kvm (Debian's udev rule), and put the tenants in group kvm",
        )
    }
}
