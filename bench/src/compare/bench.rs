//! The run of every variant against one daemon.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::time::Instant;

use backend::client::Client;
use backend::daemon::{Daemon, DaemonHandle};
use backend::proto::{AllocRequest, RegionInfo};
use guest_mem::size::format_size;
use guest_mem::PageSize;
use tracing::warn;

use super::config::{CLEAN_DEADLINE, CLEAN_POLL, STRIDE};
use super::error::CompareError;
use super::results::{CompareReport, Figure, OverFloor, Ratio, VariantReport, VariantSamples};
use super::variant::{Memory, Runner, Variant, BASELINE};
use super::vmm::*;
use crate::floor::FloorMemory;
use crate::harness;
use crate::harness::rounds::Round;
use crate::stats::{paired_median, paired_median_ci95, ratio};
use crate::vmm_side::{self, PerVmm};

/// The groups of variants a round runs, in turn first (each group's
/// variants rotating inside it).
#[derive(Debug, Clone, Copy)]
pub(super) enum Group {
    /// The VMMs on memory of their own.
    Own,
    /// Through a daemon.
    Hugemem,
    /// On a resident memfd.
    Floor,
}

/// The benchmark's state during a run.
pub(super) struct Bench<'a> {
    pub(super) size: u64,
    pub(super) page: PageSize,
    pub(super) cpus: usize,
    pub(super) prealloc_threads: usize,
    pub(super) elf: PathBuf,
    pub(super) socket: PathBuf,
    /// Each VMM's program, where it runs.
    pub(super) programs: PerVmm<Option<OsString>>,
    /// Per variant: why it is skipped.
    pub(super) skipped: BTreeMap<Variant, String>,
    pub(super) samples: BTreeMap<Variant, Vec<Sample>>,
    pub(super) scrub: Vec<f64>,
    /// FREE until the pool's region is refaulted (resident), seconds.
    pub(super) resident: Vec<f64>,
    /// Pool variants do not wait for the refault (`--pool-holes`).
    pub(super) pool_holes: bool,
    /// The daemon's `pool.refault_ahead`.
    pub(super) refault_ahead: bool,
    pub(super) progress: &'a mut dyn FnMut(&str),
}

