//! The micro-guest as a PVH ELF kernel, for QEMU, cloud-hypervisor and
//! Firecracker, and the small parser [`crate::run_pvh`] uses to boot it.
//!
//! # Boot
//!
//! The file is an ELF64 executable with one `PT_LOAD` segment (the guest
//! image, loaded at 1 MiB; its page tables and stack are the zero-filled
//! `p_memsz` tail) and one `PT_NOTE` segment holding the Xen note
//! `XEN_ELFNOTE_PHYS32_ENTRY` (type 18, name `"Xen"`, a 32-bit entry
//! address). A PVH loader enters that address in 32-bit protected mode with
//! paging off and `ebx` = guest-physical address of `hvm_start_info`.
//!
//! The guest then: signals its first instruction (port 0x3f0 ← 123, port
//! 0x80 ← 0x40), zeroes and builds identity page tables in its own image
//! (`[0, 4 GiB)` with 2 MiB pages on every CPU, `[4 GiB, 512 GiB)` with 1 GiB
//! pages when CPUID says the CPU has them), enters long mode, and takes the
//! RAM layout from the start info's memory map (version ≥ 1, type-1 entries).
//! Without a memory map it uses `[0, PvhConfig::ram_bytes)`. RAM is clipped
//! to `[PvhConfig::start_gpa, map limit)`; when clipping at the map limit
//! happened the report says `status=1`. Pages overlapping the guest's own
//! image are skipped. Then it walks the pages as under [`crate::run`].
//!
//! # Report and power-off
//!
//! * COM1 (port 0x3f8), one line: `HUGEMEM-GUEST pages=N nonzero=B status=S`.
//!   Written without polling the line-status register, which QEMU's and
//!   cloud-hypervisor's emulated 16550s do not need.
//! * Port 0x3f0 ← 124 and port 0x80 ← 0x41 when all pages are touched
//!   (cloud-hypervisor logs port 0x80 writes with timestamps at debug level).
//! * QEMU `isa-debug-exit` (default iobase 0x501): writes B, so QEMU exits with
//!   status `(B << 1) | 1`: **1 = all memory read as zero, 3 = saw non-zero**.
//!   Needs `-device isa-debug-exit` (microvm has no default one).
//! * cloud-hypervisor's ACPI shutdown port 0x600 ← 0x34 (S5 | SLP_EN).
//! * QEMU microvm's ACPI GED sleep-control register (MMIO 0xfea00200) ← 0x34,
//!   which powers off `-M microvm` (with its default `acpi=on`) without the
//!   isa-debug-exit device, i8042 or a PC-style PM block.
//! * Then `cli; hlt` forever, if none of the above stopped the VM.
//!
//! In spin mode ([`PvhConfig::spin`]) none of the power-off writes happen:
//! after the report line the guest re-reads its pages and counts forever
//! ([`crate::spin`]).
//!
//! Example (the `pvh_elf` example program writes the file):
//! `qemu-system-x86_64 -M microvm -cpu max -m 2G -nographic -nodefaults
//! -serial stdio -device isa-debug-exit -kernel guest.elf`. `-cpu max` gives
//! 1 GiB pages under TCG; with the default `qemu64` model RAM above 4 GiB is
//! not touched and the report says `status=1`.
//!
//! Under QEMU the first 8 bytes of GPA 0 hold the real-mode interrupt vector
//! table its firmware wrote, so `nonzero=1` unless `start_gpa` ≥ the stride
//! (1 MiB is enough for any stride ≥ 1 MiB).
//!
//! Checked with QEMU 7.2: microvm (TCG and KVM) and pc, isa-debug-exit exit
//! status 1, GED power-off exit status 0, 6 GiB split around the PCI hole
//! walked in full with `-cpu max` and clipped at 4 GiB with `-cpu qemu64`.
//! Booted under cloud-hypervisor v53.0-246-gae44c2971 (KVM): fd and
//! hugetlbfs zones, one or two memory zones and guest NUMA nodes, `--landlock`
//! (`cli/tests/launch_ch.rs`), and `--debug-console
//! file=/dev/stdout,iobase=0x3f0` (`hugemem bench compare`). Not yet booted
//! under Firecracker.

