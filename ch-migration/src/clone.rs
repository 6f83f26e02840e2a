//! A clone's configuration: the migration configuration of a parked VM
//! (its template) rewritten so that a new cloud-hypervisor maps the
//! template's memory privately (copy-on-write) instead of receiving it.
//!
//! cloud-hypervisor restores a memory zone that names a `file` and comes
//! with no `MemoryFd` by opening that file itself: read-only when the
//! zone's `shared` is false, then `MAP_PRIVATE`. The kernel copies a huge
//! page only when the clone writes it, and the file never changes. The
//! launcher passes each read-only fd the daemon sent as an inherited
//! descriptor and names it `/dev/fd/N` here. Each zone gets `reserve` set
//! too: cloud-hypervisor then maps without `MAP_NORESERVE`, so the kernel
//! reserves the huge pages every write could need when the clone maps its
//! memory (a clone that cannot have them fails to start; one that started
//! never gets `SIGBUS` for want of a page).
//!
//! A VM whose devices need its memory mapped shared (VFIO, vhost-user,
//! vDPA, virtio-fs) cannot run on a private mapping:
//! [`shared_clone_refusal`] names the first such device. What a second
//! process cannot hold: a shared clone's launcher (a copy clone's daemon)
//! replaces a net's tap and a vsock's socket ([`clone_identity`], saying
//! what it replaced); a net on fds passed to the template's process is
//! refused ([`unreplaceable_identity`]).

use std::collections::BTreeMap;

use serde_json::Value;

/// Why a configuration cannot become a shared clone's.
#[derive(Debug, thiserror::Error)]
pub enum CloneConfigError {
    /// Not JSON.
    #[error("the migration configuration is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A field missing or of the wrong type.
    #[error("the migration configuration has no {0} (or not of its type)")]
    Field(&'static str),
    /// A device that needs the guest's memory mapped shared.
    #[error(
        "the VM has {0}, which needs its memory mapped shared: \
         a shared (copy-on-write) clone maps it privately; clone it with --clone-mode copy"
    )]
    NeedsSharedMemory(String),
    /// Memory not declared in zones (`--memory size=…`), which a clone
    /// cannot name a file for.
    #[error(
        "the VM's memory is not in memory zones (launched by hugemem, it would be): \
         a shared clone names a file per zone"
    )]
    NoZones,
    /// A slot that the launcher has no file for.
    #[error("memory slot {0} came without a file to map")]
    NoFile(u32),
    /// A zone whose slots came in two different files.
    #[error("memory zone {0:?} spans two files; a zone maps one")]
    TwoFiles(String),
    /// Something of the template's that a second process cannot hold.
    #[error(
        "the VM holds {0}, which a second cloud-hypervisor cannot share, so it cannot be cloned \
         (park it without: a --net without tap= or fd= gets a tap of its own in each clone)"
    )]
    SharedIdentity(String),
    /// Hot-pluggable memory (virtio-mem), which cloud-hypervisor restores
    /// without the zone's file.
    #[error("memory zone {0:?} is virtio-mem (hot-pluggable), which a clone cannot map")]
    VirtioMem(String),
}

/// The first device of the migration configuration `config` that needs the
/// guest's memory mapped shared, if any (a shared clone is refused then).
/// A configuration without `vm_config` names no device.
///
/// # Errors
///
/// [`CloneConfigError::NeedsSharedMemory`] naming it; a configuration
/// that is not JSON.
pub fn shared_clone_refusal(config: &[u8]) -> Result<(), CloneConfigError> {
    let value: Value = serde_json::from_slice(config)?;
    check_devices(&value)
}

fn check_devices(value: &Value) -> Result<(), CloneConfigError> {
    let Some(vm) = value.get("vm_config") else {
        return Ok(());
    };
    let present = |key: &str| {
        vm.get(key)
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
    };
    for (key, what) in [
        ("devices", "a VFIO device"),
        ("user_devices", "a vfio-user device"),
        ("vdpa", "a vDPA device"),
        ("fs", "a virtio-fs share (vhost-user)"),
        ("generic_vhost_user", "a vhost-user device"),
    ] {
        if present(key) {
            return Err(CloneConfigError::NeedsSharedMemory(what.into()));
        }
    }
    for (key, what) in [("net", "a vhost-user net"), ("disks", "a vhost-user disk")] {
        let vhost_user = vm
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .any(|d| d.get("vhost_user").and_then(Value::as_bool) == Some(true));
        if vhost_user {
            return Err(CloneConfigError::NeedsSharedMemory(what.into()));
        }
    }
    Ok(())
}