impl Bench<'_> {
    pub(super) fn enabled(&self, v: Variant) -> bool {
        !self.skipped.contains_key(&v)
    }

    pub(super) fn page_text(&self) -> String {
        self.page.to_string()
    }

    /// A VMM-owned-memory variant: spawn, wait, check.
    pub(super) fn run_own(&mut self, v: Variant) -> Result<Sample, CompareError> {
        let Runner::Vmm(vmm) = v.runner() else {
            return Err(CompareError::Failed {
                variant: v.key(),
                why: "the client runs on hugemem memory only".into(),
            });
        };
        let side = vmm_side::of(vmm);
        // Every own-memory variant prefaults but QEMU's lazy one.
        let prefault = (v != Variant::QemuLazy).then_some(self.prealloc_threads);
        let mut argv = vec![self.programs.get(vmm).clone().unwrap_or_default()];
        argv.extend(side.own_memory_args(&format_size(self.size), &self.page_text(), prefault));
        argv.extend(side.guest_args(&self.elf));
        let t0 = Instant::now();
        let run = run_vmm_timed(&argv, &[], t0)?;
        check_vmm(v, &run, None)
    }

    pub(super) fn start_daemon(&self) -> Result<DaemonHandle, CompareError> {
        // The pool must keep the freed VM, and look for other holders often.
        let mut config = harness::daemon::holding(self.socket.clone(), self.size, 10);
        config.pool.refault_ahead = self.refault_ahead;
        Ok(Daemon::start(config)?)
    }

    pub(super) fn request(&self) -> AllocRequest {
        harness::daemon::eager_request(self.size, self.page)
    }

    /// FREE `id` and wait until the pool shows it clean (the time goes into
    /// `pool_scrub_s`) and its punched pages refaulted: the pool variants
    /// get a resident hand-out (`pool_resident_s`).
    pub(super) fn free_and_scrub(
        &mut self,
        daemon: &DaemonHandle,
        client: &mut Client,
        id: u64,
    ) -> Result<(), CompareError> {
        let before = daemon.stats();
        let t = Instant::now();
        client.free(id)?;
        self.wait_clean(daemon)?;
        self.scrub.push(t.elapsed().as_secs_f64());
        if !self.pool_holes {
            self.wait_resident(daemon, &before)?;
            self.resident.push(t.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// Waits until every page detached since `before` is faulted back in.
    fn wait_resident(
        &self,
        daemon: &DaemonHandle,
        before: &hugemem_client::stats::Stats,
    ) -> Result<(), CompareError> {
        let detached = daemon
            .stats()
            .counters
            .pages_detached
            .saturating_sub(before.counters.pages_detached)
            .saturating_mul(self.page.bytes());
        harness::pool::wait_refaulted(daemon, before, detached)
            .map(drop)
            .ok_or(CompareError::CleanTimeout(CLEAN_DEADLINE))
    }

    /// Waits until the pool holds the whole size clean and nothing dirty.
    pub(super) fn wait_clean(&self, daemon: &DaemonHandle) -> Result<(), CompareError> {
        harness::pool::wait_clean(daemon, self.size, CLEAN_DEADLINE, CLEAN_POLL)
            .map(drop)
            .map_err(|_| CompareError::CleanTimeout(CLEAN_DEADLINE))
    }

    /// Fills the pool without timing anything (ALLOC, FREE, scrub).
    pub(super) fn fill_pool(&mut self, daemon: &DaemonHandle) -> Result<(), CompareError> {
        let mut client = Client::connect(daemon.socket_path())?;
        let a = client.alloc(self.request())?;
        let id = a.id;
        drop(a);
        let before = daemon.stats();
        client.free(id)?;
        self.wait_clean(daemon)?;
        if self.pool_holes {
            return Ok(());
        }
        self.wait_resident(daemon, &before)
    }

    /// A hugemem variant on `daemon`: ALLOC, run, FREE; `scrub` waits for the
    /// pool to show the region clean afterwards.
    pub(super) fn run_hugemem(
        &mut self,
        daemon: &DaemonHandle,
        v: Variant,
        scrub: bool,
    ) -> Result<Sample, CompareError> {
        let t0 = Instant::now();
        let mut client = Client::connect(daemon.socket_path())?;
        let alloc = client.alloc(self.request())?;
        let alloc_s = t0.elapsed().as_secs_f64();
        let fds: Vec<BorrowedFd<'_>> = alloc.fds.iter().map(AsFd::as_fd).collect();
        let sample = self.run_on_fds(v, &alloc.regions, &fds, t0, Some(alloc_s));
        drop(fds);
        let id = alloc.id;
        // Our fds go before FREE, so the daemon sees no other holder.
        drop(alloc);
        let sample = sample?;
        if scrub {
            self.free_and_scrub(daemon, &mut client, id)?;
        } else {
            client.free(id)?;
        }
        Ok(sample)
    }

    /// `v`'s VMM (or the client) on memory already in `fds`, timed from `t0`.
    fn run_on_fds(
        &self,
        v: Variant,
        regions: &[RegionInfo],
        fds: &[BorrowedFd<'_>],
        t0: Instant,
        alloc_s: Option<f64>,
    ) -> Result<Sample, CompareError> {
        let vmm = match v.runner() {
            Runner::Client => return run_client(v, regions, fds, t0, alloc_s),
            Runner::Vmm(vmm) => vmm,
        };
        let program = self.programs.get(vmm).clone().unwrap_or_default();
        let side = vmm_side::of(vmm);
        let mut user = side.machine_args();
        user.extend(side.guest_args(&self.elf));
        let argv = crate::floor::vmm_argv(vmm, program, &user, regions, fds)?;
        run_vmm_timed(&argv, fds, t0).and_then(|run| check_vmm(v, &run, alloc_s))
    }

    /// A floor variant: a hugetlb memfd of the run's size and page size,
    /// populated (resident, zeroed by the kernel) before the clock starts,
    /// handed to the VMM exactly as a hugemem ALLOC's fds are, no daemon.
    pub(super) fn run_floor(&self, v: Variant) -> Result<Sample, CompareError> {
        let (memory, _) = FloorMemory::populated(self.size, self.page)?;
        let t0 = Instant::now();
        self.run_on_fds(v, &[memory.region()], &[memory.fd()], t0, None)
    }

    /// One group of variants in `round`.
    pub(super) fn group(&mut self, group: Group, round: Round) -> Result<(), CompareError> {
        match group {
            Group::Own => self.own_group(round),
            Group::Hugemem => self.hugemem_group(round),
            Group::Floor => self.floor_group(round),
        }
    }

    /// The variants on `kind` of memory, in `round`'s order (each first in
    /// turn).
    fn variants(round: Round, kind: Memory) -> Vec<Variant> {
        round.rotate(
            Variant::ALL
                .into_iter()
                .filter(|v| v.memory() == kind)
                .collect(),
        )
    }

    /// The floor variants, in `round`'s order.
    fn floor_group(&mut self, round: Round) -> Result<(), CompareError> {
        for v in Self::variants(round, Memory::Floor) {
            if self.enabled(v) {
                let s = self.run_floor(v)?;
                self.record(v, s);
            }
        }
        Ok(())
    }

    pub(super) fn record(&mut self, v: Variant, s: Sample) {
        (self.progress)(&format!(
            "  {:<20} ready {:.4} s, first instruction {:.4} s, power-off {:.4} s{}",
            v.key(),
            s.ready,
            s.first_instruction,
            s.poweroff,
            s.alloc
                .map(|a| format!(" (ALLOC {a:.4} s)"))
                .unwrap_or_default()
        ));
        self.samples.entry(v).or_default().push(s);
    }

    /// QEMU prealloc, QEMU lazy and cloud-hypervisor prefault, in `round`'s order.
    fn own_group(&mut self, round: Round) -> Result<(), CompareError> {
        for v in Self::variants(round, Memory::Own) {
            if self.enabled(v) {
                let s = self.run_own(v)?;
                self.record(v, s);
            }
        }
        Ok(())
    }

    /// The hugemem variants: one fresh, the pool ones, then the other fresh
    /// one on a second daemon (each fresh variant needs an empty pool).
    fn hugemem_group(&mut self, round: Round) -> Result<(), CompareError> {
        let of = |kind: Memory| -> Vec<Variant> {
            let mut list = Self::variants(round, kind);
            list.retain(|v| self.enabled(*v));
            list
        };
        let (fresh, pool) = (of(Memory::Fresh), of(Memory::Pool));
        if fresh.is_empty() && pool.is_empty() {
            return Ok(());
        }
        let daemon = self.start_daemon()?;
        let result: Result<(), CompareError> = (|| {
            let mut filled = false;
            if let Some(&v) = fresh.first() {
                let s = self.run_hugemem(&daemon, v, !pool.is_empty())?;
                self.record(v, s);
                filled = true;
            }
            if !pool.is_empty() && !filled {
                self.fill_pool(&daemon)?;
            }
            for &v in &pool {
                let s = self.run_hugemem(&daemon, v, true)?;
                self.record(v, s);
            }
            Ok(())
        })();
        if let Err(e) = daemon.shutdown() {
            warn!(error = %e, "daemon shutdown failed");
        }
        result?;
        if let Some(&v) = fresh.get(1) {
            let daemon = self.start_daemon()?;
            let result = self.run_hugemem(&daemon, v, false);
            if let Err(e) = daemon.shutdown() {
                warn!(error = %e, "daemon shutdown failed");
            }
            let s = result?;
            self.record(v, s);
        }
        Ok(())
    }
}

impl Bench<'_> {
    pub(super) fn report(
        self,
        reps: usize,
        note: Option<String>,
        qemu_version: Option<String>,
        cloud_hypervisor_version: Option<String>,
    ) -> CompareReport {
        let gib = self.size as f64 / f64::from(1u32 << 30);
        let mut variants = Vec::new();
        for v in Variant::ALL {
            let list = self.samples.get(&v).map(Vec::as_slice).unwrap_or_default();
            let s = VariantSamples {
                ready_s: list.iter().map(|s| s.ready).collect(),
                first_instruction_s: list.iter().map(|s| s.first_instruction).collect(),
                touched_s: list.iter().filter_map(|s| s.touched).collect(),
                poweroff_s: list.iter().map(|s| s.poweroff).collect(),
                alloc_s: list.iter().filter_map(|s| s.alloc).collect(),
            };
            let ready = Figure::of(&s.ready_s);
            let note = self.skipped.get(&v).cloned().or_else(|| match v {
                Variant::QemuLazy => Some(
                    "ready = the guest's all-pages-touched mark: its own touches populate the RAM"
                        .into(),
                ),
                Variant::QemuHugememPool | Variant::ChHugememPool | Variant::ClientPool => {
                    Some(if self.pool_holes {
                        "a hand-out with holes: pages a previous guest used, punched after FREE and taken the moment the pool showed them clean, the refault still running (pool_scrub_s)"
                    } else {
                        "a resident hand-out: pages a previous guest used, punched and refaulted (zeroed by the kernel) in the background after FREE (pool_scrub_s to clean, pool_resident_s to resident)"
                    }
                    .into())
                }
                Variant::QemuFloor | Variant::ChFloor | Variant::ClientFloor => Some(
                    "the VMM's floor: the same VMM and guest on a hugetlb memfd populated before the clock starts, no daemon"
                        .into(),
                ),
                _ => None,
            });
            variants.push(VariantReport {
                key: v.key(),
                label: v.label(),
                skipped: self.skipped.contains_key(&v),
                note,
                gib_per_s: ready.map(|r| if r.best > 0.0 { gib / r.best } else { 0.0 }),
                ready_s: ready,
                first_instruction_s: Figure::of(&s.first_instruction_s),
                touched_s: Figure::of(&s.touched_s),
                poweroff_s: Figure::of(&s.poweroff_s),
                alloc_s: Figure::of(&s.alloc_s),
                guest_report: list.last().and_then(|s| s.guest.clone()),
                samples: s,
            });
        }
        // The PVH guest reports status=1 when it could not map all RAM.
        let clipped = variants.iter().any(|r| {
            r.guest_report
                .as_deref()
                .is_some_and(|g| g.contains("status=1"))
        });
        let note = if clipped {
            let clip = "microvm puts guest RAM beyond 3G above 4G, and without 1G pages in the \
                        vCPU model (kvm_pvm) the PVH guest maps only [0, 4G): under the VMMs it \
                        touched 3G of it (status=1 in guest_report); times of memory populated \
                        before boot are unaffected, qemu_lazy faults in only what the guest touched";
            Some(note.map_or_else(|| clip.to_string(), |n| format!("{n}; {clip}")))
        } else {
            note
        };
        let baseline = variants
            .iter()
            .find(|r| r.key == BASELINE.key())
            .and_then(|r| Some((r.ready_s?, r.poweroff_s?)));
        let mut ratios = BTreeMap::new();
        if let Some((base_ready, base_off)) = baseline {
            for r in &variants {
                if let (Some(ready), Some(off)) = (r.ready_s, r.poweroff_s) {
                    ratios.insert(
                        r.key,
                        Ratio {
                            ready: ratio(base_ready.best, ready.best),
                            poweroff: ratio(base_off.best, off.best),
                        },
                    );
                }
            }
        }
        let over_floor = over_floor(&variants);
        CompareReport {
            over_floor,
            size_bytes: self.size,
            page_size: self.page.to_string(),
            note,
            reps,
            cpus: self.cpus,
            prealloc_threads: self.prealloc_threads,
            stride_bytes: STRIDE,
            qemu_version,
            cloud_hypervisor_version,
            baseline: BASELINE.key(),
            variants,
            ratios,
            pool_scrub_s: Figure::of(&self.scrub),
            pool_resident_s: Figure::of(&self.resident),
            pool_hand_out: if self.pool_holes { "holes" } else { "resident" },
            refault_ahead: self.refault_ahead,
        }
    }
}

/// Every measured variant against its VMM's floor, where both were measured.
fn over_floor(variants: &[VariantReport]) -> BTreeMap<&'static str, OverFloor> {
    let figures = |key: &str| {
        variants
            .iter()
            .find(|r| r.key == key)
            .and_then(|r| Some((r.ready_s?, r.poweroff_s?)))
    };
    let touched = |key: &str| {
        variants
            .iter()
            .find(|r| r.key == key)
            .and_then(|r| r.touched_s)
    };
    let samples = |key: &str| variants.iter().find(|r| r.key == key).map(|r| &r.samples);
    Variant::ALL
        .into_iter()
        .filter_map(|v| {
            let floor = v.floor().key();
            let ((ready, off), (floor_ready, floor_off)) = (figures(v.key())?, figures(floor)?);
            let (mine, floors) = (samples(v.key())?, samples(floor)?);
            Some((
                v.key(),
                OverFloor {
                    floor,
                    ready_ms: (ready.best - floor_ready.best) * 1e3,
                    poweroff_ms: (off.best - floor_off.best) * 1e3,
                    ready_median_ms: (ready.median - floor_ready.median) * 1e3,
                    poweroff_median_ms: (off.median - floor_off.median) * 1e3,
                    touched_ms: touched(v.key())
                        .zip(touched(floor))
                        .map(|(t, f)| (t.best - f.best) * 1e3),
                    touched_median_ms: touched(v.key())
                        .zip(touched(floor))
                        .map(|(t, f)| (t.median - f.median) * 1e3),
                    ready_paired_median_ms: paired_median(&mine.ready_s, &floors.ready_s)
                        .map(|d| d * 1e3),
                    touched_paired_median_ms: paired_median(&mine.touched_s, &floors.touched_s)
                        .map(|d| d * 1e3),
                    ready_paired_ci95_ms: paired_median_ci95(&mine.ready_s, &floors.ready_s)
                        .map(|ci| ci.map(|d| d * 1e3)),
                    touched_paired_ci95_ms: paired_median_ci95(&mine.touched_s, &floors.touched_s)
                        .map(|ci| ci.map(|d| d * 1e3)),
                },
            ))
        })
        .collect()
}
