//! cloud-hypervisor's adapter: its command line on daemon memory
//! (`command_line.rs`), its REST API (`api.rs`) and event monitor
//! (`events.rs`), its live update, its own local migration
//! (`switch.rs`), park, its offload snapshot sent to the daemon
//! (`park.rs`), restore, a parked VM received by a new
//! cloud-hypervisor (`restore.rs`), and clones, a new cloud-hypervisor
//! started from a parked VM that stays parked (`clone.rs`).

pub mod api;
mod clone;
pub mod command_line;
pub mod events;
mod park;
mod restore;
mod switch;

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use hugemem_client::park::Parked;

use clone::ChClone;
pub use park::PrivateListener;
use restore::ChRestore;
pub use restore::ReceiveError;
use switch::ChSwitch;

use super::adapter::{ParkError, VmmAdapter, VmmClone, VmmRestore};
use crate::launch::command_line::{BuildError, BuildOptions, MemoryRegion, Vmm};
use crate::launch::config::LaunchConfig;
use crate::launch::error::LaunchError;
use crate::launch::update::{UpdateReport, VmmSwitch};

/// cloud-hypervisor.
#[derive(Debug, Clone, Copy, Default)]
pub struct CloudHypervisor;

const NAME: &str = "cloud-hypervisor";

impl VmmAdapter for CloudHypervisor {
    fn kind(&self) -> Vmm {
        Vmm::CloudHypervisor
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn id(&self) -> &'static str {
        NAME
    }

    fn check_args(
        &self,
        args: &[OsString],
        opts: &BuildOptions,
        _regions: usize,
    ) -> Result<(), BuildError> {
        command_line::check(args, opts)
    }

    fn build_args(
        &self,
        args: &[OsString],
        regions: &[MemoryRegion],
        opts: &BuildOptions,
    ) -> Result<Vec<OsString>, BuildError> {
        command_line::build(args, regions, opts)
    }

    fn update_switch(
        &self,
        cfg: &LaunchConfig,
        full: &mut Vec<OsString>,
    ) -> Result<(Box<dyn VmmSwitch>, Vec<OwnedFd>), LaunchError> {
        let control = cfg
            .control
            .as_deref()
            .ok_or_else(|| LaunchError::Options("live update needs a control socket".into()))?;
        let (switch, inherit) =
            ChSwitch::for_launch(full, &cfg.command[1..], control, cfg.update_timeout)?;
        Ok((Box::new(switch), inherit))
    }

    fn describe_update(&self, report: &UpdateReport) -> String {
        format!(
            "updated: cloud-hypervisor pid {} -> {} ({}); {:.1} ms in all, guest switched in {:.1} ms; \
             {} bytes written by the old process during the switch ({} of guest RAM not sent: \
             its memory fds moved)",
            report.old_pid,
            report.new_pid,
            report.program,
            report.update_ms,
            report.switch_ms,
            report.ram_transferred_bytes,
            guest_mem::size::format_size(report.guest_ram_bytes),
        )
    }

    fn successor_memory_by_handoff(&self) -> bool {
        false
    }

    fn park(
        &self,
        daemon: &Path,
        name: &str,
        vm_control: &Path,
        timeout: Duration,
    ) -> Result<Parked, ParkError> {
        park::park(daemon, name, vm_control, timeout)
    }

    fn restore(&self) -> Result<&dyn VmmRestore, LaunchError> {
        Ok(&ChRestore)
    }

    fn clone(&self) -> Result<&dyn VmmClone, LaunchError> {
        Ok(&ChClone)
    }

    fn restores_on_demand(&self) -> bool {
        true
    }

    fn exit_status_of_guest(&self, _code: u8) -> i32 {
        // The guest powers the VM off (ACPI); its code is not passed on.
        0
    }

    fn kernel_args(&self, kernel: &Path) -> Vec<OsString> {
        vec!["--kernel".into(), kernel.as_os_str().to_owned()]
    }
}