/// What a clone's configuration says of its template's devices that a
/// second process cannot hold: what was replaced, device by device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replaced {
    /// The device (`net0`, `vsock`).
    pub device: String,
    /// What it had, what it has now, and why.
    pub what: String,
}

impl std::fmt::Display for Replaced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.device, self.what)
    }
}

/// The longest network interface name the kernel takes (IFNAMSIZ - 1).
const IF_NAME_MAX: usize = 15;

/// What [`clone_identity`] checks before it names something new.
pub trait HostNames {
    /// Whether a network interface of this name exists.
    fn interface_exists(&self, name: &str) -> bool;
    /// Whether a file of this path exists.
    fn path_exists(&self, path: &str) -> bool;
}

/// The host as it is (`/sys/class/net`, the file system).
#[derive(Debug, Clone, Copy, Default)]
pub struct ThisHost;

impl HostNames for ThisHost {
    fn interface_exists(&self, name: &str) -> bool {
        std::path::Path::new("/sys/class/net").join(name).exists()
    }

    fn path_exists(&self, path: &str) -> bool {
        std::path::Path::new(path).symlink_metadata().is_ok()
    }
}

/// The parts of the migration configuration `config` that two processes
/// cannot both hold, replaced for a clone tagged `tag` (the launcher's
/// pid: unique among running clones), each named in the list returned:
///
/// * each virtio-net on a tap (named or not) gets a new tap, named
///   `hmc<tag>n<i>`, which its cloud-hypervisor creates. It is attached
///   to nothing (the template's tap may be on a bridge: attach the new one
///   as the template's was). The template's host IP, mask and host MAC
///   are not copied (two host interfaces would claim them); the guest's
///   MAC is in the guest's memory and device state and stays (the clone's
///   identity);
/// * the vsock device's socket gets its own path, `<socket>.clone-<tag>`.
///   cloud-hypervisor's vsock is a hybrid vsock over that UNIX socket: its
///   CID is the guest's alone (no host vsock device holds it), so it stays.
///
/// A net on fds passed to the template's process is refused: those fds
/// were the operator's (a macvtap, a tap of another namespace), and a new
/// tap would put the clone on another network than the template's.
///
/// # Errors
///
/// [`CloneConfigError::SharedIdentity`] naming what cannot be replaced (a
/// net on passed fds, a name for the new part that is taken); a
/// configuration that is not JSON.
pub fn clone_identity(
    config: &[u8],
    tag: u32,
    host: &impl HostNames,
) -> Result<(Vec<u8>, Vec<Replaced>), CloneConfigError> {
    let mut value: Value = serde_json::from_slice(config)?;
    let mut replaced = Vec::new();
    let Some(vm) = value.get_mut("vm_config") else {
        return Ok((config.to_vec(), replaced));
    };
    unreplaceable(vm)?;
    let nets = vm.get_mut("net").and_then(Value::as_array_mut);
    for (i, net) in nets.into_iter().flatten().enumerate() {
        let Some(net) = net.as_object_mut() else {
            continue;
        };
        if net.get("vhost_user").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        let device = net
            .get("id")
            .and_then(Value::as_str)
            .map_or_else(|| format!("net {i}"), str::to_string);
        let tap = format!("hmc{tag}n{i}");
        if tap.len() > IF_NAME_MAX || host.interface_exists(&tap) {
            return Err(CloneConfigError::SharedIdentity(format!(
                "{device}, whose new tap {tap} cannot be made (the name is taken or too long)"
            )));
        }
        let old = match net.get("tap").and_then(Value::as_str) {
            Some(t) => format!("the template's tap {t}"),
            None => "the tap cloud-hypervisor made for the template".to_string(),
        };
        let dropped: Vec<&str> = ["ip", "mask", "host_mac"]
            .into_iter()
            .filter(|k| net.get(*k).is_some_and(|v| !v.is_null()))
            .collect();
        for key in &dropped {
            net.insert((*key).into(), Value::Null);
        }
        net.insert("tap".into(), tap.clone().into());
        let dropped = if dropped.is_empty() {
            String::new()
        } else {
            format!("; the template's {} not copied", dropped.join(", "))
        };
        replaced.push(Replaced {
            device,
            what: format!(
                "{old} is replaced by a new tap {tap}, attached to nothing \
                 (a second process cannot hold the template's){dropped}"
            ),
        });
    }
    if let Some(vsock) = vm
        .get_mut("vsock")
        .filter(|v| !v.is_null())
        .and_then(Value::as_object_mut)
    {
        let socket = vsock
            .get("socket")
            .and_then(Value::as_str)
            .ok_or(CloneConfigError::Field("vm_config.vsock.socket"))?;
        let cid = vsock.get("cid").and_then(Value::as_u64).unwrap_or(0);
        let new = format!("{socket}.clone-{tag}");
        if host.path_exists(&new) {
            return Err(CloneConfigError::SharedIdentity(format!(
                "a vsock device whose new socket {new} exists already"
            )));
        }
        replaced.push(Replaced {
            device: vsock
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or("vsock")
                .to_string(),
            what: format!(
                "the template's socket {socket} is replaced by {new} (the guest's \
                 connections to host port P go to {new}_P); the CID {cid} stays \
                 (a hybrid vsock's CID is the guest's alone)"
            ),
        });
        vsock.insert("socket".into(), new.into());
    }
    Ok((serde_json::to_vec(&value)?, replaced))
}

