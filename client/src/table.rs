//! Where each VMM address range lives: the fault service's map from the
//! VMM's guest-RAM mappings to (region, offset in the region).
//!
//! The table starts as the VMM's mapping list and follows its
//! non-cooperative events: `munmap` of part of a range (UNMAP) drops that
//! part, `mremap` (REMAP) moves it. Both cut ranges at page boundaries, so
//! one range can become up to three. Pure bookkeeping, generic over what a
//! range points into, so it is tested without memory.

/// One contiguous VMM range backed by `len` bytes of `target` from `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range<T> {
    /// Start in the VMM's address space.
    pub vmm_start: u64,
    /// Bytes.
    pub len: u64,
    /// Offset in the target (the region).
    pub offset: u64,
    /// What backs it (an index or a region handle).
    pub target: T,
}

impl<T> Range<T> {
    fn end(&self) -> u64 {
        self.vmm_start + self.len
    }
}

/// Where a VMM address lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit<'a, T> {
    /// The range holding it.
    pub range: &'a Range<T>,
    /// Offset of the address in the target.
    pub target_offset: u64,
}

/// Ranges sorted by `vmm_start`, never overlapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeTable<T> {
    ranges: Vec<Range<T>>,
}

/// Why a table could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// A range is empty or wraps around the address space.
    #[error("range at {vmm_start:#x} of {len:#x} bytes is empty or wraps")]
    Bad {
        /// Start.
        vmm_start: u64,
        /// Length.
        len: u64,
    },
    /// Two ranges overlap.
    #[error("ranges at {a:#x} and {b:#x} overlap")]
    Overlap {
        /// First start.
        a: u64,
        /// Second start.
        b: u64,
    },
}

impl<T: Clone> RangeTable<T> {
    /// A table of `ranges` (any order); refuses empty, wrapping or
    /// overlapping ranges.
    ///
    /// # Errors
    ///
    /// [`TableError`].
    pub fn new(mut ranges: Vec<Range<T>>) -> Result<Self, TableError> {
        for r in &ranges {
            if r.len == 0 || r.vmm_start.checked_add(r.len).is_none() {
                return Err(TableError::Bad {
                    vmm_start: r.vmm_start,
                    len: r.len,
                });
            }
        }
        ranges.sort_by_key(|r| r.vmm_start);
        for w in ranges.windows(2) {
            if w[0].end() > w[1].vmm_start {
                return Err(TableError::Overlap {
                    a: w[0].vmm_start,
                    b: w[1].vmm_start,
                });
            }
        }
        Ok(Self { ranges })
    }

    /// The ranges, by address.
    pub fn ranges(&self) -> &[Range<T>] {
        &self.ranges
    }

