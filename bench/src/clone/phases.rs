//! The two phases of one template size, each on a private daemon of its
//! own sized for it, each with its own template (the same guest, launched
//! and parked the same way):
//!
//! * **shared**: a pool of the template alone; N shared clones one after
//!   another, then N at once (their written pages come from the kernel).
//! * **copy and the floor**: a pool of the template and N copies; N copy
//!   clones one after another, parked (each a VM of the template's, with
//!   memory of its own), restored from the park one after another, parked
//!   again and restored all at once (the floor: the same protocol with the
//!   memory handed over), stopped; then N copy clones at once.
//!
//! Between batches the daemon is let finish scrubbing what the last batch
//! freed, so that every batch meets a clean pool; then the pool and the
//! kernel must cover the batch (`cover.rs`), before the phase's template
//! too.

use std::fs::File;
use std::hash::Hasher;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use guest_mem::PageSize;

use super::cover::{ensure_covered, Takes};
use super::launch::{stop_all, Daemon, Source};
use super::observe::{ReadRam, Starting};
use super::report::{StartResult, TemplateCheck};
use super::starts::{measure, start, Batch, Before};
use crate::vmm_update::error::VmmUpdateError;

/// The template's name in each phase's daemon.
const TEMPLATE: &str = "template";

/// A digest of the first `size` bytes of `ram`, hex.
pub(crate) fn digest(ram: &File, size: u64) -> Result<String, VmmUpdateError> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0;
    while off < size {
        let n = (buf.len() as u64).min(size - off) as usize;
        ram.read_exact_at(&mut buf[..n], off)
            .map_err(|e| VmmUpdateError::Guest(format!("read the template at {off:#x}: {e}")))?;
        h.write(&buf[..n]);
        off += n as u64;
    }
    Ok(format!("{:016x}", h.finish()))
}

/// The count in the spin block of guest RAM `file`.
fn count_in(file: &File) -> Result<u64, VmmUpdateError> {
    let mut block = vec![0u8; microguest::SPIN_BLOCK_LEN];
    file.read_exact_at(&mut block, microguest::SPIN_BLOCK_GPA)
        .map_err(|e| VmmUpdateError::Guest(format!("read a spin block: {e}")))?;
    microguest::SpinState::parse(&block)
        .map(|s| s.count)
        .ok_or_else(|| VmmUpdateError::Guest("short spin block".into()))
}

/// A phase: its daemon and its parked template.
pub(crate) struct Phase {
    pub(crate) daemon: Daemon,
    template: File,
    size: u64,
    page: PageSize,
    digest_before: String,
    mode: &'static str,
}

impl Phase {
    /// Starts the daemon (pool `pool`, room for `vms` VMs), launches the template, lets it
    /// write its RAM and count, parks it.
    pub(crate) fn start(
        cfg: &super::plan::CloneConfig,
        dir: &Path,
        elf: &Path,
        (size, page, pool, vms): (u64, PageSize, u64, usize),
        mode: &'static str,
    ) -> Result<Self, VmmUpdateError> {
        let name = format!("{mode}-{page}-{size}");
        let mut daemon = Daemon::start(&cfg.launcher, cfg.vmm_program(), dir, (&name, pool, vms))?;
        let peak = size.saturating_mul(vms as u64 + 1);
        let what = format!(
            "the {mode} phase (a template and {vms} VMs of {})",
            guest_mem::size::format_size(size)
        );
        ensure_covered(&daemon, page, (&what, peak, Takes::PoolOrKernel))?;
        let vm = daemon.launch(Source::Fresh(elf), size, page)?;
        let ram = daemon.guest_ram(&vm)?;
        ram.counting_past(0)?;
        let template = ram
            .file()
            .try_clone()
            .map_err(|e| VmmUpdateError::Guest(format!("dup the template's fd: {e}")))?;
        drop(ram);
        daemon.park(vm, TEMPLATE)?;
        let digest_before = digest(&template, size)?;
        Ok(Self {
            daemon,
            template,
            size,
            page,
            digest_before,
            mode,
        })
    }