use crate::image;
use crate::layout::ConfigError;

/// What to bake into a PVH image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PvhConfig {
    /// RAM size used only when the loader passes no memory map
    /// (`hvm_start_info` version 0); then `[0, ram_bytes)` is walked.
    pub ram_bytes: u64,
    /// Distance between touched addresses, a power of two ≥ 8.
    pub stride: u64,
    /// Mixed into the value written to each page ([`crate::pattern`]).
    pub marker: u64,
    /// Guest-physical addresses below this are not touched.
    pub start_gpa: u64,
    /// Spin mode: after the report, keep re-reading the touched pages and
    /// counting instead of powering off ([`crate::spin`]).
    pub spin: bool,
    /// Spin mode: gaps between iterations of at least this many TSC ticks
    /// go into the guest's ring of recent gaps (0: every gap).
    pub gap_min_ticks: u64,
}

impl Default for PvhConfig {
    fn default() -> Self {
        PvhConfig {
            ram_bytes: 0,
            stride: 2 << 20,
            marker: 0x4855_4745_4d45_4d00,
            start_gpa: 0,
            spin: false,
            gap_min_ticks: 0,
        }
    }
}

/// ELF constants (System V gABI, x86-64 psABI, Xen `elfnote.h`).
const ET_EXEC: u16 = 2;
const EM_X86_64: u16 = 62;
const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
const PF_RWX: u32 = 7;
const PF_R: u32 = 4;
/// `XEN_ELFNOTE_PHYS32_ENTRY`.
pub const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

const EHDR_SIZE: usize = 64;
const PHDR_SIZE: usize = 56;
const NOTE_OFFSET: usize = EHDR_SIZE + 2 * PHDR_SIZE;
/// Note: namesz, descsz, type, "Xen\0", u32 entry.
const NOTE_SIZE: usize = 12 + 4 + 4;
/// Where the image starts in the file (16-byte aligned, like its address).
const LOAD_OFFSET: usize = 0x100;
const LOAD_ALIGN: u64 = 0x10;

const _: () = assert!(NOTE_OFFSET + NOTE_SIZE <= LOAD_OFFSET);
const _: () = assert!(
    image::LINK_BASE.is_multiple_of(LOAD_ALIGN) && (LOAD_OFFSET as u64).is_multiple_of(LOAD_ALIGN)
);

