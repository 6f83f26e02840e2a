//! UNPARK `--save` and its way back in the soak: a parked VM written to a
//! directory and dropped, then parked again from that directory (copied,
//! or on demand) under another name, and restored with exactly its
//! bytes.
//!
//! Every call of the save API goes through [`save_to_dir`] and
//! [`load_from_dir`]: the API is being reworked (atomic saves, a manifest
//! with checksums), and only these two functions know it.

use std::path::Path;

use hugemem_client::park::Parked;
use hugemem_client::saved_vm::{park_from_dir, unpark_to_dir};

use super::image::VmSlot;
use super::parking::{ParkedVm, Pending};
use crate::{Op, Step, Tenant};

/// Saved directories a tenant keeps at most.
const MAX_SAVED: usize = 2;

/// Writes the VM `name` parks under to `dir` and drops it.
fn save_to_dir(socket: &Path, name: &str, dir: &Path) -> Result<(), String> {
    unpark_to_dir(socket, name, dir)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Parks the VM saved in `dir` under `name` (on demand: its files read at
/// restore time).
fn load_from_dir(socket: &Path, name: &str, dir: &Path, on_demand: bool) -> Result<Parked, String> {
    park_from_dir(socket, name, dir, on_demand).map_err(|e| e.to_string())
}

/// A VM saved to a directory and not parked.
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
    /// UNPARK `--save` of a parked VM of one slot (a multi-slot VM loads
    /// each slot's file at its own 1 GiB boundary: more memory than the
    /// soak reserves). Refused, and still parked, when its files are gone
    /// (on demand, after a takeover) or cut short.
    pub fn save(&mut self) -> Step {
        if self.saved.len() >= MAX_SAVED {
            return self.load();
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
        let name = self.parked[k].name.clone();
        if let Err(e) = save_to_dir(&self.socket, &name, &dir) {
            // A takeover during the save counts: read after it.
            let takeovers = self.takeovers()?;
            let gone = self.parked[k]
                .pending
                .as_ref()
                .is_some_and(|p| p.truncated || p.takeovers < takeovers);
            if !gone {
                return Err(format!("save {name}: {e}"));
            }
            let _ = std::fs::remove_dir_all(&dir);
            self.count(Op::RestoreGone);
            return self.check_parked_view();
        }
        let vm = self.parked.swap_remove(k);
        self.saved.push(SavedVm {
            dir,
            slots: vm.slots,
            state: vm.state,
        });
        self.count(Op::UnparkSave);
        self.check_parked_view()
    }

    /// Parks a saved VM again from its directory, copied or on demand,
    /// under a free name; the directory goes (an on-demand VM's files stay
    /// open in the daemon).
    pub fn load(&mut self) -> Step {
        if self.saved.is_empty() {
            self.save()?;
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
        let on_demand = self.rng.chance(40);
        let takeovers = self.takeovers()?;
        let loaded = load_from_dir(&self.socket, &name, &s.dir, on_demand);
        let _ = std::fs::remove_dir_all(&s.dir);
        let p = match loaded {
            Ok(p) => p,
            Err(e) if e.contains("no pool memory") => {
                self.count(Op::ParkRefused);
                return Ok(());
            }
            Err(e) => return Err(format!("park {name} from {}: {e}", s.dir.display())),
        };
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
                "loaded from a directory (on demand {on_demand}) into {}, steps {}",
                p.alloc_id, self.steps
            ),
            pending: on_demand.then(|| Pending {
                _files: Vec::new(),
                takeovers,
                truncated: false,
            }),
        });
        self.count(Op::ParkFromDir);
        self.check_parked_view()
    }
}
