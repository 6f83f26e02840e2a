//! The `hugemem` commands the bench runs, as a user would: `hugemem launch`
//! (a template, `--clone-of NAME --clone-mode shared|copy`, `--restore
//! NAME`) and `hugemem park`, against a private `hugemem serve`, with
//! cloud-hypervisor (`--api-socket`) or QEMU (the launcher's
//! `--control-socket`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use hugemem::launch::Vmm;

use crate::harness::serve::{wait_child_until, ServeChild, ServeOptions};
use crate::vmm_side::{BenchVmm, CloudHypervisor, Qemu};
use crate::vmm_update::error::{io, VmmUpdateError};
use crate::vmm_update::guest::GuestRam;
use crate::vmm_update::setup::child_of;

/// How long a launcher may take to end once its VM is parked or stopped.
const EXIT_WAIT: Duration = Duration::from_secs(120);

/// What a VM is started from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source<'a> {
    /// A new guest (`--size S --page-size P` and the guest image).
    Fresh(&'a Path),
    /// `--clone-of NAME --clone-mode MODE`.
    CloneOf(&'a str, &'a str),
    /// `--restore NAME`.
    Restore(&'a str),
}

/// A `hugemem launch` the bench spawned; SIGTERM (its VM stops, its memory
/// is freed) and reaped when dropped.
pub(crate) struct Launcher {
    child: Child,
    /// Its VM's API socket (cloud-hypervisor) or its launcher's control
    /// socket (QEMU): what `hugemem park` is given.
    pub(crate) api: PathBuf,
    /// What it is, for messages.
    pub(crate) what: String,
    log: PathBuf,
    status: Option<ExitStatus>,
}

impl Launcher {
    /// Its pid.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, once it exited (does not block).
    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// The end of its log.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(5).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    /// Waits for its exit (on a pidfd of it: the exit is the event); true
    /// when it ended with status 0.
    pub(crate) fn ended_ok(&mut self) -> Result<bool, VmmUpdateError> {
        if self.status.is_none() {
            self.status = wait_child_until(&mut self.child, Instant::now() + EXIT_WAIT);
        }
        match self.status {
            Some(status) => Ok(status.success()),
            None => Err(VmmUpdateError::Guest(format!(
                "{} did not exit within {EXIT_WAIT:?}",
                self.what
            ))),
        }
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        if self.exited().is_none() {
            if let Ok(pid) = i32::try_from(self.child.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let _ = self.child.wait();
        }
    }
}

/// Stops every launcher of `vms` at once (SIGTERM to all, then the waits).
pub(crate) fn stop_all(vms: Vec<Launcher>) {
    for l in &vms {
        if let Ok(pid) = i32::try_from(l.pid()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }
    drop(vms);
}

/// A private daemon and the paths of one phase of the run.
pub(crate) struct Daemon {
    pub(crate) socket: PathBuf,
    dir: PathBuf,
    launcher: PathBuf,
    /// The VMM and its program.
    vmm: (Vmm, OsString),
    serve: Option<ServeChild>,
    next: usize,
}

impl Daemon {
    /// `hugemem serve` with a pool of `pool` bytes, its files in `dir`
    /// named after `name`, room for `vms` VMs at once: each running clone
    /// keeps its launcher's connection, and the default limit of one uid's
    /// connections (`[limits] max_connections_per_uid`, 16) would refuse
    /// the 17th.
    pub(crate) fn start(
        launcher: &Path,
        vmm: (Vmm, OsString),
        dir: &Path,
        (name, pool, vms): (&str, u64, usize),
    ) -> Result<Self, VmmUpdateError> {
        let socket = dir.join(format!("{name}.sock"));
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[limits]\nmax_connections = {}\nmax_connections_per_uid = {}\n",
                vms + 32,
                vms + 16
            ),
        )
        .map_err(io(format!("write {}", config.display())))?;
        let serve = ServeChild::start(
            launcher,
            &ServeOptions {
                socket: socket.clone(),
                config: Some(config),
                pool: Some((pool, pool)),
                log: Some(dir.join(format!("{name}-daemon.log"))),
                ..ServeOptions::default()
            },
        )?;
        Ok(Self {
            socket,
            dir: dir.to_owned(),
            launcher: launcher.to_owned(),
            vmm,
            serve: Some(serve),
            next: 0,
        })
    }

    /// A STATS client.
    pub(crate) fn client(&self) -> Result<backend::client::Client, VmmUpdateError> {
        Ok(backend::client::Client::connect(&self.socket)?)
    }

    /// `hugemem launch --socket … [source] -- cloud-hypervisor --api-socket
    /// …`, or for QEMU `hugemem launch --socket … --control-socket …
    /// [source] -- qemu-system-x86_64 …` (a clone or a restore reuses the
    /// parked command line).
    pub(crate) fn launch(
        &mut self,
        source: Source<'_>,
        size: u64,
        page: guest_mem::PageSize,
    ) -> Result<Launcher, VmmUpdateError> {
        self.next += 1;
        let n = self.next;
        let api = self.dir.join(format!("vm{n}.api"));
        let log = self.dir.join(format!("vm{n}.log"));
        let mut args: Vec<OsString> = vec!["launch".into(), "--socket".into()];
        args.push(self.socket.clone().into());
        let (vmm, program) = &self.vmm;
        if *vmm == Vmm::Qemu {
            args.push("--control-socket".into());
            args.push(api.clone().into());
        }
        let what = match source {
            Source::Fresh(_) => {
                args.extend(
                    [
                        "--size".to_string(),
                        size.to_string(),
                        "--page-size".into(),
                        page.to_string(),
                    ]
                    .map(OsString::from),
                );
                format!("the template's launcher (vm{n})")
            }
            Source::CloneOf(name, mode) => {
                args.extend(["--clone-of", name, "--clone-mode", mode].map(OsString::from));
                format!("a {mode} clone's launcher (vm{n})")
            }
            Source::Restore(name) => {
                args.extend(["--restore", name].map(OsString::from));
                format!("a restore's launcher (vm{n})")
            }
        };
        args.push("--".into());
        match (source, vmm) {
            (Source::Fresh(elf), Vmm::CloudHypervisor) => {
                args.extend(CloudHypervisor.spin_guest_args(program, elf));
            }
            (Source::Fresh(elf), Vmm::Qemu) => args.extend(Qemu.spin_guest_args(program, elf)),
            _ => args.push(program.clone()),
        }
        if *vmm == Vmm::CloudHypervisor {
            args.push("--api-socket".into());
            args.push(api.clone().into());
        }
        let log_file =
            std::fs::File::create(&log).map_err(io(format!("create {}", log.display())))?;
        let child = Command::new(&self.launcher)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(io(format!("start {}", self.launcher.display())))?;
        Ok(Launcher {
            child,
            api,
            what,
            log,
            status: None,
        })
    }

    /// The guest RAM of `vm`'s VM, a fresh launch: cloud-hypervisor's
    /// memory zone file, opened through its launcher, or QEMU's
    /// `mem-path=/dev/fd/N`.
    pub(crate) fn guest_ram(&self, vm: &Launcher) -> Result<GuestRam, VmmUpdateError> {
        let vmm = child_of(vm.pid())?;
        match self.vmm.0 {
            Vmm::CloudHypervisor => GuestRam::of_launched_ch(vm.pid(), vmm),
            Vmm::Qemu => GuestRam::of(vmm),
        }
    }

    /// `hugemem park NAME --api-socket …` (cloud-hypervisor) or `hugemem
    /// park NAME --control-socket …` (QEMU: its launcher asks the daemon)
    /// of `vm`'s VM, then its launcher's end.
    pub(crate) fn park(&self, mut vm: Launcher, name: &str) -> Result<(), VmmUpdateError> {
        let mut park = Command::new(&self.launcher);
        park.arg("park").arg(name);
        match self.vmm.0 {
            Vmm::CloudHypervisor => park
                .arg("--socket")
                .arg(&self.socket)
                .arg("--api-socket")
                .arg(&vm.api),
            Vmm::Qemu => park.arg("--control-socket").arg(&vm.api),
        };
        let out = park
            .stdin(Stdio::null())
            .output()
            .map_err(io(format!("run {} park", self.launcher.display())))?;
        if !out.status.success() {
            return Err(VmmUpdateError::Guest(format!(
                "hugemem park {name} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        if !vm.ended_ok()? {
            return Err(VmmUpdateError::Guest(format!(
                "{} failed once its VM was parked: {}",
                vm.what,
                vm.log_tail()
            )));
        }
        Ok(())
    }

    /// Stops the daemon (its pool goes back to the kernel).
    pub(crate) fn stop(mut self) {
        if let Some(serve) = self.serve.take() {
            serve.stop();
        }
    }
}