/// What no clone can be given in place of the template's: a net on fds
/// passed to the template's process (see [`clone_identity`]). The
/// daemon's check of a shared CLONE; the launcher replaces the rest.
///
/// # Errors
///
/// [`CloneConfigError::SharedIdentity`] naming it; a configuration that
/// is not JSON.
pub fn unreplaceable_identity(config: &[u8]) -> Result<(), CloneConfigError> {
    let value: Value = serde_json::from_slice(config)?;
    value.get("vm_config").map_or(Ok(()), unreplaceable)
}

fn unreplaceable(vm: &Value) -> Result<(), CloneConfigError> {
    for net in vm
        .get("net")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let id = net.get("id").and_then(Value::as_str).unwrap_or("a net");
        if net
            .get("fds")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty())
        {
            return Err(CloneConfigError::SharedIdentity(format!(
                "{id} on fds passed to its process (they were the operator's: a new tap \
                 would put the clone on another network)"
            )));
        }
    }
    Ok(())
}

/// `config` rewritten for a shared clone: every memory zone that holds a
/// slot names the file `files` gives for its slots (`/dev/fd/N` of a
/// read-only descriptor the clone inherits), with `shared` false,
/// `reserve` true and `prefault` false. Nothing else changes.
///
/// # Errors
///
/// [`CloneConfigError`]: a device that needs shared memory, memory
/// outside zones, a slot without a file, a zone over two files, virtio-mem.
pub fn shared_clone_config(
    config: &[u8],
    files: &BTreeMap<u32, String>,
) -> Result<Vec<u8>, CloneConfigError> {
    let mut value: Value = serde_json::from_slice(config)?;
    check_devices(&value)?;
    let zone_files = zone_files(&value, files)?;
    let memory = value
        .pointer_mut("/vm_config/memory")
        .and_then(Value::as_object_mut)
        .ok_or(CloneConfigError::Field("vm_config.memory"))?;
    if memory.get("size").and_then(Value::as_u64) != Some(0) {
        return Err(CloneConfigError::NoZones);
    }
    let zones = memory
        .get_mut("zones")
        .and_then(Value::as_array_mut)
        .ok_or(CloneConfigError::NoZones)?;
    for zone in zones.iter_mut().filter_map(Value::as_object_mut) {
        let id = zone.get("id").and_then(Value::as_str).unwrap_or_default();
        let Some(file) = zone_files.get(id) else {
            continue;
        };
        zone.insert("file".into(), file.clone().into());
        zone.insert("shared".into(), false.into());
        zone.insert("reserve".into(), true.into());
        zone.insert("prefault".into(), false.into());
    }
    Ok(serde_json::to_vec(&value)?)
}

