//! QEMU's own save and restore of the same VM (`--vmm qemu`, issue 46),
//! run as `bench offload` runs them (`offload/qemu_side.rs`), one at a
//! time, on the counting micro-guest under `-M microvm`:
//!
//! * **QEMU's floor**: `migrate` with `x-ignore-shared` to a file and a new
//!   QEMU with `-incoming defer` fed it, on a resident hugetlb memfd the
//!   bench holds: QEMU writes and reads only its device state, and the new
//!   QEMU maps the same pages. Issue 46 asks for a park, a restore and
//!   (here) a clone within 5 ms of it.
//! * **QEMU's own save**: the same without `x-ignore-shared`, QEMU on its
//!   own memory (`memory-backend-memfd`): all of its RAM goes to the file
//!   and comes back (the file is dropped from the page cache first, as a
//!   stopped VM's file would be after a while).
//!
//! Each restore is timed from the new QEMU's start to the guest counting
//! past the count it held when saved.

use std::ffi::OsString;
use std::path::Path;

use guest_mem::PageSize;

use super::plan::CloneConfig;
use super::report::QemuRestoreResult;
use crate::offload::{floor_save_restore, own_save_restore};

/// QEMU's kinds of save and restore, as the report names them.
pub const QEMU_RESTORE_KINDS: [&str; 2] = ["floor", "migrate"];

/// Both kinds, `cfg.reps` times each, of a `size` guest on `page` pages;
/// a kind that fails is a note on its row.
pub(crate) fn qemu_restores(
    cfg: &CloneConfig,
    dir: &Path,
    elf: &Path,
    (size, page): (u64, PageSize),
    progress: &mut dyn FnMut(&str),
) -> Vec<QemuRestoreResult> {
    let qemu: &OsString = &cfg.qemu;
    let label = guest_mem::size::format_size(size);
    let mut out = Vec::new();
    for (k, kind) in QEMU_RESTORE_KINDS.iter().enumerate() {
        let mut r = QemuRestoreResult {
            page_size: page.to_string(),
            size,
            kind: (*kind).to_string(),
            ..QemuRestoreResult::default()
        };
        for rep in 0..cfg.reps {
            // Each run's files and monitors by a number of their own.
            let tag = (size >> 20) as usize * 1000 + k * 100 + rep;
            let once = if *kind == "floor" {
                floor_save_restore((size, page), qemu, (dir, elf), tag)
            } else {
                own_save_restore((size, page), qemu, (dir, elf), tag)
            };
            match once {
                Ok(s) => {
                    r.save_ms.extend([s.save_ms]);
                    r.running_ms.extend([s.restore_ms]);
                    r.file_bytes = r.file_bytes.max(s.file_bytes);
                    r.ram_transferred_bytes = r.ram_transferred_bytes.max(s.ram_bytes);
                    r.guest_bad = r.guest_bad.max(s.stale);
                }
                Err(e) => {
                    progress(&format!(
                        "QEMU's own save and restore ({kind}) of {label}: {e}"
                    ));
                    r.note = Some(e.to_string());
                    break;
                }
            }
        }
        progress(&format!(
            "QEMU's own save and restore ({kind}) of {label} on {page} pages: restore p50 {:.1} ms",
            r.running_ms.p50
        ));
        out.push(r);
    }
    out
}
