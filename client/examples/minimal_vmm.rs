//! A minimal rust-vmm VMM whose guest RAM comes from a hugemem daemon: the
//! reference for `docs/integrating.md`. It connects, ALLOCs, maps the
//! regions as a `vm-memory` guest memory, loads hugemem's micro-guest (a PVH
//! ELF kernel) with `linux-loader`, runs it on one KVM vCPU, checks its
//! report (it reads the first 8 bytes of every huge page and must see only
//! zeros), and FREEs. It uses only the client side of hugemem (`client`,
//! `lazy`, `proto`, `guest_memory::guest_layout`); no daemon code. Left out:
//! more vCPUs, devices, interrupts, and a watchdog that kicks a stuck vCPU
//! out of `KVM_RUN` with a signal (`microguest::runner` has one).
//!
//! `cargo run -p hugemem-client --example minimal_vmm -- [--socket PATH]
//! [--mode eager|lazy] [--size-mib N]`; exit status 0 only when the guest ran
//! on clean memory. `backend/tests/minimal_vmm.rs` runs [`run_vmm`] itself.

use std::fs::File;
use std::io::Cursor;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use hugemem_client::client::{Allocation, Client};
use hugemem_client::guest_memory::guest_layout;
use hugemem_client::lazy::{GuestMapping, LazyGuest, LazyOptions};
use hugemem_client::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo, FEATURE_LAZY};
use kvm_bindings::{kvm_regs, kvm_segment, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit};
use linux_loader::configurator::{pvh::PvhBootConfigurator, BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use linux_loader::loader::{elf::Elf, elf::PvhBootCapability, KernelLoader};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vm_memory::{GuestMemoryRegion, GuestRegionMmap};

/// The daemon's default socket (`socket` in its configuration).
pub const DEFAULT_SOCKET: &str = "/run/hugemem/hugemem.sock";
/// What the guest mixes into the value it writes to each page.
const MARKER: u64 = 0x6d69_6e69_6d61_6c00;
/// Where the PVH `hvm_start_info` and its memory map go: not at the start of
/// a page, whose first 8 bytes the guest reads (and must find zero).
const START_INFO: u64 = 0x6040;
const MEMMAP: u64 = 0x6100;

/// What a run did.
#[derive(Debug)]
pub struct Report {
    /// Regions the daemon gave, and how many of them were LAZY.
    pub regions: usize,
    pub lazy_regions: usize,
    /// Smallest page size of the regions (the guest's stride).
    pub page_size: u64,
    /// The guest's line on COM1, e.g. `HUGEMEM-GUEST pages=32 nonzero=0 status=0`.
    pub serial: String,
    /// Faults this VMM served itself (its fallback, when the daemon was gone).
    pub fallback_faults: u64,
}

/// Connects, ALLOCs `size` bytes, boots the micro-guest, checks it, FREEs.
pub fn run_vmm(socket: &Path, size: u64, clear_mode: ClearMode) -> Result<Report> {
    run_vmm_with(socket, size, clear_mode, || {})
}

/// [`run_vmm`], calling `before_boot` once guest RAM is mapped (and, lazy,
/// handed to the daemon) and right before the vCPU starts: a test upgrades
/// the daemon there (`hugemem serve --takeover`), so that the guest's
/// faults reach the new daemon.
pub fn run_vmm_with(
    socket: &Path,
    size: u64,
    clear_mode: ClearMode,
    before_boot: impl FnOnce(),
) -> Result<Report> {
    let mut client = Client::connect(socket)?; // and HANDSHAKE
    client.set_timeout(Some(Duration::from_secs(30)))?; // longer than the ALLOC wait
    client.set_alloc_wait(Some(Duration::from_secs(5)));
    if clear_mode == ClearMode::Lazy && client.features() & FEATURE_LAZY == 0 {
        bail!("the daemon does not offer lazy mode");
    }
    let alloc = client
        .alloc(AllocRequest {
            total_size: size,
            page_policy: PagePolicy::Best, // 1G, else 2M, else 4K pages
            clear_mode,
            lock: false,       // or LOCK later
            parts: vec![],     // one region on any node; or one part per guest node
            want_paths: false, // memfds; true: hugetlbfs files with paths
        })
        .context("ALLOC")?;
    if !alloc.note.is_empty() {
        eprintln!("daemon: {}", alloc.note); // e.g. served on smaller pages
    }
    let is_lazy = |r: &RegionInfo| r.flags & RegionInfo::FLAG_LAZY != 0;
    let lazy_regions = alloc.regions.iter().filter(|r| is_lazy(r)).count();
    // A LAZY region may still hold the previous tenant's bytes: nothing may
    // touch it (not even the kernel loader) before the daemon has the uffd.
    let (mem, lazy_guard) = if lazy_regions == 0 {
        (alloc.guest_memory()?, None)
    } else {
        let (mem, mappings) = map_regions(&alloc, is_lazy)?;
        let guard = LazyGuest::attach(&mut client, &alloc, &mappings, LazyOptions::default())
            .context("lazy hand-off (UFFD): the memory is not clean, the guest must not run")?;
        (mem, Some(guard))
    };
    let page_size = alloc.regions.iter().map(|r| r.page_size).min();
    let page_size = page_size.context("no regions")?;
    before_boot();
    let serial = boot_and_check(&mem, page_size)?;
    let fallback_faults = lazy_guard.as_ref().map_or(0, |g| g.stats().faults);
    // The vCPU has stopped: unmap, drop the uffd copy, close the fds, FREE.
    // The daemon reuses a region only once nothing of ours maps or holds it.
    drop(mem);
    drop(lazy_guard);
    let (id, regions) = (alloc.id, alloc.regions.len());
    drop(alloc);
    client.free(id).context("FREE")?;
    Ok(Report {
        regions,
        lazy_regions,
        page_size,
        serial,
        fallback_faults,
    })
}

/// Maps every region `MAP_SHARED` read-write at its guest address, split
/// around the MMIO hole, as `Allocation::guest_memory` does (which refuses
/// LAZY regions), and lists the mappings of the regions `register` picks.
pub fn map_regions(
    alloc: &Allocation,
    register: impl Fn(&RegionInfo) -> bool,
) -> Result<(GuestMemoryMmap, Vec<GuestMapping>)> {
    let (mut regions, mut mappings) = (Vec::new(), Vec::new());
    for (info, fd) in alloc.regions.iter().zip(&alloc.fds) {
        let file = File::from(fd.try_clone()?);
        // Never map past the end: an access there would be a SIGBUS.
        ensure!(
            file.metadata()?.len() >= info.size,
            "region {} is short",
            info.region_id
        );
        for (region_offset, len, gpa) in guest_layout(info.guest_phys, info.size) {
            let map = MmapRegionBuilder::new(usize::try_from(len)?)
                .with_file_offset(FileOffset::new(file.try_clone()?, region_offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_SHARED) // never MAP_NORESERVE, never private
                .with_hugetlbfs(info.page_size > 4096)
                .build()?;
            let addr = map.as_ptr() as u64;
            if register(info) {
                mappings.push(GuestMapping {
                    region_id: info.region_id,
                    region_offset,
                    addr,
                    len,
                });
            }
            let region = GuestRegionMmap::new(map, GuestAddress(gpa));
            regions.push(region.context("guest address overflow")?);
        }
    }
    Ok((GuestMemoryMmap::from_regions(regions)?, mappings))
}

/// Loads the micro-guest as a PVH kernel, runs it on one vCPU, and checks
/// its report against `mem`: its COM1 line and the value it wrote to each page.
pub fn boot_and_check(mem: &GuestMemoryMmap, stride: u64) -> Result<String> {
    let cfg = microguest::PvhConfig {
        stride, // one read per huge page
        marker: MARKER,
        ..Default::default()
    };
    let (entry, image) = load_pvh(mem, &microguest::pvh_elf(&cfg)?)?;
    let (nonzero, serial) = run_vcpu(mem, entry)?;
    // Every stride-aligned address of RAM, but those in the guest's own image.
    let pages: Vec<u64> = mem
        .iter()
        .flat_map(|r| {
            microguest::stride_pages(r.start_addr().0, r.start_addr().0 + r.len(), stride)
        })
        .filter(|a| !image.contains(a))
        .collect();
    let clean = format!("HUGEMEM-GUEST pages={} nonzero=0 status=0", pages.len());
    ensure!(
        nonzero == 0 && serial == clean,
        "the guest reported {serial:?}, not {clean:?}"
    );
    for &gpa in &pages {
        let seen: u64 = mem.read_obj(GuestAddress(gpa))?;
        ensure!(
            seen == microguest::pattern(MARKER, gpa),
            "no guest write at {gpa:#x}"
        );
    }
    Ok(serial)
}

/// `linux-loader` as cloud-hypervisor and Firecracker use it: the ELF's
/// segments into guest RAM, `hvm_start_info` with an E820 map of all RAM.
/// Returns the PVH entry point and the range the image occupies.
fn load_pvh(mem: &GuestMemoryMmap, elf: &[u8]) -> Result<(GuestAddress, Range<u64>)> {
    let kernel = Elf::load(mem, None, &mut Cursor::new(elf), None)?;
    let PvhBootCapability::PvhEntryPresent(entry) = kernel.pvh_boot_cap else {
        bail!("the kernel has no PVH entry point");
    };
    let memmap: Vec<_> = mem
        .iter()
        .map(|r| hvm_memmap_table_entry {
            addr: r.start_addr().0,
            size: r.len(),
            type_: 1, // E820 RAM
            reserved: 0,
        })
        .collect();
    let info = hvm_start_info {
        magic: 0x336e_c578, // XEN_HVM_START_MAGIC_VALUE
        version: 1,
        memmap_paddr: MEMMAP,
        memmap_entries: u32::try_from(memmap.len())?,
        ..Default::default()
    };
    let mut params = BootParams::new(&info, GuestAddress(START_INFO));
    params.set_sections(&memmap, GuestAddress(MEMMAP));
    PvhBootConfigurator::write_bootparams(&params, mem)?;
    Ok((entry, kernel.kernel_load.0..kernel.kernel_end))
}

/// One VM with every region of `mem` as a memory slot, one vCPU entered at
/// `entry` the PVH way, run until the guest writes the exit port. Returns
/// that value (0: it read only zeros) and its COM1 output.
fn run_vcpu(mem: &GuestMemoryMmap, entry: GuestAddress) -> Result<(u8, String)> {
    let kvm = Kvm::new().context("/dev/kvm")?;
    let vm = kvm.create_vm()?;
    for (slot, r) in mem.iter().enumerate() {
        let region = kvm_userspace_memory_region {
            slot: u32::try_from(slot)?,
            flags: 0,
            guest_phys_addr: r.start_addr().0,
            memory_size: r.len(),
            userspace_addr: r.as_ptr() as u64,
        };
        // SAFETY: the mapping belongs to `mem`, which outlives `vm` (dropped
        // at the end of this function); vm-memory's regions do not overlap.
        unsafe { vm.set_user_memory_region(region) }?;
    }
    let mut vcpu = vm.create_vcpu(0)?;
    vcpu.set_cpuid2(&kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?)?;
    // PVH: 32-bit protected mode, flat segments, paging off, ebx = start info.
    let mut sregs = vcpu.get_sregs()?;
    let code = kvm_segment {
        limit: 0xffff_ffff,
        selector: 0x08,
        type_: 0xb, // execute/read, accessed
        present: 1,
        db: 1,
        s: 1,
        g: 1,
        ..Default::default()
    };
    let data = kvm_segment {
        selector: 0x10,
        type_: 0x3, // read/write, accessed
        ..code
    };
    (sregs.cs, sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) =
        (code, data, data, data, data, data);
    (sregs.cr0, sregs.cr4, sregs.efer) = (0x31, 0, 0); // PE | ET | NE
    vcpu.set_sregs(&sregs)?;
    let regs = kvm_regs {
        rip: entry.0,
        rbx: START_INFO,
        rflags: 2,
        ..Default::default()
    };
    vcpu.set_regs(&regs)?;
    let mut serial = Vec::new();
    let nonzero = loop {
        match vcpu.run()? {
            VcpuExit::IoOut(0x3f8, bytes) => serial.extend_from_slice(bytes), // COM1
            VcpuExit::IoOut(0x501, &[value]) => break value, // QEMU's isa-debug-exit port
            VcpuExit::IoOut(..) => {}                        // progress: ports 0x3f0, 0x3f4, 0x80
            exit => bail!("unexpected vCPU exit {exit:?}"),
        }
    };
    Ok((
        nonzero,
        String::from_utf8_lossy(&serial).trim_end().to_owned(),
    ))
}

fn main() -> Result<()> {
    let (mut socket, mut mode, mut mib) = (PathBuf::from(DEFAULT_SOCKET), ClearMode::Eager, 64u64);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args
            .next()
            .with_context(|| format!("{arg} needs a value"))?;
        match (arg.as_str(), value.as_str()) {
            ("--socket", v) => socket = v.into(),
            ("--mode", "eager") => mode = ClearMode::Eager,
            ("--mode", "lazy") => mode = ClearMode::Lazy,
            ("--size-mib", v) => mib = v.parse().with_context(|| format!("--size-mib {v}"))?,
            _ => bail!("usage: minimal_vmm [--socket PATH] [--mode eager|lazy] [--size-mib N]"),
        }
    }
    let size = mib
        .checked_mul(1 << 20)
        .context("--size-mib is too large")?;
    let report = run_vmm(&socket, size, mode)?;
    println!("{report:?}");
    Ok(())
}