/// Each zone's file, from its slots' (`guest_ram_mappings`: slot, zone_id).
fn zone_files(
    value: &Value,
    files: &BTreeMap<u32, String>,
) -> Result<BTreeMap<String, String>, CloneConfigError> {
    let mappings = value
        .pointer("/memory_manager_data/guest_ram_mappings")
        .and_then(Value::as_array)
        .ok_or(CloneConfigError::Field(
            "memory_manager_data.guest_ram_mappings",
        ))?;
    let mut zones: BTreeMap<String, String> = BTreeMap::new();
    for m in mappings {
        let slot = m
            .get("slot")
            .and_then(Value::as_u64)
            .and_then(|s| u32::try_from(s).ok())
            .ok_or(CloneConfigError::Field("guest_ram_mappings[].slot"))?;
        let zone = m
            .get("zone_id")
            .and_then(Value::as_str)
            .ok_or(CloneConfigError::Field("guest_ram_mappings[].zone_id"))?;
        if m.get("virtio_mem").and_then(Value::as_bool) == Some(true) {
            return Err(CloneConfigError::VirtioMem(zone.into()));
        }
        let file = files.get(&slot).ok_or(CloneConfigError::NoFile(slot))?;
        match zones.get(zone) {
            Some(other) if other != file => return Err(CloneConfigError::TwoFiles(zone.into())),
            Some(_) => {}
            None => {
                zones.insert(zone.into(), file.clone());
            }
        }
    }
    Ok(zones)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: Value) -> Vec<u8> {
        let mut vm = serde_json::json!({
            "memory": {"size": 0, "shared": false, "zones": [
                {"id": "mem0", "size": 4194304, "file": "/dev/fd/5", "shared": true, "prefault": true},
                {"id": "mem1", "size": 2097152, "file": "/dev/fd/6", "shared": true},
            ]},
        });
        if let (Some(vm), Some(extra)) = (vm.as_object_mut(), extra.as_object()) {
            for (k, v) in extra {
                vm.insert(k.clone(), v.clone());
            }
        }
        serde_json::to_vec(&serde_json::json!({
            "vm_config": vm,
            "memory_manager_data": {"guest_ram_mappings": [
                {"slot": 0, "gpa": 0, "size": 4194304, "zone_id": "mem0", "virtio_mem": false, "file_offset": 0},
                {"slot": 1, "gpa": 4194304, "size": 2097152, "zone_id": "mem1", "virtio_mem": false, "file_offset": 0},
            ]},
        }))
        .expect("json")
    }

    fn files() -> BTreeMap<u32, String> {
        BTreeMap::from([(0, "/dev/fd/9".to_string()), (1, "/dev/fd/10".to_string())])
    }

    #[test]
    fn each_zone_names_its_slots_file_privately_and_reserved() {
        let out = shared_clone_config(&config(Value::Null), &files()).expect("rewritten");
        let v: Value = serde_json::from_slice(&out).expect("json");
        let zones = v.pointer("/vm_config/memory/zones").expect("zones");
        assert_eq!(zones[0]["file"], "/dev/fd/9");
        assert_eq!(zones[1]["file"], "/dev/fd/10");
        for z in [&zones[0], &zones[1]] {
            assert_eq!(z["shared"], false);
            assert_eq!(z["reserve"], true);
            assert_eq!(z["prefault"], false);
        }
        assert_eq!(
            v["memory_manager_data"],
            serde_json::from_slice::<Value>(&config(Value::Null)).expect("json")
                ["memory_manager_data"]
        );
    }

    #[test]
    fn devices_that_need_shared_memory_are_named() {
        for (extra, word) in [
            (
                serde_json::json!({"devices": [{"path": "/sys/bus/pci/x"}]}),
                "VFIO",
            ),
            (serde_json::json!({"fs": [{"tag": "t"}]}), "virtio-fs"),
            (
                serde_json::json!({"net": [{"vhost_user": true}]}),
                "vhost-user net",
            ),
            (
                serde_json::json!({"disks": [{"vhost_user": true}]}),
                "vhost-user disk",
            ),
        ] {
            let err = shared_clone_config(&config(extra.clone()), &files()).expect_err("refused");
            assert!(err.to_string().contains(word), "{err}");
            assert!(shared_clone_refusal(&config(extra)).is_err());
        }
        shared_clone_refusal(&config(serde_json::json!({"net": [{"vhost_user": false}]})))
            .expect("a tap net maps memory as it likes");
    }

    /// A host where `taken` names exist.
    struct Taken(&'static [&'static str]);

    impl HostNames for Taken {
        fn interface_exists(&self, name: &str) -> bool {
            self.0.contains(&name)
        }
        fn path_exists(&self, path: &str) -> bool {
            self.0.contains(&path)
        }
    }

    #[test]
    fn taps_and_a_vsock_socket_are_replaced_and_each_named() {
        let template = config(serde_json::json!({
            "net": [
                {"id": "net0", "tap": "tap7", "ip": "192.168.1.1", "mask": "255.255.255.0",
                 "mac": "12:34:56:78:9a:bc", "host_mac": "02:00:00:00:00:01"},
                {"id": "net1", "tap": null},
            ],
            "vsock": {"id": "vsock0", "cid": 3, "socket": "/run/v.sock"},
        }));
        let (out, replaced) = clone_identity(&template, 4242, &Taken(&[])).expect("replaced");
        let v: Value = serde_json::from_slice(&out).expect("json");
        let net0 = &v["vm_config"]["net"][0];
        assert_eq!(net0["tap"], "hmc4242n0");
        for key in ["ip", "mask", "host_mac"] {
            assert!(net0[key].is_null(), "{key} copied: {net0}");
        }
        assert_eq!(net0["mac"], "12:34:56:78:9a:bc", "the guest's MAC stays");
        assert_eq!(v["vm_config"]["net"][1]["tap"], "hmc4242n1");
        assert_eq!(v["vm_config"]["vsock"]["socket"], "/run/v.sock.clone-4242");
        assert_eq!(v["vm_config"]["vsock"]["cid"], 3, "the CID stays");
        let said: Vec<String> = replaced.iter().map(ToString::to_string).collect();
        assert_eq!(said.len(), 3, "{said:?}");
        assert!(
            said[0].starts_with("net0: the template's tap tap7 is replaced by a new tap hmc4242n0")
        );
        assert!(
            said[0].contains("ip, mask, host_mac not copied"),
            "{}",
            said[0]
        );
        assert!(
            said[1].starts_with("net1: the tap cloud-hypervisor made"),
            "{}",
            said[1]
        );
        assert!(said[2].contains("/run/v.sock.clone-4242") && said[2].contains("CID 3 stays"));
        assert_eq!(
            v["memory_manager_data"],
            serde_json::from_slice::<Value>(&template).expect("json")["memory_manager_data"],
            "nothing else changes"
        );
        let (same, none) = clone_identity(&config(Value::Null), 1, &Taken(&[])).expect("ok");
        assert!(none.is_empty());
        assert_eq!(
            serde_json::from_slice::<Value>(&same).expect("json"),
            serde_json::from_slice::<Value>(&config(Value::Null)).expect("json")
        );
    }

    #[test]
    fn passed_fds_and_taken_names_are_refused_naming_the_device() {
        let fds = config(serde_json::json!({"net": [{"id": "net3", "fds": [5]}]}));
        for err in [
            clone_identity(&fds, 1, &Taken(&[])).expect_err("refused"),
            unreplaceable_identity(&fds).expect_err("refused"),
        ] {
            assert!(err.to_string().contains("net3 on fds passed"), "{err}");
        }
        let tap = config(serde_json::json!({"net": [{"id": "net0", "tap": "tap7"}]}));
        unreplaceable_identity(&tap).expect("a tap is replaced");
        let err = clone_identity(&tap, 9, &Taken(&["hmc9n0"])).expect_err("taken");
        assert!(err.to_string().contains("hmc9n0"), "{err}");
        let vsock = config(serde_json::json!({"vsock": {"cid": 3, "socket": "/v"}}));
        let err = clone_identity(&vsock, 2, &Taken(&["/v.clone-2"])).expect_err("taken");
        assert!(err.to_string().contains("/v.clone-2 exists"), "{err}");
    }

    #[test]
    fn a_missing_file_zone_less_memory_and_two_files_are_refused() {
        let mut one = files();
        one.remove(&1);
        assert!(matches!(
            shared_clone_config(&config(Value::Null), &one),
            Err(CloneConfigError::NoFile(1))
        ));
        let mut c: Value = serde_json::from_slice(&config(Value::Null)).expect("json");
        c["vm_config"]["memory"]["size"] = 6291456.into();
        let c = serde_json::to_vec(&c).expect("json");
        assert!(matches!(
            shared_clone_config(&c, &files()),
            Err(CloneConfigError::NoZones)
        ));
        let mut c: Value = serde_json::from_slice(&config(Value::Null)).expect("json");
        c["memory_manager_data"]["guest_ram_mappings"][1]["zone_id"] = "mem0".into();
        let c = serde_json::to_vec(&c).expect("json");
        assert!(matches!(
            shared_clone_config(&c, &files()),
            Err(CloneConfigError::TwoFiles(_))
        ));
        assert!(shared_clone_config(b"{", &files()).is_err());
    }
}
