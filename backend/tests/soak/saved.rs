//! Saves in the soak: a parked VM written to a directory (EXPORT: the VM
//! stays parked while it is written) and then dropped (UNPARK `--save`)
//! or kept parked (`hugemem save`), then parked again from that directory
//! (copied, or on demand; PARK with VERIFY against the save's manifest)
//! under another name and restored with exactly its bytes. A save whose
//! memory file the tenant damaged is never parked eagerly, and a VM
//! parked on demand from it never restores.
//!
//! Every call of the save API goes through [`save_to_dir`] and
//! [`load_from_dir`]: only these two functions know it.

use std::path::Path;

use ch_migration::offload_dir::memory_slot_filename;
use hugemem_client::park::Parked;
use hugemem_client::saved_vm::{park_from_dir, save_parked, SaveOptions, SavedVmError};

use super::image::VmSlot;
use super::parking::{ParkedVm, Pending};
use crate::{Op, Step, Tenant};

/// Saved directories a tenant keeps at most.
const MAX_SAVED: usize = 2;

/// Writes the VM `name` parks under to `dir`, whole or not at all, and
/// then drops it when `drop_after` (UNPARK `--save`).
fn save_to_dir(
    socket: &Path,
    name: &str,
    dir: &Path,
    drop_after: bool,
) -> Result<(), SavedVmError> {
    save_parked(socket, name, dir, drop_after, &SaveOptions::default()).map(|_| ())
}

/// Parks the VM saved in `dir` under `name` (on demand: its files read at
/// restore time).
fn load_from_dir(
    socket: &Path,
    name: &str,
    dir: &Path,
    on_demand: bool,
) -> Result<Parked, SavedVmError> {
    park_from_dir(socket, name, dir, on_demand).map(|r| r.parked)
}

/// A VM saved to a directory.
#[derive(Debug)]
pub struct SavedVm {
    /// The directory.
    pub dir: std::path::PathBuf,
    /// Its slots as parked.
    pub slots: Vec<VmSlot>,
    /// Its state.
    pub state: Vec<u8>,
}

impl Tenant {
    /// A save of a parked VM of one slot (a multi-slot VM loads each
    /// slot's file at its own 1 GiB boundary: more memory than the soak
    /// reserves): dropped after it (`drop_after`, UNPARK `--save`) or kept
    /// parked. Refused, the VM still parked and nothing in the directory,
    /// when its files are gone (on demand, after a takeover) or damaged,
    /// or when a takeover came between the write and the rename.
    pub fn save(&mut self, drop_after: bool) -> Step {
        if self.saved.len() >= MAX_SAVED {
            let damage = self.rng.chance(20);
            return self.load(damage);
        }
        let one_slot: Vec<usize> = (0..self.parked.len())
            .filter(|&k| self.parked[k].slots.len() == 1)
            .collect();
        if one_slot.is_empty() {
            return self.park_moved();
        }
        let k = one_slot[self.rng.below(one_slot.len() as u64) as usize];
        self.serial += 1;
        let dir = self.work_dir()?.join(format!("saved-{}", self.serial));
        let before = self.takeovers()?;
        let name = self.parked[k].name.clone();
        if let Err(e) = save_to_dir(&self.socket, &name, &dir, drop_after) {
            // A takeover during the save counts: read after it.
            let after = self.takeovers()?;
            let gone = self.parked[k]
                .pending
                .as_ref()
                .is_some_and(|p| p.damaged || p.takeovers < after);
            let lost = matches!(e, SavedVmError::Lost { .. }) && before < after;
            if !(gone || lost) || dir.exists() {
                return Err(format!(
                    "save {name} (drop {drop_after}): {e}; the directory left: {}",
                    dir.exists()
                ));
            }
            self.count(Op::RestoreGone);
            return self.check_parked_view();
        }
        // Its files damaged: no save may hold it. (Files a takeover carried
        // fill it as at a restore; the bytes are checked when it is loaded
        // and restored.)
        if let Some(p) = self.parked[k].pending.as_ref() {
            if p.damaged {
                return Err(format!(
                    "save {name} succeeded, parked on demand from a damaged file (it was {})",
                    self.parked[k].how
                ));
            }
        }
        let (slots, state) = if drop_after {
            let vm = self.parked.swap_remove(k);
            self.count(Op::UnparkSave);
            (vm.slots, vm.state)
        } else {
            self.count(Op::SaveKept);
            (self.parked[k].slots.clone(), self.parked[k].state.clone())
        };
        self.saved.push(SavedVm { dir, slots, state });
        self.check_parked_view()
    }

    /// Parks a saved VM again from its directory, copied or on demand,
    /// under a free name; the directory goes (an on-demand VM's files stay
    /// open in the daemon). With `damage`, one byte of its memory file is
    /// changed first: an eager park is refused, an on-demand one never
    /// restores.
    pub fn load(&mut self, damage: bool) -> Step {
        if self.saved.is_empty() {
            let drop_after = self.rng.chance(50);
            self.save(drop_after)?;
        }
        if self.saved.is_empty() || self.parked.len() >= super::parking::MAX_PARKED {
            return Ok(());
        }
        let Some(name) = self.free_name() else {
            return Ok(());
        };
        let s = self
            .saved
            .swap_remove(self.rng.below(self.saved.len() as u64) as usize);
        if damage {
            self.damage_saved(&s)?;
        }
        let on_demand = self.rng.chance(40);
        let takeovers = self.takeovers()?;
        let loaded = load_from_dir(&self.socket, &name, &s.dir, on_demand);
        let _ = std::fs::remove_dir_all(&s.dir);
        let p = match loaded {
            Ok(p) => p,
            Err(e) if e.to_string().contains("no pool memory") => {
                self.count(Op::ParkRefused);
                return Ok(());
            }
            Err(_) if damage && !on_demand => {
                self.count(Op::DamagedSaveRefused);
                return self.check_parked_view();
            }
            Err(e) => {
                return Err(format!(
                    "park {name} from {} (on demand {on_demand}, damaged {damage}): {e}",
                    s.dir.display()
                ))
            }
        };
        if damage && !on_demand {
            return Err(format!("park {name} from a damaged save: {p:?}"));
        }
        let size: u64 = s.slots.iter().map(|v| v.size).sum();
        if p.bytes < size || p.slots as usize != s.slots.len() {
            return Err(format!(
                "park {name} from a directory of {size} bytes: {p:?}"
            ));
        }
        self.parked.push(ParkedVm {
            name,
            slots: s.slots,
            state: s.state,
            bytes: p.bytes,
            moved: None,
            how: format!(
                "loaded from a directory (on demand {on_demand}, damaged {damage}) into {}, steps {}",
                p.alloc_id, self.steps
            ),
            pending: on_demand.then(|| Pending {
                _files: Vec::new(),
                takeovers,
                damaged: damage,
            }),
        });
        self.count(Op::ParkFromDir);
        self.check_parked_view()
    }

    /// Changes one byte of a saved VM's memory file (one of its own: the
    /// tenant wrote it), where its image holds data or a hole alike.
    fn damage_saved(&mut self, s: &SavedVm) -> Step {
        let Some(slot) = s.slots.first() else {
            return Ok(());
        };
        let path = s.dir.join(memory_slot_filename(slot.slot));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let at = self.rng.below(slot.size);
        let mut b = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, at)
            .map_err(|e| format!("read {}: {e}", path.display()))?;
        b[0] ^= 0x5A;
        std::os::unix::fs::FileExt::write_all_at(&f, &b, at)
            .map_err(|e| format!("write {}: {e}", path.display()))
    }
}
