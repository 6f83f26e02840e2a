//! Stamps that show whether memory survived a move intact.
//!
//! Every 4 KiB of a range gets a 32-byte stamp at its start and another at
//! its end, each derived from a seed and the stamp's own offset. A page that
//! moved with its data keeps every stamp; a page that came back zeroed, a
//! page swapped with another, or a copy cut short does not. Writing two
//! stamps per 4 KiB instead of a full pattern keeps the check fast enough for
//! gigabytes under TCG emulation, where a full write and compare of 1 GiB
//! takes seconds.

/// Bytes in one stamp.
pub const STAMP: usize = 32;
/// Distance between stamp pairs.
const STRIDE: u64 = 4096;

/// The stamp for `offset` under `seed`.
pub fn stamp(seed: u64, offset: u64) -> [u8; STAMP] {
    let mix = (seed ^ offset.rotate_left(17)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let words = [seed, offset, !offset ^ seed, mix];
    let mut out = [0u8; STAMP];
    for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// Offsets of the stamps in a range of `len` bytes (a multiple of 4 KiB):
/// the start and the last 32 bytes of every 4 KiB.
pub fn offsets(len: u64) -> impl Iterator<Item = u64> {
    (0..len / STRIDE).flat_map(|i| {
        let base = i * STRIDE;
        [base, base + STRIDE - STAMP as u64]
    })
}

/// Writes every stamp of `len` bytes through `put(offset, stamp)`.
pub fn write<E>(
    len: u64,
    seed: u64,
    mut put: impl FnMut(u64, &[u8; STAMP]) -> Result<(), E>,
) -> Result<(), E> {
    for off in offsets(len) {
        put(off, &stamp(seed, off))?;
    }
    Ok(())
}

/// Reads every stamp through `get(offset, buf)`; the first offset whose
/// stamp is wrong, or `None` when all match.
pub fn check<E>(
    len: u64,
    seed: u64,
    mut get: impl FnMut(u64, &mut [u8; STAMP]) -> Result<(), E>,
) -> Result<Option<u64>, E> {
    let mut buf = [0u8; STAMP];
    for off in offsets(len) {
        get(off, &mut buf)?;
        if buf != stamp(seed, off) {
            return Ok(Some(off));
        }
    }
    Ok(None)
}

/// Index conversion for the slice helpers: offsets come from [`offsets`] of
/// a length that fits the slice.
fn at(offset: u64) -> usize {
    usize::try_from(offset).unwrap_or(usize::MAX)
}

/// Writes the stamps into `buf`.
pub fn write_slice(buf: &mut [u8], seed: u64) {
    let r: Result<(), ()> = write(buf.len() as u64, seed, |off, s| {
        buf[at(off)..at(off) + STAMP].copy_from_slice(s);
        Ok(())
    });
    debug_assert!(r.is_ok());
}

/// The first wrong stamp in `buf`, if any.
pub fn check_slice(buf: &[u8], seed: u64) -> Option<u64> {
    let r: Result<Option<u64>, ()> = check(buf.len() as u64, seed, |off, out| {
        out.copy_from_slice(&buf[at(off)..at(off) + STAMP]);
        Ok(())
    });
    r.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_detect_zeroing_swaps_and_truncation() {
        let len = 64 << 10;
        let mut buf = vec![0u8; len];
        write_slice(&mut buf, 7);
        assert_eq!(check_slice(&buf, 7), None);
        assert_eq!(check_slice(&buf, 8), Some(0), "another seed");
        // A zeroed 4 KiB page.
        let mut zeroed = buf.clone();
        zeroed[8192..12288].fill(0);
        assert_eq!(check_slice(&zeroed, 7), Some(8192));
        // Two pages swapped.
        let mut swapped = buf.clone();
        let (a, b) = swapped.split_at_mut(4096);
        a.swap_with_slice(&mut b[..4096]);
        assert_eq!(check_slice(&swapped, 7), Some(0));
        // A copy cut short: the tail stamp of a page is wrong.
        let mut short = buf.clone();
        short[4096 * 3 + 4095] ^= 1;
        assert_eq!(check_slice(&short, 7), Some(4096 * 3 + 4064));
    }

    #[test]
    fn two_stamps_per_4k() {
        assert_eq!(offsets(8192).collect::<Vec<_>>(), vec![0, 4064, 4096, 8160]);
        assert_eq!(offsets(0).count(), 0);
        assert_ne!(stamp(1, 0), stamp(1, 4096));
    }
}
