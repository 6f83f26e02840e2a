//! hugemem's own micro-guest, and a KVM runner for it.
//!
//! The guest is a few hundred bytes of x86-64 machine code that hugemem uses
//! to see guest RAM *from inside a guest*. It answers two questions that a
//! host-side check cannot:
//!
//! * **How long until the guest runs?** Its very first instruction writes
//!   123 to port 0x3f0, so the host timestamps the moment the vCPU reached
//!   guest code ([`RunReport::first_instruction`]). Port 0x3f0 with value 123
//!   is the guest-boot-complete signal of Firecracker's boot timer (x86, as in
//!   the Firecracker sources checked), and the guest mirrors it on port 0x80,
//!   which cloud-hypervisor logs with a timestamp, so the same number can be
//!   taken under those VMMs.
//! * **What did the guest see, and did its writes land?** For every
//!   stride-sized page of RAM (say every 2 MiB or 1 GiB) the guest reads the
//!   first 8 bytes, ORs them into an accumulator, and writes
//!   `marker ^ gpa` there ([`pattern`]). Afterwards the host checks every
//!   page through its own mapping ([`RunReport::saw_nonzero`] says whether the
//!   guest ever read anything but zero, which is how hugemem proves that
//!   memory handed to a guest was clean).
//!
//! # How the guest runs
//!
//! [`run`] registers the caller's RAM slots with KVM, adds one small
//! *control slot* of its own (the guest image, its parameter block, stack and
//! identity-mapping page tables; see [`DEFAULT_CONTROL_GPA`]), and starts one
//! vCPU directly in 64-bit long mode: CR0.PG, CR4.PAE, EFER.LME/LMA, a flat
//! 64-bit code segment, and page tables built by the host that identity-map
//! guest-physical memory with 1 GiB pages (2 MiB pages when the CPU model
//! lacks them, as `kvm_pvm`'s does). Long mode is what lets the guest touch
//! RAM above 4 GiB, which every hugemem VM has; 32-bit code could reach only
//! the first 3 GiB. Verified under the software `kvm_pvm` module; the register
//! setup is the standard one for starting a KVM vCPU in long mode.
//!
//! The guest reports through port I/O: progress on 0x3f0 (123 = first
//! instruction, 124 = all pages touched), the page count and the OR
//! accumulator as four 32-bit outs on 0x3f4, one line of text on COM1
//! (`HUGEMEM-GUEST pages=N nonzero=B status=S`), then it writes the
//! "nonzero" flag to QEMU's isa-debug-exit port 0x501, where the runner stops
//! it. It also stores the results in its parameter block, and the runner
//! checks that all three channels and its own expectation agree.
//!
//! # PVH image
//!
//! [`pvh_elf`] wraps the same code in an ELF file with a Xen PVH entry note,
//! so `qemu-system-x86_64 -M microvm -kernel guest.elf` or
//! `cloud-hypervisor --kernel guest.elf` boot it. There the guest starts in
//! 32-bit protected mode, builds its own page tables, switches to long mode,
//! and reads the RAM layout from the PVH `hvm_start_info` memory map. See the
//! [`pvh`] module for how it reports and powers off. [`run_pvh`] boots such an
//! image under KVM through a minimal PVH loader of this crate, which tests the
//! 32-bit entry path without QEMU; it has also been booted by QEMU 7.2
//! (`-M microvm` and `-M pc`, TCG and KVM).
//!
//! The machine code is written in `guest/guest.S`, assembled at development
//! time only (`guest/listing.py`), and embedded as a commented byte array in
//! `src/image.rs`: `cargo build` needs no assembler. A unit test re-assembles
//! the source when binutils are installed and compares.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//!
//! if let Err(reason) = microguest::kvm_available() {
//!     eprintln!("SKIP: {reason}");
//!     return;
//! }
//! // 4 MiB of zeroed, page-aligned memory as guest RAM at GPA 0.
//! let layout = std::alloc::Layout::from_size_align(4 << 20, 4096).unwrap();
//! // SAFETY: the layout has a non-zero size.
//! let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
//! assert!(!ptr.is_null());
//! // SAFETY: `ptr` is a fresh allocation of `layout.size()` bytes that nothing
//! // else uses until it is freed below.
//! let mem = unsafe { std::slice::from_raw_parts_mut(ptr, layout.size()) };
//! let ram = [microguest::GuestRam::new(mem, 0)];
//! let cfg = microguest::RunConfig { stride: 1 << 20, marker: 0x1234, ..Default::default() };
//! let report = microguest::run(&ram, &cfg).expect("guest run");
//! assert_eq!(report.pages_touched, 4);
//! assert!(!report.saw_nonzero);
//! // SAFETY: `ptr` came from `alloc_zeroed` with this layout; `ram` is dead.
//! unsafe { std::alloc::dealloc(ptr, layout) };
//! ```

#![deny(missing_docs)]

#[allow(dead_code)] // generated: not every symbol of the listing is used from Rust
mod image;

pub mod layout;
pub use layout::{pattern, stride_pages, ConfigError, GuestRam, DEFAULT_CONTROL_GPA};

pub mod pvh;
pub use pvh::{pvh_elf, PvhConfig};

pub mod spin;
pub use spin::{
    SpinState, COUNTER_GPA, IMAGE_END_GPA, MAX_GAP_GPA, SPIN_BLOCK_GPA, SPIN_BLOCK_LEN,
};

pub mod runner;
pub use runner::{kvm_available, run, run_pvh, Error, RunConfig, RunReport};

mod sys;
