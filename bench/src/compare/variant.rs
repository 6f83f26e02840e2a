//! The variants compared: which VMM or runner, on which memory.

use hugemem::launch::Vmm;

/// The variant every ratio is taken against.
pub const BASELINE: Variant = Variant::QemuPrealloc;

/// One way of getting guest RAM ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Variant {
    /// QEMU, hugetlb memfd, `prealloc=on` (the baseline).
    QemuPrealloc,
    /// QEMU, hugetlb memfd, no prealloc.
    QemuLazy,
    /// QEMU on hugemem memory, fresh pages.
    QemuHugememFresh,
    /// QEMU on hugemem memory from the clean pool.
    QemuHugememPool,
    /// cloud-hypervisor, `hugepages=on,prefault=on`.
    ChPrefault,
    /// cloud-hypervisor on hugemem memory from the clean pool.
    ChHugememPool,
    /// hugemem's rust-vmm client, fresh pages.
    ClientFresh,
    /// hugemem's rust-vmm client, from the clean pool.
    ClientPool,
    /// QEMU's floor: a resident, zeroed hugetlb memfd made by the bench
    /// before the clock starts, passed as hugemem passes its fds, no daemon.
    QemuFloor,
    /// cloud-hypervisor's floor, the same way.
    ChFloor,
    /// The client's floor: the same memfd mapped by the rust-vmm path.
    ClientFloor,
}

/// Who runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Runner {
    /// A VMM, on the micro-guest's PVH image.
    Vmm(Vmm),
    /// hugemem's client, in process.
    Client,
}

/// Where the memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Memory {
    /// The VMM's own (prealloc, prefault or lazy).
    Own,
    /// A hugemem ALLOC from an empty pool.
    Fresh,
    /// A hugemem ALLOC from the clean pool.
    Pool,
    /// Memory that needs no preparation: populated before the clock starts,
    /// no daemon (the VMM's floor).
    Floor,
}

impl Variant {
    /// Every variant, in report order.
    pub const ALL: [Variant; 11] = [
        Variant::QemuPrealloc,
        Variant::QemuLazy,
        Variant::QemuHugememFresh,
        Variant::QemuHugememPool,
        Variant::ChPrefault,
        Variant::ChHugememPool,
        Variant::ClientFresh,
        Variant::ClientPool,
        Variant::QemuFloor,
        Variant::ChFloor,
        Variant::ClientFloor,
    ];

    /// The JSON key.
    pub fn key(self) -> &'static str {
        match self {
            Variant::QemuPrealloc => "qemu_prealloc",
            Variant::QemuLazy => "qemu_lazy",
            Variant::QemuHugememFresh => "qemu_hugemem_fresh",
            Variant::QemuHugememPool => "qemu_hugemem_pool",
            Variant::ChPrefault => "ch_prefault",
            Variant::ChHugememPool => "ch_hugemem_pool",
            Variant::ClientFresh => "client_fresh",
            Variant::ClientPool => "client_pool",
            Variant::QemuFloor => "qemu_floor",
            Variant::ChFloor => "ch_floor",
            Variant::ClientFloor => "client_floor",
        }
    }

    /// A short description.
    pub fn label(self) -> &'static str {
        match self {
            Variant::QemuPrealloc => "QEMU, hugetlb memfd, prealloc=on (baseline)",
            Variant::QemuLazy => "QEMU, hugetlb memfd, no prealloc",
            Variant::QemuHugememFresh => "QEMU on hugemem memory, fresh pages",
            Variant::QemuHugememPool => "QEMU on hugemem memory, clean pool",
            Variant::ChPrefault => "cloud-hypervisor, hugepages prefault=on",
            Variant::ChHugememPool => "cloud-hypervisor on hugemem memory, clean pool",
            Variant::ClientFresh => "hugemem client (rust-vmm, KVM), fresh pages",
            Variant::ClientPool => "hugemem client (rust-vmm, KVM), clean pool",
            Variant::QemuFloor => "QEMU's floor: a resident memfd, no daemon",
            Variant::ChFloor => "cloud-hypervisor's floor: a resident memfd, no daemon",
            Variant::ClientFloor => "the client's floor: a resident memfd, no daemon",
        }
    }

    pub(super) fn runner(self) -> Runner {
        match self {
            Variant::QemuPrealloc
            | Variant::QemuLazy
            | Variant::QemuHugememFresh
            | Variant::QemuHugememPool
            | Variant::QemuFloor => Runner::Vmm(Vmm::Qemu),
            Variant::ChPrefault | Variant::ChHugememPool | Variant::ChFloor => {
                Runner::Vmm(Vmm::CloudHypervisor)
            }
            Variant::ClientFresh | Variant::ClientPool | Variant::ClientFloor => Runner::Client,
        }
    }

    pub(super) fn memory(self) -> Memory {
        match self {
            Variant::QemuPrealloc | Variant::QemuLazy | Variant::ChPrefault => Memory::Own,
            Variant::QemuHugememFresh | Variant::ClientFresh => Memory::Fresh,
            Variant::QemuHugememPool | Variant::ChHugememPool | Variant::ClientPool => Memory::Pool,
            Variant::QemuFloor | Variant::ChFloor | Variant::ClientFloor => Memory::Floor,
        }
    }

    /// The floor of this variant's VMM: the same VMM and guest on memory
    /// that needs no preparation.
    pub fn floor(self) -> Variant {
        Variant::ALL
            .into_iter()
            .find(|f| f.memory() == Memory::Floor && f.runner() == self.runner())
            .unwrap_or(Variant::ClientFloor)
    }
}
