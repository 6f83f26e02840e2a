//! PARK, RESTORE and UNPARK in the soak. The tenant plays the sending
//! cloud-hypervisor of a PARK (its own allocation: moved; a memfd or a
//! file on disk: copied, or kept to be read at restore time when on
//! demand) and the receiving one of a RESTORE (plain, paused, postcopy, or
//! a receiver that refuses a step or hangs up). It keeps, per parked
//! name, what it parked, and every RESTORE must give back exactly that.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use backend::client::{Allocation, Client, ClientError};
use backend::proto::Status;
use ch_migration::layout::migration_config_slots;

use super::image::{self, check_fd, Image, VmSlot};
use super::migration::{self, Received, Receiver};
use super::owners::identity;
use crate::{Held, Live, Op, Step, Tenant, MIB};

/// Parked VMs a tenant keeps at most.
pub const MAX_PARKED: usize = 3;
/// Names per tenant: `t<index>-<0..NAMES>`, so that another uid's
/// probes hit names in use.
pub const NAMES: u64 = 4;

/// A VM this tenant parked, and what it must get back.
#[derive(Debug)]
pub struct ParkedVm {
    /// Its name.
    pub name: String,
    /// Its slots as parked.
    pub slots: Vec<VmSlot>,
    /// The state it was parked with.
    pub state: Vec<u8>,
    /// Bytes the daemon said it parked.
    pub bytes: u64,
    /// Moved: its allocation and its file's identity.
    pub moved: Option<(u64, (u64, u64))>,
    /// Parked on demand: read at restore time.
    pub pending: Option<Pending>,
    /// How it came to be parked (for a violation's message).
    pub how: String,
}

/// A VM parked on demand.
#[derive(Debug)]
pub struct Pending {
    /// The tenant's own fds of the files the daemon keeps.
    pub _files: Vec<OwnedFd>,
    /// STATS `takeovers` before the PARK: a takeover since drops the files.
    pub takeovers: u64,
    /// The tenant cut its file short after the park, or damaged the saved
    /// file it was parked from: no restore may succeed.
    pub damaged: bool,
}

fn refusal<T>(r: &Result<T, ClientError>) -> Option<(Status, &str)> {
    match r {
        Err(ClientError::Refused { status, message }) => Some((*status, message.as_str())),
        _ => None,
    }
}

impl Tenant {
    /// A name of this tenant's that no parked VM has.
    pub fn free_name(&mut self) -> Option<String> {
        let start = self.rng.below(NAMES);
        (0..NAMES)
            .map(|k| format!("t{}-{}", self.index, (start + k) % NAMES))
            .find(|n| !self.parked.iter().any(|p| &p.name == n))
    }

    /// STATS `counters.takeovers` (a successor counts itself).
    pub fn takeovers(&mut self) -> Result<u64, String> {
        Ok(self
            .client()?
            .stats()
            .map_err(|e| format!("STATS: {e}"))?
            .counters
            .takeovers)
    }

    /// One of the park moves.
    pub fn park(&mut self) -> Step {
        if self.parked.len() >= MAX_PARKED {
            let paused = self.rng.chance(50);
            return self.restore(Receiver::Plain, paused);
        }
        match self.rng.below(10) {
            0..=3 => self.park_moved(),
            4..=5 => self.park_copied(false),
            6..=7 => self.park_copied(true),
            _ => self.park_hostile(),
        }
    }

    /// Parks one of its own allocations: moved (nothing copied, the same
    /// file, the same allocation id); the launcher's FREE then learns
    /// where it went.
    pub fn park_moved(&mut self) -> Step {
        if self.pick_parkable().is_none() {
            self.alloc()?;
        }
        let (Some(i), Some(name)) = (self.pick_parkable(), self.free_name()) else {
            return Ok(());
        };
        let (id, size) = (self.live[i].id, self.live[i].size);
        let slots = [VmSlot {
            slot: 0,
            gpa: 0,
            size,
            file_offset: 0,
            image: Image::Marker(self.own),
        }];
        let fd = self.live[i]
            .fd
            .try_clone()
            .map_err(|e| format!("dup: {e}"))?;
        let (r, sent) = self.park_on_any(&name, &[(0, fd.as_fd())], &slots, false);
        let p = r.map_err(|e| format!("PARK {name} of own allocation {id}: {e}"))?;
        sent.map_err(|e| format!("PARK {name}: the sender: {e}"))?;
        if (p.alloc_id, p.bytes, p.copied_bytes, p.slots) != (id, size, 0, 1) {
            return Err(format!(
                "PARK {name} of allocation {id} ({size} bytes) moved: {p:?}"
            ));
        }
        let l = self.live.swap_remove(i);
        let eager = l.eager;
        let id_of = identity(&l.fd)?;
        self.launcher_learns(l.conn, id, &name)?;
        self.parked.push(ParkedVm {
            name,
            slots: slots.to_vec(),
            state: self.last_state.clone(),
            bytes: p.bytes,
            moved: Some((id, id_of)),
            pending: None,
            how: format!(
                "moved from allocation {id} (eager {eager}, steps {})",
                self.steps
            ),
        });
        self.count(Op::ParkMoved);
        Ok(())
    }