/// Builds the PVH ELF image of the micro-guest with `cfg` baked into its
/// parameter block.
///
/// # Errors
///
/// [`ConfigError::Stride`] when the stride is not a power of two ≥ 8.
pub fn pvh_elf(cfg: &PvhConfig) -> Result<Vec<u8>, ConfigError> {
    if cfg.stride < 8 || !cfg.stride.is_power_of_two() {
        return Err(ConfigError::Stride(cfg.stride));
    }
    let mut f = vec![0u8; LOAD_OFFSET + image::FILE_END];
    // ELF header.
    f[0..4].copy_from_slice(b"\x7fELF");
    f[4] = 2; // ELFCLASS64
    f[5] = 1; // ELFDATA2LSB
    f[6] = 1; // EV_CURRENT
    put16(&mut f, 16, ET_EXEC);
    put16(&mut f, 18, EM_X86_64);
    put32(&mut f, 20, 1); // e_version
    put64(&mut f, 24, image::LINK_BASE + image::PVH_ENTRY32 as u64); // e_entry
    put64(&mut f, 32, EHDR_SIZE as u64); // e_phoff
    put64(&mut f, 40, 0); // e_shoff: no sections
    put32(&mut f, 48, 0); // e_flags
    put16(&mut f, 52, EHDR_SIZE as u16);
    put16(&mut f, 54, PHDR_SIZE as u16);
    put16(&mut f, 56, 2); // e_phnum
    put16(&mut f, 58, 64); // e_shentsize
    put16(&mut f, 60, 0); // e_shnum
    put16(&mut f, 62, 0); // e_shstrndx
                          // PT_LOAD: the image at 1 MiB, page tables and stack as p_memsz tail.
    let ph = EHDR_SIZE;
    put32(&mut f, ph, PT_LOAD);
    put32(&mut f, ph + 4, PF_RWX);
    put64(&mut f, ph + 8, LOAD_OFFSET as u64);
    put64(&mut f, ph + 16, image::LINK_BASE); // p_vaddr
    put64(&mut f, ph + 24, image::LINK_BASE); // p_paddr
    put64(&mut f, ph + 32, image::FILE_END as u64);
    put64(&mut f, ph + 40, image::IMAGE_END as u64);
    put64(&mut f, ph + 48, LOAD_ALIGN);
    // PT_NOTE: the PVH entry note.
    let ph = EHDR_SIZE + PHDR_SIZE;
    put32(&mut f, ph, PT_NOTE);
    put32(&mut f, ph + 4, PF_R);
    put64(&mut f, ph + 8, NOTE_OFFSET as u64);
    put64(&mut f, ph + 32, NOTE_SIZE as u64);
    // Loaders align the name to p_align (QEMU, linux-loader): 4 keeps "Xen\0"
    // and the descriptor where the ELF note format puts them.
    put64(&mut f, ph + 48, 4);
    // The note.
    put32(&mut f, NOTE_OFFSET, 4); // namesz: "Xen\0"
    put32(&mut f, NOTE_OFFSET + 4, 4); // descsz: u32 entry
    put32(&mut f, NOTE_OFFSET + 8, XEN_ELFNOTE_PHYS32_ENTRY);
    f[NOTE_OFFSET + 12..NOTE_OFFSET + 16].copy_from_slice(b"Xen\0");
    let entry = u32::try_from(image::LINK_BASE + image::PVH_ENTRY32 as u64)
        .expect("the link address is below 4 GiB");
    put32(&mut f, NOTE_OFFSET + 16, entry);
    // The image and its baked parameters.
    let img = &mut f[LOAD_OFFSET..];
    img.copy_from_slice(&image::IMAGE);
    let p = image::PARAMS;
    put64(img, p + image::P_STRIDE, cfg.stride);
    put64(img, p + image::P_MARKER, cfg.marker);
    put64(img, p + image::P_MINGPA, cfg.start_gpa);
    put64(img, p + image::P_FALLBACK, cfg.ram_bytes);
    put64(img, p + image::P_SPIN, u64::from(cfg.spin));
    put64(img, p + image::P_GAPMIN, cfg.gap_min_ticks);
    Ok(f)
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A PVH kernel as a loader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PvhImage<'a> {
    /// Guest-physical address of the (single) loadable segment.
    pub load_addr: u64,
    /// Its file bytes.
    pub data: &'a [u8],
    /// Its size in memory (the rest is zero-filled).
    pub mem_size: u64,
    /// The 32-bit entry point from the Xen note.
    pub entry: u32,
}

