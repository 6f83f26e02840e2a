//! Request validation that needs more than the payload: what the daemon
//! checks on a decoded request against its own state before acting on it,
//! kept here (pure, no daemon types) so the fuzzer runs the daemon's code.

use super::messages::RegionInfo;
use super::messages::UffdRange;

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
/// The reason, for an INVALID reply.
pub fn check_uffd_ranges(
    ranges: &[UffdRange],
    regions: &[RegionInfo],
) -> std::result::Result<(), String> {
    if ranges.is_empty() {
        return Err("UFFD needs at least one range".into());
    }
    for (i, r) in ranges.iter().enumerate() {
        let Some(info) = regions.iter().find(|g| g.region_id == r.region_id) else {
            return Err(format!(
                "range {i}: region {} is not in this allocation",
                r.region_id
            ));
        };
        if info.flags & RegionInfo::FLAG_LAZY == 0 {
            return Err(format!("range {i}: region {} is not lazy", r.region_id));
        }
        let page = info.page_size;
        if !matches!(guest_mem::PageSize::from_bytes(page), Some(p) if p.is_huge()) {
            return Err(format!(
                "range {i}: region {} has {page}-byte pages; lazy mode needs huge pages",
                r.region_id
            ));
        }
        if r.len == 0 || r.offset % page != 0 || r.vmm_addr % page != 0 || r.len % page != 0 {
            return Err(format!(
                "range {i}: offset, address and length must be multiples of {page} bytes"
            ));
        }
        if r.offset
            .checked_add(r.len)
            .is_none_or(|end| end > info.size)
        {
            return Err(format!(
                "range {i}: {} bytes at offset {} run past region {} ({} bytes)",
                r.len, r.offset, r.region_id, info.size
            ));
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
        for bad in [
            vec![],
            vec![r(3, 0, 0, M2)],          // not in the allocation
            vec![r(2, 0, 0, M2)],          // not lazy
            vec![r(1, 4096, 0, M2)],       // misaligned offset
            vec![r(1, 0, 4096, M2)],       // misaligned address
            vec![r(1, 0, 0, M2 + 4096)],   // misaligned length
            vec![r(1, 0, 0, 0)],           // empty
            vec![r(1, 6 * M2, 0, 4 * M2)], // past the end
            vec![r(1, u64::MAX - M2 + 1, 0, 2 * M2)],
        ] {
            assert!(check_uffd_ranges(&bad, &regions).is_err(), "{bad:?}");
        }
        let small = [region(5, 8 << 20, 4096, RegionInfo::FLAG_LAZY)];
        assert!(
            check_uffd_ranges(&[r(5, 0, 0, 4096)], &small).is_err(),
            "4 KiB pages"
        );
    }
}
