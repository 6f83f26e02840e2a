//! The run's options and its plan: which (page size, template size, clone
//! count) combinations fit this host's memory, and why the others are left
//! out. Nothing here measures.

use guest_mem::PageSize;
use serde::Serialize;

/// The template sizes: 1, 4 and 8 GiB.
pub const DEFAULT_SIZES: [u64; 3] = [1 << 30, 4 << 30, 8 << 30];
/// The clone counts.
pub const DEFAULT_COUNTS: [usize; 3] = [1, 8, 25];
/// Memory the plan leaves the rest of the host (its other processes, the
/// page cache the snapshots need): 2 GiB.
pub const HOST_MARGIN: u64 = 2 << 30;

/// How the bench runs.
#[derive(Debug, Clone, Serialize)]
pub struct CloneConfig {
    /// Template sizes, bytes.
    pub sizes: Vec<u64>,
    /// Clone counts (N).
    pub counts: Vec<usize>,
    /// Page sizes of the templates' memory.
    #[serde(serialize_with = "page_names")]
    pub page_sizes: Vec<PageSize>,
    /// Repetitions of every combination.
    pub reps: usize,
    /// Huge-page bytes the plan may use per page size; `None`: what the
    /// host has free and could add ([`host_budget`]).
    #[serde(skip)]
    pub budget: Option<Vec<(PageSize, u64)>>,
    /// Where cloud-hypervisor's snapshots go (a private directory in it).
    #[serde(skip)]
    pub dir: std::path::PathBuf,
    /// The cloud-hypervisor binary.
    #[serde(skip)]
    pub cloud_hypervisor: std::ffi::OsString,
    /// The `hugemem` binary (`serve`, `launch`, `park`).
    #[serde(skip)]
    pub launcher: std::path::PathBuf,
    /// The VMM every VM of the run starts in (`--vmm`): cloud-hypervisor,
    /// or QEMU (its own baseline then QEMU's migrate to a file).
    #[serde(serialize_with = "vmm_name")]
    pub vmm: hugemem::launch::Vmm,
    /// The QEMU binary (`--vmm qemu`).
    #[serde(skip)]
    pub qemu: std::ffi::OsString,
}

impl CloneConfig {
    /// The run's VMM and its program.
    pub(crate) fn vmm_program(&self) -> (hugemem::launch::Vmm, std::ffi::OsString) {
        match self.vmm {
            hugemem::launch::Vmm::CloudHypervisor => (self.vmm, self.cloud_hypervisor.clone()),
            hugemem::launch::Vmm::Qemu => (self.vmm, self.qemu.clone()),
        }
    }
}

/// `cloud-hypervisor` or `qemu`, as `--vmm` takes it.
pub fn vmm_arg(vmm: hugemem::launch::Vmm) -> &'static str {
    match vmm {
        hugemem::launch::Vmm::CloudHypervisor => "cloud-hypervisor",
        hugemem::launch::Vmm::Qemu => "qemu",
    }
}

fn vmm_name<S: serde::Serializer>(v: &hugemem::launch::Vmm, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(vmm_arg(*v))
}

/// One combination the run measures: clones of a `size` template on
/// `page_size` pages, `count` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Combination {
    /// Page size of the template's memory.
    #[serde(serialize_with = "page_name")]
    pub page_size: PageSize,
    /// Template size, bytes.
    pub size: u64,
    /// Clones (and restores from the park) at once, or one after another.
    pub count: usize,
}

fn page_names<S: serde::Serializer>(p: &[PageSize], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(p.iter().map(ToString::to_string))
}

fn page_name<S: serde::Serializer>(p: &PageSize, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&p.to_string())
}

impl Combination {
    /// Huge-page bytes it needs at its peak: the template and `count`
    /// clones of its size. A copy clone takes its size from the pool; a
    /// shared clone has the kernel reserve its size (cloud-hypervisor maps
    /// it with `reserve=true`), though it uses only what it writes; the
    /// restores from the park run on the copy clones' memory, parked.
    pub fn needs(&self) -> u64 {
        self.size.saturating_mul(self.count as u64 + 1)
    }
}