    /// True when no range is left (the VMM unmapped everything).
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The range holding `addr`, and the address's offset in the target.
    pub fn lookup(&self, addr: u64) -> Option<Hit<'_, T>> {
        let i = self.ranges.partition_point(|r| r.vmm_start <= addr);
        let range = self.ranges.get(i.checked_sub(1)?)?;
        (addr < range.end()).then(|| Hit {
            range,
            target_offset: range.offset + (addr - range.vmm_start),
        })
    }

    /// VMM addresses of target bytes `[offset, offset + len)` of `target`
    /// (where `same` says two targets are the same): one start address per
    /// range that maps all of them. Usually one.
    pub fn vmm_addrs_of(&self, same: impl Fn(&T) -> bool, offset: u64, len: u64) -> Vec<u64> {
        self.ranges
            .iter()
            .filter(|r| same(&r.target) && r.offset <= offset && offset + len <= r.offset + r.len)
            .map(|r| r.vmm_start + (offset - r.offset))
            .collect()
    }

    /// Drops `[start, end)` (UNMAP); returns the bytes dropped.
    pub fn remove(&mut self, start: u64, end: u64) -> u64 {
        let mut removed = 0;
        let mut out = Vec::with_capacity(self.ranges.len() + 1);
        for r in self.ranges.drain(..) {
            let (lo, hi) = (r.vmm_start.max(start), r.end().min(end));
            if lo >= hi {
                out.push(r);
                continue;
            }
            removed += hi - lo;
            if r.vmm_start < lo {
                out.push(Range {
                    len: lo - r.vmm_start,
                    ..r.clone()
                });
            }
            if hi < r.end() {
                out.push(Range {
                    vmm_start: hi,
                    len: r.end() - hi,
                    offset: r.offset + (hi - r.vmm_start),
                    target: r.target.clone(),
                });
            }
        }
        self.ranges = out;
        removed
    }

    /// Moves `[from, from + len)` to `to` (REMAP); returns the bytes moved.
    /// Whatever was at the destination is dropped first (`mremap` unmaps it).
    pub fn remap(&mut self, from: u64, to: u64, len: u64) -> u64 {
        let (Some(from_end), Some(to_end)) = (from.checked_add(len), to.checked_add(len)) else {
            return 0;
        };
        let moved: Vec<Range<T>> = self
            .ranges
            .iter()
            .filter_map(|r| {
                let (lo, hi) = (r.vmm_start.max(from), r.end().min(from_end));
                (lo < hi).then(|| Range {
                    vmm_start: to + (lo - from),
                    len: hi - lo,
                    offset: r.offset + (lo - r.vmm_start),
                    target: r.target.clone(),
                })
            })
            .collect();
        let bytes = self.remove(from, from_end);
        self.remove(to, to_end);
        self.ranges.extend(moved);
        self.ranges.sort_by_key(|r| r.vmm_start);
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 2 << 20;

    fn r(vmm_start: u64, len: u64, offset: u64, target: u32) -> Range<u32> {
        Range {
            vmm_start,
            len,
            offset,
            target,
        }
    }

    #[test]
    fn lookup_finds_the_range_and_offset() {
        let t =
            RangeTable::new(vec![r(10 * M, 4 * M, 0, 1), r(0, 2 * M, 2 * M, 0)]).expect("table");
        assert_eq!(t.ranges()[0].target, 0, "sorted by address");
        let hit = t.lookup(M + 5).expect("in range 0");
        assert_eq!((hit.range.target, hit.target_offset), (0, 3 * M + 5));
        assert_eq!(t.lookup(12 * M).expect("in range 1").target_offset, 2 * M);
        assert!(t.lookup(2 * M).is_none(), "end is exclusive");
        assert!(t.lookup(9 * M).is_none());
        assert!(t.lookup(14 * M).is_none());
        assert!(t.lookup(u64::MAX).is_none());
        assert_eq!(t.vmm_addrs_of(|x| *x == 1, M, M), vec![11 * M]);
        assert!(t.vmm_addrs_of(|x| *x == 1, 4 * M, M).is_empty());
    }

    #[test]
    fn bad_tables_are_refused() {
        assert!(matches!(
            RangeTable::new(vec![r(0, 0, 0, 0)]),
            Err(TableError::Bad { .. })
        ));
        assert!(matches!(
            RangeTable::new(vec![r(u64::MAX - 1, 4, 0, 0)]),
            Err(TableError::Bad { .. })
        ));
        assert!(matches!(
            RangeTable::new(vec![r(0, 4 * M, 0, 0), r(3 * M, M, 0, 1)]),
            Err(TableError::Overlap { .. })
        ));
    }

    #[test]
    fn unmap_splits_ranges() {
        let mut t =
            RangeTable::new(vec![r(0, 8 * M, 0, 0), r(10 * M, 2 * M, 0, 1)]).expect("table");
        assert_eq!(t.remove(2 * M, 4 * M), 2 * M);
        assert_eq!(
            t.ranges(),
            &[
                r(0, 2 * M, 0, 0),
                r(4 * M, 4 * M, 4 * M, 0),
                r(10 * M, 2 * M, 0, 1)
            ]
        );
        assert!(t.lookup(3 * M).is_none());
        assert_eq!(
            t.lookup(5 * M).expect("after the hole").target_offset,
            5 * M
        );
        assert_eq!(t.remove(7 * M, 11 * M), 2 * M);
        assert_eq!(
            t.ranges(),
            &[
                r(0, 2 * M, 0, 0),
                r(4 * M, 3 * M, 4 * M, 0),
                r(11 * M, M, M, 1)
            ]
        );
        assert_eq!(t.remove(0, u64::MAX), 6 * M);
        assert!(t.is_empty());
    }

    #[test]
    fn remap_moves_and_replaces() {
        let mut t =
            RangeTable::new(vec![r(0, 4 * M, 0, 0), r(20 * M, 2 * M, 0, 1)]).expect("table");
        // Move the middle two pages of range 0 over range 1.
        assert_eq!(t.remap(M, 20 * M, 2 * M), 2 * M);
        assert_eq!(
            t.ranges(),
            &[r(0, M, 0, 0), r(3 * M, M, 3 * M, 0), r(20 * M, 2 * M, M, 0)]
        );
        assert_eq!(t.lookup(21 * M).expect("moved").target_offset, 2 * M);
        // Remapping nothing moves nothing; overflow is ignored.
        assert_eq!(t.remap(40 * M, 50 * M, M), 0);
        assert_eq!(t.remap(u64::MAX, 0, 2), 0);
    }
}