/// Parses what a PVH loader needs from an ELF64 file: the one `PT_LOAD`
/// segment and the `XEN_ELFNOTE_PHYS32_ENTRY` note. Strict and bounds-checked;
/// the error says what is wrong.
pub(crate) fn parse(elf: &[u8]) -> Result<PvhImage<'_>, String> {
    let u16_at = |at: usize| -> Result<u16, String> {
        elf.get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .ok_or_else(|| format!("truncated at {at:#x}"))
    };
    let u32_at = |at: usize| -> Result<u32, String> {
        elf.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(|| format!("truncated at {at:#x}"))
    };
    let u64_at = |at: usize| -> Result<u64, String> {
        let lo = u32_at(at)?;
        let hi = u32_at(at + 4)?;
        Ok(u64::from(lo) | u64::from(hi) << 32)
    };
    let usize_at = |at: usize| -> Result<usize, String> {
        usize::try_from(u64_at(at)?).map_err(|_| format!("offset at {at:#x} too large"))
    };
    if elf.get(0..4) != Some(b"\x7fELF") {
        return Err("no ELF magic".into());
    }
    if elf.get(4..7) != Some(&[2, 1, 1]) {
        return Err("not a little-endian ELF64 version 1 file".into());
    }
    if u16_at(18)? != EM_X86_64 {
        return Err("not an x86-64 file".into());
    }
    let phoff = usize_at(32)?;
    let phentsize = usize::from(u16_at(54)?);
    let phnum = usize::from(u16_at(56)?);
    if phentsize != PHDR_SIZE {
        return Err(format!(
            "program header size {phentsize}, expected {PHDR_SIZE}"
        ));
    }
    let mut load = None;
    let mut entry = None;
    for i in 0..phnum {
        let ph = phoff + i * PHDR_SIZE;
        let offset = usize_at(ph + 8)?;
        let filesz = usize_at(ph + 32)?;
        let bytes = offset
            .checked_add(filesz)
            .and_then(|end| elf.get(offset..end))
            .ok_or_else(|| format!("segment {i} lies outside the file"))?;
        match u32_at(ph)? {
            PT_LOAD => {
                if load.is_some() {
                    return Err("more than one PT_LOAD segment".into());
                }
                let mem_size = u64_at(ph + 40)?;
                if mem_size < filesz as u64 {
                    return Err("PT_LOAD p_memsz < p_filesz".into());
                }
                load = Some((u64_at(ph + 24)?, bytes, mem_size));
            }
            PT_NOTE => {
                let align = usize_at(ph + 48)?.max(1);
                let mut pos = 0;
                while pos + 12 <= bytes.len() {
                    let word = |at: usize| {
                        let b = &bytes[at..at + 4];
                        u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
                    };
                    let (namesz, descsz, ty) = (word(pos), word(pos + 4), word(pos + 8));
                    let name_at = pos + 12;
                    let desc_at = name_at + namesz.next_multiple_of(align);
                    if desc_at + descsz > bytes.len() {
                        return Err("note runs past its segment".into());
                    }
                    let next = desc_at + descsz.next_multiple_of(align);
                    let name = bytes.get(name_at..name_at + namesz).unwrap_or_default();
                    if name == b"Xen\0" && ty == XEN_ELFNOTE_PHYS32_ENTRY as usize {
                        let desc = bytes
                            .get(desc_at..desc_at + 4)
                            .filter(|_| descsz >= 4)
                            .ok_or("PVH note descriptor shorter than 4 bytes")?;
                        entry = Some(u32::from_le_bytes([desc[0], desc[1], desc[2], desc[3]]));
                    }
                    pos = next;
                }
            }
            _ => {}
        }
    }
    let (load_addr, data, mem_size) = load.ok_or("no PT_LOAD segment")?;
    let entry = entry.ok_or("no XEN_ELFNOTE_PHYS32_ENTRY note")?;
    if !(load_addr..load_addr + mem_size).contains(&u64::from(entry)) {
        return Err(format!("entry {entry:#x} is outside the loaded segment"));
    }
    Ok(PvhImage {
        load_addr,
        data,
        mem_size,
        entry,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::get_u64;

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }
    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }

    #[test]
    fn elf_header_fields() {
        let f = pvh_elf(&PvhConfig::default()).expect("elf");
        assert_eq!(&f[..4], b"\x7fELF");
        assert_eq!(f[4], 2, "ELFCLASS64");
        assert_eq!(f[5], 1, "little endian");
        assert_eq!(u16_at(&f, 16), ET_EXEC);
        assert_eq!(u16_at(&f, 18), EM_X86_64);
        assert_eq!(get_u64(&f, 24), 0x10_0000, "e_entry");
        assert_eq!(get_u64(&f, 32), 64, "e_phoff");
        assert_eq!(u16_at(&f, 52), 64, "e_ehsize");
        assert_eq!(u16_at(&f, 54), 56, "e_phentsize");
        assert_eq!(u16_at(&f, 56), 2, "e_phnum");
        assert_eq!(f.len(), LOAD_OFFSET + image::FILE_END);
    }

    #[test]
    fn program_headers_and_note() {
        let f = pvh_elf(&PvhConfig::default()).expect("elf");
        // PT_LOAD
        assert_eq!(u32_at(&f, 64), PT_LOAD);
        assert_eq!(get_u64(&f, 64 + 8), 0x100, "p_offset");
        assert_eq!(get_u64(&f, 64 + 24), 0x10_0000, "p_paddr");
        assert_eq!(get_u64(&f, 64 + 32), image::FILE_END as u64, "p_filesz");
        assert_eq!(get_u64(&f, 64 + 40), 0x8000, "p_memsz");
        // PT_NOTE
        let ph = 64 + 56;
        assert_eq!(u32_at(&f, ph), PT_NOTE);
        let off = get_u64(&f, ph + 8) as usize;
        assert_eq!(get_u64(&f, ph + 32), 20);
        assert_eq!(u32_at(&f, off), 4, "namesz");
        assert_eq!(u32_at(&f, off + 4), 4, "descsz");
        assert_eq!(u32_at(&f, off + 8), 18, "XEN_ELFNOTE_PHYS32_ENTRY");
        assert_eq!(&f[off + 12..off + 16], b"Xen\0");
        assert_eq!(u32_at(&f, off + 16), 0x10_0000);
        // The entry's first instructions: mov $123,%al; mov $0x3f0,%dx; out.
        assert_eq!(
            &f[0x100..0x107],
            &[0xb0, 0x7b, 0x66, 0xba, 0xf0, 0x03, 0xee]
        );
    }

    #[test]
    fn parameters_are_baked_in() {
        let cfg = PvhConfig {
            ram_bytes: 3 << 30,
            stride: 1 << 30,
            marker: 0xfeed,
            start_gpa: 1 << 20,
            spin: true,
            gap_min_ticks: 99,
        };
        let f = pvh_elf(&cfg).expect("elf");
        let p = LOAD_OFFSET + image::PARAMS;
        assert_eq!(get_u64(&f, p + image::P_STRIDE), 1 << 30);
        assert_eq!(get_u64(&f, p + image::P_MARKER), 0xfeed);
        assert_eq!(get_u64(&f, p + image::P_MINGPA), 1 << 20);
        assert_eq!(get_u64(&f, p + image::P_FALLBACK), 3 << 30);
        assert_eq!(get_u64(&f, p + image::P_SPIN), 1);
        assert_eq!(get_u64(&f, p + image::P_GAPMIN), 99);
        // The host reads the spin block at its documented address.
        let block = LOAD_OFFSET + (crate::SPIN_BLOCK_GPA - image::LINK_BASE) as usize;
        assert_eq!(get_u64(&f, block), 1);
        assert_eq!(get_u64(&f, p + image::P_SKIPLO), 0x10_0000);
        assert_eq!(get_u64(&f, p + image::P_SKIPHI), 0x10_8000);
        assert_eq!(
            pvh_elf(&PvhConfig { stride: 3, ..cfg }),
            Err(ConfigError::Stride(3))
        );
    }

    #[test]
    fn parser_accepts_ours_and_rejects_damage() {
        let f = pvh_elf(&PvhConfig::default()).expect("elf");
        let img = parse(&f).expect("parse");
        assert_eq!(img.load_addr, 0x10_0000);
        assert_eq!(img.entry, 0x10_0000);
        assert_eq!(img.mem_size, 0x8000);
        assert_eq!(img.data.len(), image::FILE_END);
        let mut bad = f.clone();
        bad[0] = 0;
        assert!(parse(&bad).is_err());
        let mut bad = f.clone();
        bad[NOTE_OFFSET + 8] = 17; // note type
        assert_eq!(parse(&bad).unwrap_err(), "no XEN_ELFNOTE_PHYS32_ENTRY note");
        assert!(parse(&f[..100]).is_err());
    }

    /// `readelf` (when installed) agrees with the hand-written headers.
    #[test]
    fn readelf_agrees() {
        let f = pvh_elf(&PvhConfig::default()).expect("elf");
        let path = std::env::temp_dir().join(format!("microguest-{}.elf", std::process::id()));
        std::fs::write(&path, &f).expect("write");
        let out = std::process::Command::new("readelf")
            .arg("-lnW")
            .arg(&path)
            .output();
        let _ = std::fs::remove_file(&path);
        let Ok(out) = out else {
            test_support::skip!("readelf not installed");
            return;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("LOAD"), "{text}");
        assert!(text.contains("0x0000000000100000"), "{text}");
        assert!(text.contains("Xen"), "{text}");
        assert!(text.contains("0x00000004"), "{text}");
    }
}
