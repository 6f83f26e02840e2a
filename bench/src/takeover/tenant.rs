//! The running VMs' stand-ins: an allocation each, mapped and written with
//! a pattern, checked after the switch; and the ALLOC request they make.

use backend::client::Client;
use backend::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo};
use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use guest_mem::PageSize;

use super::error::TakeoverError;

/// Mixed into what the tenants write.
pub(super) const MARKER: u64 = 0x4855_4754_414b_454f; // "HUGTAKEO"

/// A running VM's stand-in: its connection, allocation and mapping.
pub(super) struct Tenant {
    pub(super) conn: Option<Client>,
    pub(super) id: u64,
    pub(super) regions: Vec<RegionInfo>,
    pub(super) mem: GuestMemoryMmap,
    pub(super) salt: u64,
}

impl Tenant {
    pub(super) fn word(&self, gpa: u64) -> u64 {
        MARKER ^ self.salt ^ gpa
    }

    /// The guest physical address of every 4 KiB of its memory.
    pub(super) fn addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.regions
            .iter()
            .flat_map(|r| (r.guest_phys..r.guest_phys + r.size).step_by(4096))
    }

    pub(super) fn write(&self) -> Result<(), TakeoverError> {
        for gpa in self.addresses() {
            self.mem
                .write_obj(self.word(gpa), GuestAddress(gpa))
                .map_err(|e| TakeoverError::Run(format!("tenant write at {gpa:#x}: {e}")))?;
        }
        Ok(())
    }

    pub(super) fn intact(&self) -> bool {
        self.addresses().all(|gpa| {
            self.mem
                .read_obj::<u64>(GuestAddress(gpa))
                .is_ok_and(|w| w == self.word(gpa))
        })
    }
}

pub(super) fn request(size: u64, page: PageSize) -> AllocRequest {
    AllocRequest {
        total_size: size,
        page_policy: match page {
            PageSize::Huge1G => PagePolicy::Huge1G,
            _ => PagePolicy::Huge2M,
        },
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: Vec::new(),
        want_paths: false,
    }
}