    /// An undamaged live allocation to park by moving it, eager or lazy.
    fn pick_parkable(&mut self) -> Option<usize> {
        let idx: Vec<usize> = (0..self.live.len())
            .filter(|&i| !self.live[i].damaged)
            .collect();
        (!idx.is_empty()).then(|| idx[self.rng.below(idx.len() as u64) as usize])
    }

    /// The launcher's FREE of a parked allocation says where it went.
    fn launcher_learns(&mut self, conn: Option<Client>, id: u64, name: &str) -> Step {
        let r = match conn {
            Some(mut c) => c.free(id),
            None => self.client()?.free(id),
        };
        match refusal(&r) {
            Some((Status::NotFound, m)) if m == format!("allocation {id} was parked as {name}") => {
                Ok(())
            }
            _ => Err(format!(
                "the launcher's FREE of {id}, parked as {name}: {r:?}"
            )),
        }
    }

    /// PARK on the main connection or a new one, sending `memory` for
    /// `slots`; remembers the state sent in `last_state`.
    fn park_on_any(
        &mut self,
        name: &str,
        memory: &[(u32, BorrowedFd<'_>)],
        slots: &[VmSlot],
        on_demand: bool,
    ) -> (
        Result<hugemem_client::park::Parked, ClientError>,
        Result<(), String>,
    ) {
        self.serial += 1;
        let config = image::config(slots);
        let state = image::state(self.index, self.serial);
        self.last_state = state.clone();
        let mut fresh = if self.rng.chance(50) {
            match self.connect() {
                Ok(c) => Some(c),
                Err(e) => return (Err(ClientError::Unexpected(e)), Ok(())),
            }
        } else {
            None
        };
        let client = match fresh.as_mut() {
            Some(c) => c,
            None => match self.client() {
                Ok(c) => c,
                Err(e) => return (Err(ClientError::Unexpected(e)), Ok(())),
            },
        };
        migration::park(client, name, memory, &config, &state, on_demand)
    }

    /// Memory from elsewhere, one file for one or two slots: a memfd, or
    /// (on demand, now and then) a file on disk. Copied at once, or on
    /// demand kept to be read at restore time. The copy must not follow
    /// what the file holds afterwards; a file cut short after an
    /// on-demand park must never restore.
    pub fn park_copied(&mut self, on_demand: bool) -> Step {
        let Some(name) = self.free_name() else {
            return self.unpark(false);
        };
        let n = 1 + u32::from(self.rng.chance(40));
        let mut slots = Vec::new();
        let mut at = 0;
        for slot in 0..n {
            let size = (1 + self.rng.below(4)) * MIB;
            let salt = self.rng.next();
            slots.push(VmSlot {
                slot,
                gpa: at,
                size,
                file_offset: at,
                image: Image::Stamped {
                    own: self.own,
                    salt,
                },
            });
            at += size;
        }
        let on_disk = on_demand && self.rng.chance(40);
        let file = self.source_file(&name, at, on_disk)?;
        for s in &slots {
            image::write_fd(&file, s.file_offset, s.size, s.image)?;
        }
        let takeovers = self.takeovers()?;
        let memory: Vec<(u32, BorrowedFd<'_>)> =
            slots.iter().map(|s| (s.slot, file.as_fd())).collect();
        let (r, sent) = self.park_on_any(&name, &memory, &slots, on_demand);
        if matches!(refusal(&r), Some((Status::NoMemory, _))) {
            self.count(Op::ParkRefused);
            return Ok(());
        }
        let p = r.map_err(|e| format!("PARK {name} of a file (on demand {on_demand}): {e}"))?;
        sent.map_err(|e| format!("PARK {name}: the sender: {e}"))?;
        if p.bytes < at || p.copied_bytes > at || u64::from(p.slots) != u64::from(n) {
            return Err(format!("PARK {name} of {n} slot(s), {at} bytes: {p:?}"));
        }
        if self.live.iter().any(|l| l.id == p.alloc_id) {
            return Err(format!(
                "PARK {name} copied into live allocation {}",
                p.alloc_id
            ));
        }
        let pending = if on_demand {
            let damaged = self.rng.chance(15);
            if damaged {
                nix::unistd::ftruncate(&file, (at / 2) as i64)
                    .map_err(|e| format!("ftruncate: {e}"))?;
            }
            self.count(Op::ParkOnDemand);
            Some(Pending {
                _files: vec![file],
                takeovers,
                damaged,
            })
        } else {
            // What the file holds now is not what was parked.
            nix::unistd::ftruncate(&file, 0).map_err(|e| format!("ftruncate: {e}"))?;
            self.count(Op::ParkCopied);
            None
        };
        self.parked.push(ParkedVm {
            name,
            slots,
            state: self.last_state.clone(),
            bytes: p.bytes,
            moved: None,
            how: format!(
                "copied (on demand {on_demand}, {n} slot(s), into {}, steps {})",
                p.alloc_id, self.steps
            ),
            pending,
        });
        Ok(())
    }

    /// A memfd, or a file in the tenant's directory, of `size` bytes.
    fn source_file(&mut self, name: &str, size: u64, on_disk: bool) -> Result<OwnedFd, String> {
        if !on_disk {
            return image::memfd(name, size);
        }
        let path = self.work_dir()?.join(format!("{name}-{}.mem", self.serial));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let _ = std::fs::remove_file(&path);
        f.set_len(size).map_err(|e| format!("set_len: {e}"))?;
        Ok(f.into())
    }

    /// A PARK that must be refused, leaving nothing parked and the
    /// tenant's allocation its own: a sender that hangs up, memory mixed
    /// from an allocation and elsewhere, a name in use. Or one that may
    /// go either way but must never reach foreign bytes: a file kept
    /// after FREE (refused as pool memory, or copied), an allocation the
    /// tenant grew or punched (refused, or moved as it is).
    pub fn park_hostile(&mut self) -> Step {
        match self.rng.below(4) {
            0 => self.park_hang_up(),
            1 => self.park_mixed(),
            2 if !self.parked.is_empty() => {
                let name = self.parked[0].name.clone();
                let memfd = image::memfd("soak-in-use", MIB)?;
                let slots = [self.stamped_slot(MIB)];
                let (r, _) = self.park_on_any(&name, &[(0, memfd.as_fd())], &slots, false);
                match refusal(&r) {
                    Some((Status::Invalid, m)) if m.contains("is parked already") => {}
                    _ => return Err(format!("a second PARK under {name}: {r:?}")),
                }
                self.count(Op::ParkRefused);
                Ok(())
            }
            _ => self.park_kept_fd(),
        }
    }

    fn stamped_slot(&mut self, size: u64) -> VmSlot {
        VmSlot {
            slot: 0,
            gpa: 0,
            size,
            file_offset: 0,
            image: Image::Stamped {
                own: self.own,
                salt: self.rng.next(),
            },
        }
    }

    /// A sender that hangs up after a few steps: refused, nothing parked.
    fn park_hang_up(&mut self) -> Step {
        use crate::park_peer::{self as peer, Step as PeerStep};
        let Some(name) = self.free_name() else {
            return Ok(());
        };
        let memfd = image::memfd("soak-hang-up", 2 * MIB)?;
        let json = String::from_utf8(image::config(&[self.stamped_slot(2 * MIB)]))
            .map_err(|e| e.to_string())?;
        let mut steps = vec![
            PeerStep::Send(peer::start()),
            PeerStep::Send(peer::memory_fd(0, &[&memfd])),
            PeerStep::Send(peer::config(&json)),
            PeerStep::Send(peer::state(b"{}")),
            PeerStep::Send(peer::complete_paused()),
        ];
        steps.truncate(1 + self.rng.below(4) as usize);
        steps.push(PeerStep::HangUp);
        let (daemon_end, sender) = peer::fake_sender(steps);
        let r = self.client()?.park(&name, &daemon_end);
        drop(daemon_end);
        let _ = sender.join();
        if !matches!(refusal(&r), Some((Status::Invalid, _))) {
            return Err(format!("PARK {name} from a sender that hung up: {r:?}"));
        }
        self.count(Op::ParkRefused);
        self.check_parked_view()
    }

    /// Slot 0 its own allocation, slot 1 a memfd: refused, and the
    /// allocation is still the tenant's.
    fn park_mixed(&mut self) -> Step {
        let (Some(i), Some(name)) = (self.pick_live(true), self.free_name()) else {
            return Ok(());
        };
        let size = self.live[i].size;
        let own_fd = self.live[i]
            .fd
            .try_clone()
            .map_err(|e| format!("dup: {e}"))?;
        let memfd = image::memfd("soak-mixed", 2 * MIB)?;
        let slots = [
            VmSlot {
                slot: 0,
                gpa: 0,
                size,
                file_offset: 0,
                image: Image::Marker(self.own),
            },
            VmSlot {
                slot: 1,
                gpa: size,
                size: 2 * MIB,
                file_offset: 0,
                image: Image::Marker(0),
            },
        ];
        let memory = [(0, own_fd.as_fd()), (1, memfd.as_fd())];
        let (r, _) = self.park_on_any(&name, &memory, &slots, false);
        match refusal(&r) {
            Some((Status::Invalid, m)) if m.contains("refuses a mix") => {}
            _ => {
                return Err(format!(
                    "PARK {name} of an allocation mixed with a memfd: {r:?}"
                ))
            }
        }
        let id = self.live[i].id;
        let locked = self.owner_of(i)?.lock(id, 0);
        if locked.is_ok() {
            let _ = self.owner_of(i)?.unlock(id, 0);
        } else if !matches!(&locked, Err(ClientError::Refused { status, .. }) if *status != Status::NotFound)
        {
            return Err(format!(
                "after a refused mixed PARK, LOCK of own {id}: {locked:?}"
            ));
        }
        self.count(Op::ParkRefused);
        self.check_parked_view()
    }

    /// A file kept after FREE as a VM's memory: refused as pool memory no
    /// allocation of the tenant holds, or copied if the pool no longer
    /// knows it (then it holds the tenant's marker or zeros).
    fn park_kept_fd(&mut self) -> Step {
        let kept = self
            .held
            .iter()
            .position(|h| matches!(h, Held::Kept { .. }));
        let (Some(k), Some(name)) = (kept, self.free_name()) else {
            return Ok(());
        };
        let Held::Kept { fd, size } = &self.held[k] else {
            return Ok(());
        };
        let (fd, size) = (fd.try_clone().map_err(|e| format!("dup: {e}"))?, *size);
        let slots = [VmSlot {
            slot: 0,
            gpa: 0,
            size,
            file_offset: 0,
            image: Image::MarkerOrZero(self.own),
        }];
        let (r, _) = self.park_on_any(&name, &[(0, fd.as_fd())], &slots, false);
        match (&r, refusal(&r)) {
            (Ok(p), _) => {
                if p.copied_bytes > size {
                    return Err(format!("PARK {name} of a kept file copied {p:?}"));
                }
                self.parked.push(ParkedVm {
                    name,
                    slots: slots.to_vec(),
                    state: self.last_state.clone(),
                    bytes: p.bytes,
                    moved: None,
                    pending: None,
                    how: format!("a kept file, copied into {}", p.alloc_id),
                });
                self.count(Op::ParkCopied);
            }
            (_, Some((Status::Invalid | Status::NoMemory, _))) => self.count(Op::ParkRefused),
            _ => return Err(format!("PARK {name} of a file kept after FREE: {r:?}")),
        }
        self.check_parked_view()
    }

    /// RESTORE of one of its parked VMs to a receiver that behaves as
    /// `how` says (see [`Receiver`]).
    pub fn restore(&mut self, how: Receiver, paused: bool) -> Step {
        if self.parked.is_empty() {
            self.park_copied(false)?;
        }
        if self.parked.is_empty() {
            return Ok(());
        }
        let k = self.rng.below(self.parked.len() as u64) as usize;
        let name = self.parked[k].name.clone();
        let mut fresh = if self.rng.chance(50) {
            Some(self.connect()?)
        } else {
            None
        };
        let (r, got) = {
            let client = match fresh.as_mut() {
                Some(c) => c,
                None => self.client()?,
            };
            migration::restore(client, &name, paused, how)
        };
        let takeovers = self.takeovers()?;
        let vm = &self.parked[k];
        let files_gone = vm.pending.as_ref().is_some_and(|p| p.takeovers < takeovers);
        let must_fail = vm.pending.as_ref().is_some_and(|p| p.damaged);
        if let Some((status, message)) = refusal(&r) {
            let stays = match how {
                Receiver::Refuse(_) | Receiver::HangUp => status == Status::Invalid,
                _ => false,
            };
            let gone =
                files_gone && status == Status::Invalid && message.contains("files are gone");
            let damaged = must_fail && status == Status::Invalid;
            if !(stays || gone || damaged) {
                return Err(format!("RESTORE {name} ({how:?}, paused {paused}): {r:?}, the receiver: {got:?} (takeovers {:?} then, {takeovers} now; {})", vm.pending.as_ref().map(|p| p.takeovers), vm.how));
            }
            if gone || damaged {
                // Its memory can only be dropped now.
                self.count(if gone {
                    Op::RestoreGone
                } else {
                    Op::RestoreRefused
                });
                return self.unpark_at(k, false);
            }
            self.count(Op::RestoreRefused);
            return self.check_parked_view();
        }
        let a = r.map_err(|e| format!("RESTORE {name}: {e}"))?;
        if matches!(how, Receiver::Refuse(_) | Receiver::HangUp) || must_fail {
            return Err(format!(
                "RESTORE {name} succeeded ({how:?}, damaged file {must_fail})"
            ));
        }
        let got = got.map_err(|e| format!("RESTORE {name}: the receiver: {e}"))?;
        let vm = self.parked.swap_remove(k);
        self.check_restored(&vm, &a, &got, paused, how)?;
        self.count(match (how, paused) {
            (Receiver::Postcopy, _) => Op::RestorePostcopy,
            (_, true) => Op::RestorePaused,
            _ => Op::Restore,
        });
        drop(got);
        // A copy's memory was taken lazily: the daemon counts it lazy.
        let lazy_alloc = vm.moved.is_none();
        self.adopt_restored(a, fresh, lazy_alloc)
    }

    /// What a RESTORE must give: the VM's own state, its slots, exactly
    /// its bytes in each, through the same files the reply hands over
    /// (a moved VM: the file it was parked from).
    fn check_restored(
        &self,
        vm: &ParkedVm,
        a: &Allocation,
        got: &Received,
        paused: bool,
        how: Receiver,
    ) -> Step {
        let name = &vm.name;
        if got.paused != paused || got.state != vm.state {
            return Err(format!(
                "RESTORE {name}: paused {} (asked {paused}), state {:?}",
                got.paused,
                String::from_utf8_lossy(&got.state)
            ));
        }
        let slots =
            migration_config_slots(&got.config, 64).map_err(|e| format!("RESTORE {name}: {e}"))?;
        let table: Vec<(u32, u64, u64)> = slots.iter().map(|s| (s.slot, s.gpa, s.size)).collect();
        let want: Vec<(u32, u64, u64)> = vm.slots.iter().map(|s| (s.slot, s.gpa, s.size)).collect();
        if table != want || got.memory.len() != vm.slots.len() {
            return Err(format!(
                "RESTORE {name}: slots {table:?} with {} fd(s), parked {want:?}",
                got.memory.len()
            ));
        }
        if how == Receiver::Postcopy && got.faults == 0 {
            return Err(format!(
                "RESTORE {name}: a postcopy restore without a fault"
            ));
        }
        let handed: Vec<(u64, u64)> = a.fds.iter().map(identity).collect::<Result<_, _>>()?;
        for (slot, fd) in &got.memory {
            let (Some(s), Some(v)) = (
                slots.iter().find(|s| s.slot == *slot),
                vm.slots.iter().find(|v| v.slot == *slot),
            ) else {
                return Err(format!(
                    "RESTORE {name}: an fd for slot {slot}, which it does not have"
                ));
            };
            let id = identity(fd)?;
            if !handed.contains(&id) || vm.moved.is_some_and(|(_, m)| m != id) {
                return Err(format!("RESTORE {name}: slot {slot}'s file {id:?}, the reply's {handed:?}, parked {:?}", vm.moved));
            }
            check_fd(
                fd,
                s.file_offset,
                s.size,
                v.image,
                &format!("RESTORE {name} slot {slot} (it was {})", vm.how),
            )?;
        }
        if let Some((alloc, _)) = vm.moved {
            if a.id != alloc {
                return Err(format!(
                    "RESTORE {name} of moved allocation {alloc} handed {}",
                    a.id
                ));
            }
        }
        Ok(())
    }

    /// A restored allocation becomes a live one of the restoring
    /// connection (its memory then gets the marker), or is FREEd.
    fn adopt_restored(&mut self, a: Allocation, conn: Option<Client>, lazy_alloc: bool) -> Step {
        let id = a.id;
        let token = a.token();
        if a.regions.len() != 1 || self.live.len() >= 2 || self.rng.chance(30) {
            drop(a);
            let r = match conn {
                Some(mut c) => c.free(id),
                None => self.client()?.free(id),
            };
            return r.map_err(|e| format!("FREE of restored {id}: {e}"));
        }
        let (info, fd) = match a.into_parts().1.into_iter().next() {
            Some(p) => p,
            None => return Err("no region".into()),
        };
        let filled = crate::fill(fd.as_raw_fd(), info.size, self.own);
        // A VM parked by moving a path-mode allocation restores on its
        // hugetlbfs file (a HANDOFF with PATHS then succeeds).
        let paths = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map_err(|e| format!("the restored region's fd: {e}"))?
            .to_str()
            .is_some_and(|p| !p.starts_with("/memfd:"));
        self.live.push(Live {
            id,
            fd,
            region_id: info.region_id,
            size: info.size,
            paths,
            damaged: !filled,
            grown: None,
            token,
            how: format!(
                "RESTORE {id} on a new connection {} (step {})",
                conn.is_some(),
                self.steps
            ),
            conn,
            eager: true,
            lazy_alloc,
            lazy_record: false,
            _lazy: None,
        });
        Ok(())
    }

    /// UNPARK of one of its parked VMs; then (now and then) its RESTORE
    /// finds nothing.
    pub fn unpark(&mut self, save: bool) -> Step {
        if self.parked.is_empty() {
            return Ok(());
        }
        let k = self.rng.below(self.parked.len() as u64) as usize;
        self.unpark_at(k, save)
    }

    fn unpark_at(&mut self, k: usize, _save: bool) -> Step {
        let vm = self.parked.swap_remove(k);
        self.client()?
            .unpark(&vm.name)
            .map_err(|e| format!("UNPARK {}: {e}", vm.name))?;
        self.count(Op::Unpark);
        if self.rng.chance(30) {
            let (r, _) = migration::restore(self.client()?, &vm.name, true, Receiver::Plain);
            if !matches!(refusal(&r), Some((Status::NotFound, _))) {
                return Err(format!("RESTORE {} after its UNPARK: {r:?}", vm.name));
            }
        }
        Ok(())
    }

    /// RESTORE and UNPARK of names another uid parks under (or, when all
    /// tenants share a uid, of names nobody parks): NOT_FOUND, and the
    /// owner's VM stays (its own RESTORE later finds it).
    pub fn probe_names(&mut self) -> Step {
        let name = if self.foreign_names.is_empty() {
            format!("t{}-unused", self.index)
        } else {
            self.foreign_names[self.rng.below(self.foreign_names.len() as u64) as usize].clone()
        };
        let (r, _) = migration::restore(self.client()?, &name, true, Receiver::Plain);
        let u = self.client()?.unpark(&name);
        let expected = format!("no VM named {name:?} is parked");
        for (what, refused) in [("RESTORE", refusal(&r)), ("UNPARK", refusal(&u))] {
            if refused != Some((Status::NotFound, expected.as_str())) {
                return Err(format!("{what} of {name} (not this uid's): {r:?} / {u:?}"));
            }
        }
        self.count(Op::ForeignNameRefused);
        Ok(())
    }

    /// This tenant's parked VMs in its STATS: exactly the ones it keeps
    /// (with their bytes); for a tenant that is not an operator, no other
    /// uid's.
    pub fn check_parked_view(&mut self) -> Step {
        let prefix = format!("t{}-", self.index);
        let (uid, unprivileged) = (self.uid, self.unprivileged);
        let s = self.client()?.stats().map_err(|e| format!("STATS: {e}"))?;
        if unprivileged {
            if let Some(p) = s.parked.iter().find(|p| p.uid != uid) {
                return Err(format!(
                    "uid {uid}'s STATS lists uid {}'s parked VM {}",
                    p.uid, p.name
                ));
            }
        }
        let mut listed: Vec<(String, u64)> = s
            .parked
            .iter()
            .filter(|p| p.uid == uid && p.name.starts_with(&prefix))
            .map(|p| (p.name.clone(), p.bytes))
            .collect();
        let mut kept: Vec<(String, u64)> = self
            .parked
            .iter()
            .map(|p| (p.name.clone(), p.bytes))
            .collect();
        listed.sort();
        kept.sort();
        if listed != kept {
            return Err(format!(
                "STATS lists parked {listed:?}, the tenant parked {kept:?}"
            ));
        }
        self.count(Op::ParkedChecked);
        Ok(())
    }
}
