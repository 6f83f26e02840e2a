//! The host's 2 MiB huge-page pool: reserving pages for a test (or
//! skipping it) and reading its sysfs counts.

use guest_mem::PageSize;

/// Reserves `n` free 2 MiB pages; `false` (after printing SKIP) when impossible.
pub fn reserve_2m(n: u64, test: &str) -> bool {
    match guest_mem::ensure_free(PageSize::Huge2M, n, None) {
        Ok(r) if r.met => true,
        Ok(r) => {
            crate::skip!("{test}: only {} free 2 MiB pages, {n} needed", r.free);
            false
        }
        Err(e) => {
            crate::skip!("{test}: cannot reserve 2 MiB pages: {e}");
            false
        }
    }
}

/// A host-wide count of the 2 MiB pool from sysfs (`free_hugepages`, ...).
pub fn hugepages_2m(what: &str) -> u64 {
    let path = format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{what}");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .expect("page count")
}
