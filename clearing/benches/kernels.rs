//! Throughput of the clearing kernels on already-populated memory.
//!
//! Environment:
//! * `HUGEMEM_BENCH_BYTES`: buffer size in bytes (default 64 MiB; rounded up to
//!   the page size).
//! * `HUGEMEM_BENCH_PAGE`: `1g`, `2m` or `4k` for the backing pages. Default:
//!   2 MiB hugetlb pages if the pool has enough free ones, else ordinary 4 KiB
//!   anonymous memory. Reserve pages first, e.g. as root
//!   `echo 1 > /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages`.
//!
//! The buffer is mapped, written, unmapped and mapped and written again before
//! any timing: under a hypervisor that backs guest memory lazily the very
//! first touch of a physical page is several times slower than any later one,
//! and that would be measured instead of the kernel.

use std::hint::black_box;
use std::time::Duration;

use clearing::{clear, clear_huge_page, clear_parallel, ClearKernel, RunOptions};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const DEFAULT_BYTES: usize = 64 << 20;

#[derive(Clone, Copy, Debug)]
enum Backing {
    Huge1G,
    Huge2M,
    Small,
}

impl Backing {
    fn page_size(self) -> usize {
        match self {
            Backing::Huge1G => 1 << 30,
            Backing::Huge2M => 2 << 20,
            Backing::Small => 4096,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Backing::Huge1G => "hugetlb-1g",
            Backing::Huge2M => "hugetlb-2m",
            Backing::Small => "anon-4k",
        }
    }
    fn mmap_flags(self) -> libc::c_int {
        let base = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
        match self {
            Backing::Huge1G => base | libc::MAP_HUGETLB | libc::MAP_HUGE_1GB,
            Backing::Huge2M => base | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
            Backing::Small => base,
        }
    }
}

/// An anonymous mapping, unmapped on drop.
struct Buffer {
    ptr: *mut u8,
    len: usize,
    backing: Backing,
}

impl Buffer {
    fn map(len: usize, backing: Backing) -> Option<Self> {
        let len = len.div_ceil(backing.page_size()) * backing.page_size();
        // SAFETY: a new anonymous private mapping at an address of the kernel's
        // choosing; it aliases nothing.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                backing.mmap_flags(),
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        let mut buf = Self {
            ptr: ptr.cast(),
            len,
            backing,
        };
        buf.as_mut_slice().fill(0xff);
        Some(buf)
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr..ptr + len` is our own live read-write mapping, and the
        // `&mut self` borrow makes this the only reference to it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Maps, touches and frees once, then maps and touches for real.
    fn warm(len: usize, backing: Backing) -> Option<Self> {
        drop(Self::map(len, backing)?);
        Self::map(len, backing)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this object created and owns; no
        // slice of it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn make_buffer() -> Buffer {
    let bytes = std::env::var("HUGEMEM_BENCH_BYTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_BYTES);
    let wanted = match std::env::var("HUGEMEM_BENCH_PAGE").as_deref() {
        Ok("1g") => vec![Backing::Huge1G],
        Ok("2m") => vec![Backing::Huge2M],
        Ok("4k") => vec![Backing::Small],
        _ => vec![Backing::Huge2M, Backing::Small],
    };
    for b in wanted {
        if let Some(buf) = Buffer::warm(bytes, b) {
            eprintln!("benchmark buffer: {} bytes of {}", buf.len, b.name());
            return buf;
        }
        eprintln!("cannot map {bytes} bytes of {}", b.name());
    }
    panic!("no benchmark buffer could be mapped");
}

fn kernels(c: &mut Criterion) {
    let mut buf = make_buffer();
    let len = buf.len;
    let mut g = c.benchmark_group(format!("clear-{}", buf.backing.name()));
    g.throughput(Throughput::Bytes(len as u64));
    for kernel in ClearKernel::ALL {
        if !kernel.is_available() {
            eprintln!("skipping {}: not available on this CPU", kernel.name());
            continue;
        }
        g.bench_function(kernel.name(), |b| {
            b.iter(|| clear(kernel, black_box(buf.as_mut_slice())))
        });
    }
    for kernel in [ClearKernel::MultiPage, ClearKernel::NonTemporal] {
        if !kernel.is_available() {
            continue;
        }
        g.bench_function(format!("huge_page-{}", kernel.name()), |b| {
            b.iter(|| clear_huge_page(kernel, black_box(buf.as_mut_slice()), len / 2 + 123))
        });
    }
    match numa::Topology::detect() {
        Ok(topo) => {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            g.bench_function(format!("parallel-{threads}t-multipage"), |b| {
                b.iter(|| {
                    clear_parallel(
                        &topo,
                        black_box(buf.as_mut_slice()),
                        None,
                        threads,
                        ClearKernel::MultiPage,
                        &RunOptions::default(),
                    )
                })
            });
        }
        Err(e) => eprintln!("skipping parallel bench: {e}"),
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = kernels
}
criterion_main!(benches);
