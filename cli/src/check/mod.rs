//! `hugemem check`: whether this host is ready for the daemon and its
//! tenants, in the spirit of libvirt's `virt-host-validate`. Each item is
//! PASS, WARN, FAIL or SKIP (could not be checked, and why) with one line
//! of why and one of what to do; `--json` prints the same as one object;
//! the exit status is 1 when any item FAILs.
//!
//! The items: the configuration loads (the daemon's own loader); huge pages
//! reserved per node and page size, and whether more could be
//! ([`host`](crate::check::host)); hugetlbfs mounted per page size; userfaultfd open to the
//! tenants (lazy mode); KVM usable by them; the socket's group and the
//! daemon answering HANDSHAKE and STATS as root and as every tenant uid
//! ([`daemon`](crate::check::daemon)); libvirt's `qemu.conf` user and group against
//! `allowed_uids`/`socket_group`, the emulator script, the AMD `svm`
//! CPU-model hint and AppArmor/SELinux confinement ([`libvirt`](crate::check::libvirt));
//! the cloud-hypervisor found, its version against the migration protocol
//! hugemem speaks, and whether its local migration and offload work here
//! ([`cloud_hypervisor`](crate::check::cloud_hypervisor)).

pub mod accounts;
pub mod cloud_hypervisor;
pub mod daemon;
pub mod host;
pub mod inputs;
pub mod libvirt;
pub mod report;
pub mod run;
mod sys;

pub use inputs::CheckInputs;
pub use report::{Item, Report, Status};
pub use run::{load_config, run};
