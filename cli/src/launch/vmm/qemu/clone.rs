//! QEMU's side of `hugemem launch --clone-of NAME --clone-mode shared --
//! qemu-system-x86_64 …`: a new QEMU that runs a clone of the QEMU VM
//! parked as NAME (its template), mapping the template's memory privately
//! (copy-on-write), as QEMU's VM templating does
//! (docs/system/vm-templating.rst in QEMU). A copy clone is a restore
//! (`restore.rs`).
//!
//! Before QEMU starts, the launcher asks the daemon for the template
//! (CLONE) on one end of a socket pair and receives it on the other: each
//! memory region as a read-only fd, the configuration (the parked command
//! line) and the state (QEMU's migration stream, without RAM). QEMU starts
//! on those fds, named `/dev/fd/N`, with `share=off` (`MAP_PRIVATE`: a page
//! is copied only when the clone writes it) and `-incoming defer`; once
//! it runs, the launcher feeds it the stream with `x-ignore-shared`, as a
//! restore does. QEMU's RAM block is not shared then, but the stream
//! carries no page of it, and QEMU keeps the mapping as it is: the
//! template's bytes.
//!
//! How QEMU opens the file depends on its version:
//! * with `rom` (QEMU 8.2 on), `readonly=on,rom=off`: it opens the file
//!   read-only and the guest still writes its private copy;
//! * QEMU 7.2 has no `rom`, and `readonly=on` makes guest RAM a ROM. So it
//!   gets `share=off` alone and opens `/dev/fd/N` read-write: a new open
//!   of the template's file, which the kernel allows only to root (a
//!   template's file is the daemon's, mode 0444: docs/security.md, "Who
//!   may open a region's file"). So such a QEMU clones only where the
//!   launcher (whose credentials QEMU runs with) may write any file
//!   (`CAP_DAC_OVERRIDE`), and the launcher says so before it asks the
//!   daemon otherwise ([`needs_rom`]). QEMU maps it privately and never
//!   writes it, except where it discards a page of a file-backed block:
//!   7.2 punches a hole in the file then, so a balloon is refused
//!   (`identity.rs`).
//!
//! The daemon keeps the clone's huge pages promised until the launcher
//! closes its end of the CLONE socket: once QEMU answered its monitor it
//! has mapped the memory (with the kernel's reservation: `reserve` stays
//! on), and the launcher closes it once the guest runs.

use std::error::Error;
use std::ffi::OsString;
use std::os::unix::net::UnixStream;
use std::path::Path;

use ch_migration::peer::{receive_snapshot, Snapshot};
use ch_migration::Limits;
use hugemem_client::client::Client;
use hugemem_client::park::Exported;
use hugemem_client::proto::CloneMode;

use super::command_line::Sharing;
use super::restore::{launch_on, QemuReceiver};
use crate::launch::config::LaunchConfig;
use crate::launch::error::LaunchError;
use crate::launch::vmm::adapter::{CloneLaunch, CloneReceiver, VmmClone};

/// QEMU runs shared clones of parked QEMU VMs.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct QemuClone;

/// Whether this process (and so the QEMU it starts) may open any file for
/// writing, whatever its owner and mode: `CAP_DAC_OVERRIDE` in its
/// effective set (`CapEff` in `/proc/self/status`). Unreadable: no.
fn may_write_any_file() -> bool {
    const CAP_DAC_OVERRIDE: u32 = 1;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_DAC_OVERRIDE) != 0)
}

/// Why a QEMU without `rom` (before 8.2) cannot run a shared clone as this
/// launcher's user.
fn needs_rom(program: &OsString) -> String {
    let uid = nix::unistd::geteuid().as_raw();
    format!(
        "{} has no `rom` option for memory-backend-file (QEMU before 8.2), so a shared clone's \
         QEMU would open the template's memory read-write (/dev/fd/N), and a template's memory is \
         read-only to every user but root: uid {uid} cannot run it. Use QEMU 8.2 or later \
         (it opens the template read-only), launch as root, or use --clone-mode copy",
        Path::new(program).display()
    )
}

/// The template as CLONE sent it, and our end of the socket it came on
/// (the daemon's promise of the clone's pages lasts while it is open).
fn take_template(
    client: &mut Client,
    name: &str,
    mode: CloneMode,
) -> Result<(Exported, Snapshot, UnixStream), Box<dyn Error + Send + Sync>> {
    let (ours, theirs) = UnixStream::pair()?;
    let (template, snapshot) = std::thread::scope(|s| {
        let receiver = s.spawn(|| receive_snapshot(&ours, Limits::default()));
        let sent = client.clone_parked(name, mode, &theirs);
        // A refusal sends nothing: the receiver sees the end of the stream.
        drop(theirs);
        let received = receiver
            .join()
            .map_err(|_| "the thread receiving the template failed")?;
        let template = sent.map_err(|e| hugemem_client::diag::chain(&e))?;
        let snapshot =
            received.map_err(|e| format!("receiving the template from the daemon: {e}"))?;
        Ok::<_, Box<dyn Error + Send + Sync>>((template, snapshot))
    })?;
    Ok((template, snapshot, ours))
}

impl VmmClone for QemuClone {
    fn prepare(
        &self,
        cfg: &LaunchConfig,
        _private: &Path,
        client: &mut Client,
        (name, mode): (&str, CloneMode),
    ) -> Result<CloneLaunch, LaunchError> {
        let program = cfg
            .command
            .first()
            .cloned()
            .ok_or_else(|| LaunchError::Options("no VMM command given after --".into()))?;
        // A command line given is checked before the daemon is asked (the
        // balloon's check again below, once QEMU said whether it has
        // `rom`); the parked one, once it came.
        let given = super::identity::text(&cfg.command[1..]);
        super::identity::clone_identity(&given, true, false).map_err(LaunchError::Options)?;
        // Kept per binary (`backend_options`): asked once, beside CLONE.
        let asked = super::backend_options::ask(&program);
        // Where QEMU could not open the template without `rom`, its answer
        // is awaited before the daemon is asked; else both run at once.
        let (taken, sharing) = if may_write_any_file() {
            let taken = take_template(client, name, mode);
            let rom = asked.takes_rom();
            (taken, Sharing::Private { rom })
        } else {
            let rom = asked.takes_rom();
            if !rom {
                return Err(LaunchError::Options(needs_rom(&program)));
            }
            (take_template(client, name, mode), Sharing::Private { rom })
        };
        let (template, snapshot, promise) = taken.map_err(|source| LaunchError::Clone {
            name: name.to_owned(),
            source,
        })?;
        // Dropped on an error: the promise ends with it.
        let on = launch_on(cfg, snapshot, sharing)?;
        Ok(CloneLaunch {
            argv: on.argv,
            inherit: on.inherit,
            receiver: Box::new(QemuCloneReceiver {
                qemu: on.receiver,
                promise: Some(promise),
            }),
            bytes: template.bytes,
            page_size: template.page_size,
            replaced: on.replaced,
        })
    }
}

/// The clone's QEMU, fed the template's state once it runs.
struct QemuCloneReceiver {
    qemu: QemuReceiver,
    /// Our end of the CLONE socket, closed once the guest runs.
    promise: Option<UnixStream>,
}

impl CloneReceiver for QemuCloneReceiver {
    fn start(&mut self) -> Result<(), Box<dyn Error + Send + Sync>> {
        self.qemu.run_guest()?;
        // Mapped and reserved: the daemon's promise may end.
        drop(self.promise.take());
        Ok(())
    }

    fn stop(&self) {
        self.qemu.quit();
    }
}