    /// Waits until the daemon has no clone counted and nothing to scrub:
    /// the event is a STATS answer saying so (the daemon pushes nothing, so
    /// it is asked again every few milliseconds). The last batch's
    /// launchers were reaped before (`stop_all`), each after its VMM.
    fn settle(&self) -> Result<(), VmmUpdateError> {
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut client = self.daemon.client()?;
        loop {
            let s = client.stats()?;
            let busy = s.pool_sum(|p| p.dirty_bytes + p.quarantined_bytes);
            let clones: u64 = s.parked.iter().map(|p| p.shared_clones).sum();
            if busy == 0 && clones == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(VmmUpdateError::Guest(format!(
                    "the daemon still has {busy} bytes to scrub and {clones} clone(s) after 300 s"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until the daemon fills no copy clone of the template any more
    /// (STATS `parked[].copy_clones_filling`): a postcopy copy clone runs
    /// long before its background fill ends, and until then a page its
    /// guest has not touched is not in its cloud-hypervisor's mapping yet
    /// (a remote read of it fails with EIO). STATS pushes nothing: it is
    /// asked again every few milliseconds, as in [`Phase::settle`].
    fn wait_copies_filled(&self) -> Result<(), VmmUpdateError> {
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut client = self.daemon.client()?;
        loop {
            let s = client.stats()?;
            let filling: u64 = s
                .parked
                .iter()
                .filter(|p| p.name == TEMPLATE)
                .map(|p| p.copy_clones_filling)
                .sum();
            if filling == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(VmmUpdateError::Guest(format!(
                    "{filling} copy clone(s) of the template still being filled after 300 s"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// N clones of the template in `mode` (`shared`, `copy`), one after
    /// another or at once, measured into `out`; returns them running.
    fn clones(
        &mut self,
        n: usize,
        at_once: bool,
        out: &mut StartResult,
    ) -> Result<Vec<Starting>, VmmUpdateError> {
        self.settle()?;
        let takes = match self.mode {
            "shared" => Takes::Kernel,
            _ => Takes::PoolOrKernel,
        };
        let what = format!(
            "{n} {} clone(s) of {}",
            self.mode,
            guest_mem::size::format_size(self.size)
        );
        let need = self.size.saturating_mul(n as u64);
        ensure_covered(&self.daemon, self.page, (&what, need, takes))?;
        let before = Before::now(&self.daemon, self.page)?;
        let from = count_in(&self.template)?;
        let batch = Batch {
            sources: vec![Source::CloneOf(TEMPLATE, self.mode); n],
            from_counts: vec![from; n],
            at_once,
            size: self.size,
            page: self.page,
        };
        let vms = start(&mut self.daemon, &batch, out)?;
        // A copy clone's memory is its own file: read once its fill ended
        // (every page holds the template's bytes or the guest's), through
        // that file. A shared clone's written pages are in its private
        // mapping only: read through it.
        let read = if self.mode == "copy" {
            self.wait_copies_filled()?;
            ReadRam::File
        } else {
            ReadRam::Mapping
        };
        measure(
            &self.daemon,
            self.page,
            before,
            &vms,
            Some((&self.template, read)),
            out,
        )?;
        Ok(vms)
    }

    /// One repetition of the shared phase with `n` clones.
    pub(crate) fn shared_rep(
        &mut self,
        n: usize,
        one: &mut StartResult,
        all: &mut StartResult,
    ) -> Result<(), VmmUpdateError> {
        let vms = self.clones(n, false, one)?;
        stop_all(vms.into_iter().map(|s| s.launcher).collect());
        let vms = self.clones(n, true, all)?;
        stop_all(vms.into_iter().map(|s| s.launcher).collect());
        Ok(())
    }

    /// One repetition of the copy phase with `n` clones: copies one after
    /// another, the floor one after another and at once on them, copies at
    /// once. `out`: copy one, copy all, floor one, floor all.
    pub(crate) fn copy_rep(
        &mut self,
        n: usize,
        out: [&mut StartResult; 4],
    ) -> Result<(), VmmUpdateError> {
        let [copy_one, copy_all, floor_one, floor_all] = out;
        let vms = self.clones(n, false, copy_one)?;
        // Each copy's memory, to read its count once parked.
        let mut files = Vec::new();
        let names: Vec<String> = (0..n).map(|i| format!("floor{i}")).collect();
        for (s, name) in vms.into_iter().zip(&names) {
            let file = s
                .ram
                .as_ref()
                .ok_or_else(|| VmmUpdateError::Guest("a copy clone without RAM".into()))?
                .memory_file()?;
            self.daemon.park(s.launcher, name)?;
            files.push(file);
        }
        let (size, page) = (self.size, self.page);
        let floor = |at_once: bool, files: &[File]| {
            files
                .iter()
                .map(count_in)
                .collect::<Result<Vec<u64>, _>>()
                .map(|from_counts| Batch {
                    sources: names.iter().map(|n| Source::Restore(n.as_str())).collect(),
                    from_counts,
                    at_once,
                    size,
                    page,
                })
        };
        let batch = floor(false, &files)?;
        let before = Before::now(&self.daemon, self.page)?;
        let vms = start(&mut self.daemon, &batch, floor_one)?;
        measure(&self.daemon, self.page, before, &vms, None, floor_one)?;
        for (s, name) in vms.into_iter().zip(&names) {
            self.daemon.park(s.launcher, name)?;
        }
        let batch = floor(true, &files)?;
        let before = Before::now(&self.daemon, self.page)?;
        let vms = start(&mut self.daemon, &batch, floor_all)?;
        measure(&self.daemon, self.page, before, &vms, None, floor_all)?;
        drop(files);
        stop_all(vms.into_iter().map(|s| s.launcher).collect());
        let vms = self.clones(n, true, copy_all)?;
        stop_all(vms.into_iter().map(|s| s.launcher).collect());
        Ok(())
    }

    /// Ends the phase: the template's digest again, the daemon stopped.
    pub(crate) fn finish(self) -> Result<TemplateCheck, VmmUpdateError> {
        self.settle()?;
        let after = digest(&self.template, self.size)?;
        let check = TemplateCheck {
            page_size: self.page.to_string(),
            size: self.size,
            phase: self.mode.to_string(),
            unchanged: after == self.digest_before,
            digest_before: self.digest_before,
            digest_after: after,
        };
        drop(self.template);
        self.daemon.stop();
        Ok(check)
    }
}
