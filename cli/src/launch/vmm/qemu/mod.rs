//! QEMU's adapter: its command line on daemon memory (`command_line.rs`),
//! its QMP monitor on a socket pair (`qmp.rs`), and its live update, a
//! migration with `x-ignore-shared` (`switch.rs`); its park (`park.rs`,
//! asked of the launcher on its control socket) and restore
//! (`restore.rs`), the device state kept by the daemon in the documents of
//! `parked.rs`. Clones: a copy clone is a restore of fresh memory filled
//! from the template (`restore.rs`); a shared clone maps the template
//! privately (`clone.rs`); what a clone cannot hold is `identity.rs`'s.

mod backend_options;
mod clone;
pub mod command_line;
mod identity;
mod park;
pub mod parked;
pub mod qmp;
mod restore;
mod switch;

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use hugemem_client::park::Parked;

pub use command_line::KVM_CPU;
use switch::QemuSwitch;

use super::adapter::{ParkError, VmmAdapter, VmmClone, VmmRestore};
use crate::launch::command_line::{BuildError, BuildOptions, MemoryRegion, Vmm};
use crate::launch::config::LaunchConfig;
use crate::launch::error::LaunchError;
use crate::launch::update::{UpdateReport, VmmSwitch};

/// QEMU (`qemu-system-*`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Qemu;

const NAME: &str = "QEMU";

impl VmmAdapter for Qemu {
    fn kind(&self) -> Vmm {
        Vmm::Qemu
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn id(&self) -> &'static str {
        "qemu"
    }

    fn check_args(
        &self,
        args: &[OsString],
        _opts: &BuildOptions,
        regions: usize,
    ) -> Result<(), BuildError> {
        match command_line::check(args)? {
            m if m.microvm && regions > 1 => Err(BuildError::MicrovmRegions(regions)),
            _ => Ok(()),
        }
    }

    fn build_args(
        &self,
        args: &[OsString],
        regions: &[MemoryRegion],
        _opts: &BuildOptions,
    ) -> Result<Vec<OsString>, BuildError> {
        command_line::build(args, regions)
    }

    fn update_switch(
        &self,
        cfg: &LaunchConfig,
        full: &mut Vec<OsString>,
    ) -> Result<(Box<dyn VmmSwitch>, Vec<OwnedFd>), LaunchError> {
        let (switch, monitor) = QemuSwitch::for_launch(
            full,
            &cfg.command[1..],
            cfg.build_options(),
            cfg.update_timeout,
        )
        .map_err(|e| LaunchError::Options(format!("cannot set up live updates: {e}")))?;
        Ok((Box::new(switch), vec![monitor]))
    }

    fn describe_update(&self, report: &UpdateReport) -> String {
        format!(
            "updated: QEMU pid {} -> {} ({}); {:.1} ms in all, guest switched in {:.1} ms \
             (QEMU's downtime {} ms); RAM transferred {} bytes of {} guest RAM; memory by {}",
            report.old_pid,
            report.new_pid,
            report.program,
            report.update_ms,
            report.switch_ms,
            report.qemu_downtime_ms,
            report.ram_transferred_bytes,
            guest_mem::size::format_size(report.guest_ram_bytes),
            if report.handoff {
                "daemon HANDOFF"
            } else {
                "the launcher's descriptors"
            },
        )
    }

    fn successor_memory_by_handoff(&self) -> bool {
        true
    }

    fn park(
        &self,
        _daemon: &Path,
        name: &str,
        vm_control: &Path,
        timeout: Duration,
    ) -> Result<Parked, ParkError> {
        // The launcher owns QEMU's monitor and its daemon session: it
        // parks when asked on its control socket (`park.rs`).
        let report =
            crate::launch::control::request_park(vm_control, name, timeout).map_err(|e| {
                ParkError::Api {
                    vmm: NAME,
                    source: Box::new(e),
                }
            })?;
        Ok(Parked {
            alloc_id: report.alloc_id,
            bytes: report.bytes,
            copied_bytes: report.copied_bytes,
            slots: report.slots,
        })
    }

    fn restore(&self) -> Result<&dyn VmmRestore, LaunchError> {
        Ok(&restore::QemuRestore)
    }

    fn clone(&self) -> Result<&dyn VmmClone, LaunchError> {
        Ok(&clone::QemuClone)
    }

    fn restores_on_demand(&self) -> bool {
        false
    }

    fn exit_status_of_guest(&self, code: u8) -> i32 {
        (i32::from(code) << 1) | 1
    }

    fn kernel_args(&self, kernel: &Path) -> Vec<OsString> {
        vec!["-kernel".into(), kernel.as_os_str().to_owned()]
    }
}