/// A combination the run leaves out, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeftOut {
    /// The combination.
    #[serde(flatten)]
    pub combination: Combination,
    /// Why (memory, or a size that is not a multiple of the page).
    pub why: String,
}

/// What the run measures and what it leaves out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Measured, smallest page size, then size, then count first.
    pub run: Vec<Combination>,
    /// Left out, with the reason.
    pub left_out: Vec<LeftOut>,
}

impl Plan {
    /// The plan of `sizes` x `counts` on `page_sizes`, each combination
    /// against `budget` (huge-page bytes per page size; a page size absent
    /// from it has none).
    pub fn new(
        page_sizes: &[PageSize],
        sizes: &[u64],
        counts: &[usize],
        budget: &[(PageSize, u64)],
    ) -> Self {
        let mut plan = Self::default();
        for &page_size in page_sizes {
            let have = budget
                .iter()
                .find(|(p, _)| *p == page_size)
                .map_or(0, |(_, b)| *b);
            for &size in sizes {
                for &count in counts {
                    let c = Combination {
                        page_size,
                        size,
                        count,
                    };
                    let why = if size == 0 || !size.is_multiple_of(page_size.bytes()) {
                        Some(format!("{size} bytes is not a multiple of {page_size}"))
                    } else if count == 0 {
                        Some("no clones".to_string())
                    } else if c.needs() > have {
                        Some(format!(
                            "memory: the template and {count} clone(s) of {} need {} of {page_size} pages, the host can give {}",
                            guest_mem::size::format_size(size),
                            guest_mem::size::format_size(c.needs()),
                            guest_mem::size::format_size(have),
                        ))
                    } else {
                        None
                    };
                    match why {
                        Some(why) => plan.left_out.push(LeftOut {
                            combination: c,
                            why,
                        }),
                        None => plan.run.push(c),
                    }
                }
            }
        }
        plan
    }

    /// The largest need of the combinations run on `page`, bytes.
    pub fn peak(&self, page: PageSize) -> u64 {
        self.run
            .iter()
            .filter(|c| c.page_size == page)
            .map(Combination::needs)
            .max()
            .unwrap_or(0)
    }
}

/// The huge-page bytes this host can give a run, per page size: for 2 MiB
/// pages the free ones plus what the kernel could still make of the
/// available memory less [`HOST_MARGIN`]; for 1 GiB pages the free ones
/// only (the kernel rarely finds a free gigabyte once it has run a while).
pub fn host_budget() -> Vec<(PageSize, u64)> {
    let pages = numa::HugePages::host();
    let free = |bytes: u64| pages.pool(bytes, None).map_or(0, |p| p.free * bytes);
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024);
    let two_m = PageSize::Huge2M.bytes();
    let growable = available.saturating_sub(HOST_MARGIN);
    vec![
        (PageSize::Huge2M, free(two_m) + growable - growable % two_m),
        (PageSize::Huge1G, free(PageSize::Huge1G.bytes())),
    ]
}

/// A comma-separated list of a command line (`--sizes 1G,4G`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct List<T>(pub Vec<T>);

/// Parses a comma-separated list with `one` (`--sizes 1G,4G`).
///
/// # Errors
///
/// The first item `one` refuses, or an empty list.
pub fn parse_list<T, E: std::fmt::Display>(
    s: &str,
    one: impl Fn(&str) -> Result<T, E>,
) -> Result<List<T>, String> {
    let items: Vec<T> = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| one(x).map_err(|e| format!("{x:?}: {e}")))
        .collect::<Result<_, _>>()?;
    if items.is_empty() {
        return Err(format!("{s:?}: an empty list"));
    }
    Ok(List(items))
}
