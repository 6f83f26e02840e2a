//! Request validation that needs more than the payload: what the daemon
//! checks on a decoded request against its own state before acting on it,
//! kept here (pure, no daemon types) so the fuzzer runs the daemon's code.

use super::messages::RegionInfo;
use super::messages::UffdRange;

/// Why a UFFD request's ranges were refused (the text of the INVALID reply).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UffdRangeError {
    /// No range at all.
    #[error("UFFD needs at least one range")]
    NoRange,
    /// A range names a region the allocation does not have.
    #[error("range {index}: region {region_id} is not in this allocation")]
    NotInAllocation {
        /// The range's place in the request.
        index: usize,
        /// The region it names.
        region_id: u64,
    },
    /// A range names a region that is not lazy.
    #[error("range {index}: region {region_id} is not lazy")]
    NotLazy {
        /// The range's place in the request.
        index: usize,
        /// The region it names.
        region_id: u64,
    },
    /// A range names a region not on huge pages.
    #[error(
        "range {index}: region {region_id} has {page_size}-byte pages; lazy mode needs huge pages"
    )]
    NotHugePages {
        /// The range's place in the request.
        index: usize,
        /// The region it names.
        region_id: u64,
        /// The region's page size.
        page_size: u64,
    },
    /// An empty range, or one not aligned to the region's pages.
    #[error("range {index}: offset, address and length must be multiples of {page_size} bytes")]
    Misaligned {
        /// The range's place in the request.
        index: usize,
        /// The region's page size.
        page_size: u64,
    },
    /// A range that runs past its region's end.
    #[error(
        "range {index}: {len} bytes at offset {offset} run past region {region_id} ({size} bytes)"
    )]
    PastTheEnd {
        /// The range's place in the request.
        index: usize,
        /// Its length.
        len: u64,
        /// Its offset in the region.
        offset: u64,
        /// The region it names.
        region_id: u64,
        /// The region's size.
        size: u64,
    },
}

/// Checks a UFFD request's ranges against the allocation's region table
/// (the part of the request's validation that needs the regions; the
/// decoder already refused empty, wrapping and overlapping ranges): every
/// range names a LAZY region of the allocation, on huge pages, with offset,
/// address and length aligned to its page size and `offset + len` inside it.
/// Pure: the daemon's lazy-mode handler calls it on every UFFD request
/// before it touches the uffd, and the fuzzer (`fuzz/`, target
/// `uffd_request`) runs the same function on hostile input.
///
/// # Errors
///
/// [`UffdRangeError`]: the reason, for an INVALID reply.
pub fn check_uffd_ranges(
    ranges: &[UffdRange],
    regions: &[RegionInfo],
) -> Result<(), UffdRangeError> {
    if ranges.is_empty() {
        return Err(UffdRangeError::NoRange);
    }
    for (index, r) in ranges.iter().enumerate() {
        let region_id = r.region_id;
        let Some(info) = regions.iter().find(|g| g.region_id == region_id) else {
            return Err(UffdRangeError::NotInAllocation { index, region_id });
        };
        if info.flags & RegionInfo::FLAG_LAZY == 0 {
            return Err(UffdRangeError::NotLazy { index, region_id });
        }
        let page_size = info.page_size;
        if !matches!(guest_mem::PageSize::from_bytes(page_size), Some(p) if p.is_huge()) {
            return Err(UffdRangeError::NotHugePages {
                index,
                region_id,
                page_size,
            });
        }
        if r.len == 0
            || r.offset % page_size != 0
            || r.vmm_addr % page_size != 0
            || r.len % page_size != 0
        {
            return Err(UffdRangeError::Misaligned { index, page_size });
        }
        if r.offset
            .checked_add(r.len)
            .is_none_or(|end| end > info.size)
        {
            return Err(UffdRangeError::PastTheEnd {
                index,
                len: r.len,
                offset: r.offset,
                region_id,
                size: info.size,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const M2: u64 = 2 << 20;

    fn region(id: u64, size: u64, page_size: u64, flags: u32) -> RegionInfo {
        RegionInfo {
            region_id: id,
            guest_phys: 0,
            size,
            page_size,
            node: 0,
            flags,
        }
    }

    #[test]
    fn uffd_ranges_are_checked_against_the_regions() {
        let regions = [
            region(1, 8 * M2, M2, RegionInfo::FLAG_LAZY),
            region(2, 4 * M2, M2, RegionInfo::FLAG_CLEAN),
        ];
        let r = |region_id, offset, vmm_addr, len| UffdRange {
            region_id,
            offset,
            vmm_addr,
            len,
        };
        assert_eq!(
            check_uffd_ranges(&[r(1, 0, 0x4000_0000, 8 * M2)], &regions),
            Ok(())
        );
        assert_eq!(
            check_uffd_ranges(
                &[r(1, 0, 0, 2 * M2), r(1, 4 * M2, 16 * M2, 4 * M2)],
                &regions
            ),
            Ok(())
        );
        use UffdRangeError::*;
        let not_in = NotInAllocation {
            index: 0,
            region_id: 3,
        };
        let misaligned = Misaligned {
            index: 0,
            page_size: M2,
        };
        let past = |offset, len| PastTheEnd {
            index: 0,
            len,
            offset,
            region_id: 1,
            size: 8 * M2,
        };
        for (bad, why) in [
            (vec![], NoRange),
            (vec![r(3, 0, 0, M2)], not_in),
            (
                vec![r(2, 0, 0, M2)],
                NotLazy {
                    index: 0,
                    region_id: 2,
                },
            ),
            (vec![r(1, 4096, 0, M2)], misaligned.clone()), // offset
            (vec![r(1, 0, 4096, M2)], misaligned.clone()), // address
            (vec![r(1, 0, 0, M2 + 4096)], misaligned.clone()), // length
            (vec![r(1, 0, 0, 0)], misaligned),             // empty
            (vec![r(1, 6 * M2, 0, 4 * M2)], past(6 * M2, 4 * M2)),
            (
                vec![r(1, u64::MAX - M2 + 1, 0, 2 * M2)],
                past(u64::MAX - M2 + 1, 2 * M2),
            ),
        ] {
            assert_eq!(check_uffd_ranges(&bad, &regions), Err(why), "{bad:?}");
        }
        let small = [region(5, 8 << 20, 4096, RegionInfo::FLAG_LAZY)];
        assert_eq!(
            check_uffd_ranges(&[r(5, 0, 0, 4096)], &small),
            Err(NotHugePages {
                index: 0,
                region_id: 5,
                page_size: 4096
            }),
            "4 KiB pages"
        );
    }
}
