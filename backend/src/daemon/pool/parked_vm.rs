//! A parked VM's record (`parked.rs`): what a restore sends besides the
//! memory. A leaf: the allocation table (`table.rs`) holds it.

use serde::{Deserialize, Serialize};

/// A parked VM: what a restore sends besides the memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedVm {
    /// Its name, unique per tenant.
    pub name: String,
    /// Memory slots in the order they came: the slot number and the index
    /// of the allocation's region that backs it.
    pub slots: Vec<ParkedSlot>,
    /// The VM's configuration, as the sender's `Config` carried it (JSON).
    pub config: String,
    /// The VM's state, as the sender's `State` carried it (JSON).
    pub state: String,
    /// Bytes copied into pool memory at park time (0: moved).
    pub copied_bytes: u64,
    /// When it was parked, seconds since the epoch.
    pub parked_at: u64,
    /// The VMM its configuration is for, read once when it was parked
    /// (absent in records of daemons before it was kept: read from the
    /// configuration then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm: Option<ParkedVmm>,
}

impl ParkedVm {
    /// The VMM its configuration is for.
    pub fn vmm(&self) -> ParkedVmm {
        self.vmm
            .unwrap_or_else(|| ParkedVmm::of_config(&self.config))
    }
}

/// The VMM a parked VM runs in: one of two names in STATS and `/metrics`,
/// whatever the tenant's configuration says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ParkedVmm {
    /// cloud-hypervisor (its own `VmConfig`).
    CloudHypervisor,
    /// QEMU (hugemem's document of a launched QEMU, `"vmm": "qemu"`).
    Qemu,
}

impl ParkedVmm {
    /// The VMM of configuration `config`: QEMU when its top-level `vmm`
    /// says `"qemu"`, cloud-hypervisor otherwise.
    pub fn of_config(config: &str) -> Self {
        #[derive(Deserialize)]
        struct Tag {
            vmm: Option<String>,
        }
        match serde_json::from_str::<Tag>(config) {
            Ok(Tag { vmm: Some(v) }) if v == "qemu" => Self::Qemu,
            _ => Self::CloudHypervisor,
        }
    }

    /// Its name in STATS and `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CloudHypervisor => "cloud-hypervisor",
            Self::Qemu => "qemu",
        }
    }
}

/// One memory slot of a parked VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedSlot {
    /// cloud-hypervisor's slot number.
    pub slot: u32,
    /// Index in the allocation's regions.
    pub region: usize,
}

#[cfg(test)]
mod tests {
    use super::ParkedVmm;

    #[test]
    fn the_vmm_is_qemu_only_when_the_configuration_says_so() {
        let qemu = r#"{"vmm":"qemu","format":1,"program":"qemu-system-x86_64"}"#;
        assert_eq!(ParkedVmm::of_config(qemu), ParkedVmm::Qemu);
        // cloud-hypervisor's own VmConfig has no `vmm`; anything else is
        // not trusted as a name.
        for other in [
            r#"{"cpus":{"boot_vcpus":1},"memory":{"size":0}}"#,
            r#"{"vmm":"evil\nlabel"}"#,
            r#"{"vmm":7}"#,
            "not json",
        ] {
            assert_eq!(
                ParkedVmm::of_config(other),
                ParkedVmm::CloudHypervisor,
                "{other}"
            );
        }
        // A record without it (a daemon's before it was kept) reads it from
        // the configuration; one with it keeps it through its JSON.
        let mut vm = super::ParkedVm {
            name: "vm".into(),
            slots: Vec::new(),
            config: qemu.into(),
            state: "{}".into(),
            copied_bytes: 0,
            parked_at: 0,
            vmm: None,
        };
        assert_eq!(vm.vmm(), ParkedVmm::Qemu);
        vm.vmm = Some(ParkedVmm::CloudHypervisor);
        let json = serde_json::to_string(&vm).expect("json");
        assert!(json.contains(r#""vmm":"cloud-hypervisor""#), "{json}");
        let back: super::ParkedVm = serde_json::from_str(&json).expect("read back");
        assert_eq!(back.vmm(), ParkedVmm::CloudHypervisor);
        assert_eq!(ParkedVmm::Qemu.as_str(), "qemu");
        assert_eq!(ParkedVmm::CloudHypervisor.as_str(), "cloud-hypervisor");
    }
}
