//! A dense guest (`bench offload --dense`): before its first park, every
//! byte of guest RAM that the spinning micro-guest neither uses nor checks
//! is filled with incompressible pseudo-random bytes, so that a save
//! writes every page in full (a guest that wrote all its memory), not one
//! word per page and zeros.
//!
//! What the guest keeps to itself (`microguest::spin`): everything below
//! [`IMAGE_END_GPA`] (the firmware's tables below 1 MiB, its own code,
//! parameter block, page tables and stack), and the first 8 bytes of each
//! 4 KiB page above, where it wrote `marker ^ gpa` and checks it on every
//! pass. The rest of each page, bytes 8 to 4096, is filled, in RAM below
//! [`LOW_RAM_END`] (where the memory file's offset is the guest address;
//! the guest touches nothing above the 32-bit hole, which stays a hole).
//!
//! The bytes are a function of the seed and their file offset (SplitMix64
//! of the offset of each 8-byte word), so the host can check them after a
//! restore without keeping a copy ([`stale_pages`]).

use std::fs::File;
use std::os::unix::fs::FileExt;

use guest_mem::PageSize;
use microguest::IMAGE_END_GPA;
use vm_memory::{Bytes, VolatileMemory};

use super::error::OffloadError;

/// The seed of the bytes.
pub(crate) const SEED: u64 = 0x6875_6765_6d65_6d43;
/// cloud-hypervisor's RAM below the 32-bit hole ends here: above, the
/// memory file's offset is no longer the guest address.
pub(crate) const LOW_RAM_END: u64 = 3 << 30;
const PAGE: u64 = 4096;
/// The bytes of each page the guest checks (its `marker ^ gpa` word).
const GUEST_WORD: usize = 8;

/// SplitMix64's output for `x`.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The filled part of the page at file offset `page`: bytes 8 to 4096.
fn page_fill(page: u64, out: &mut [u8; PAGE as usize - GUEST_WORD]) {
    for (i, word) in out.chunks_exact_mut(8).enumerate() {
        let offset = page + (GUEST_WORD + 8 * i) as u64;
        word.copy_from_slice(&splitmix64(SEED ^ offset).to_le_bytes());
    }
}

/// The file offsets of the pages filled in a memory file of `len` bytes.
fn filled_pages(len: u64) -> std::iter::StepBy<std::ops::Range<u64>> {
    (IMAGE_END_GPA..len.min(LOW_RAM_END)).step_by(PAGE as usize)
}

/// Fills guest RAM file `file` (on `page` pages) as the module docs say,
/// while the guest runs; the bytes written.
pub(crate) fn fill(file: &File, page: PageSize) -> Result<u64, OffloadError> {
    let guest = |what: String| OffloadError::Guest(format!("dense fill: {what}"));
    let len = file
        .metadata()
        .map_err(|e| guest(format!("stat: {e}")))?
        .len();
    let end = len.min(LOW_RAM_END);
    // The mapping covers whole huge pages.
    let mapped = end.next_multiple_of(page.bytes()).min(len);
    let copy = file.try_clone().map_err(|e| guest(format!("dup: {e}")))?;
    let map_len = usize::try_from(mapped).map_err(|_| guest("guest RAM over usize".into()))?;
    let region = guest_mem::shared_file_mapping(copy, 0, map_len, page)
        .map_err(|e| guest(format!("cannot map guest RAM: {e}")))?;
    let ram = region.as_volatile_slice();
    let mut bytes = [0u8; PAGE as usize - GUEST_WORD];
    let mut written = 0;
    for at in filled_pages(len) {
        page_fill(at, &mut bytes);
        let offset = usize::try_from(at).map_err(|_| guest("offset over usize".into()))?;
        ram.write_slice(&bytes, offset + GUEST_WORD)
            .map_err(|e| guest(format!("write at {at:#x}: {e}")))?;
        written += bytes.len() as u64;
    }
    Ok(written)
}

/// Pages of guest RAM file `file` below `end` whose filled bytes are not
/// those [`fill`] wrote (read with `pread`, 2 MiB at a time).
pub(crate) fn stale_pages(file: &File, end: u64) -> Result<u64, OffloadError> {
    const CHUNK: u64 = 2 << 20;
    let len = file
        .metadata()
        .map_err(|e| OffloadError::Guest(format!("dense check: stat: {e}")))?
        .len()
        .min(end);
    let mut buf = vec![0u8; CHUNK as usize];
    let mut want = [0u8; PAGE as usize - GUEST_WORD];
    let mut stale = 0;
    let mut pages = filled_pages(len).peekable();
    while let Some(&first) = pages.peek() {
        let chunk_len = CHUNK.min(len - first);
        file.read_exact_at(&mut buf[..chunk_len as usize], first)
            .map_err(|e| OffloadError::Guest(format!("dense check: read at {first:#x}: {e}")))?;
        while let Some(at) = pages.next_if(|&p| p < first + chunk_len) {
            page_fill(at, &mut want);
            let from = (at - first) as usize + GUEST_WORD;
            if buf[from..from + want.len()] != want {
                stale += 1;
            }
        }
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fill_leaves_the_guests_word_and_image_and_reads_back() {
        let fd = nix::sys::memfd::memfd_create(c"dense", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .expect("memfd");
        let file = File::from(fd);
        let len = IMAGE_END_GPA + 16 * PAGE;
        file.set_len(len).expect("size");
        file.write_all_at(&0x55u64.to_le_bytes(), IMAGE_END_GPA)
            .expect("the guest's word");
        assert_eq!(
            stale_pages(&file, len).expect("check"),
            16,
            "not filled yet"
        );
        // A plain memfd maps on 4 KiB pages.
        let written = fill(&file, PageSize::Base4K).expect("fill");
        assert_eq!(written, 16 * (PAGE - GUEST_WORD as u64));
        assert_eq!(stale_pages(&file, len).expect("check"), 0);
        let mut word = [0u8; 8];
        file.read_exact_at(&mut word, IMAGE_END_GPA).expect("read");
        assert_eq!(u64::from_le_bytes(word), 0x55, "the guest's word is kept");
        let mut image = vec![0u8; IMAGE_END_GPA as usize];
        file.read_exact_at(&mut image, 0).expect("read");
        assert!(
            image.iter().all(|b| *b == 0),
            "below the image's end: untouched"
        );
        file.write_all_at(&[0], IMAGE_END_GPA + 3 * PAGE + 100)
            .expect("damage one page");
        assert_eq!(stale_pages(&file, len).expect("check"), 1);
        assert_eq!(
            stale_pages(&file, IMAGE_END_GPA + 3 * PAGE).expect("check"),
            0
        );
    }

    #[test]
    fn the_bytes_do_not_compress_to_repeats() {
        let mut a = [0u8; PAGE as usize - GUEST_WORD];
        let mut b = a;
        page_fill(IMAGE_END_GPA, &mut a);
        page_fill(IMAGE_END_GPA + PAGE, &mut b);
        assert_ne!(a, b);
        let mut words: Vec<&[u8]> = a.chunks_exact(8).collect();
        words.sort_unstable();
        words.dedup();
        assert_eq!(words.len(), a.len() / 8, "no word repeats within a page");
    }
}
