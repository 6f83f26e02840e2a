//! What the tests of tokens share (REATTACH, HANDOFF): a small 4 KiB
//! ALLOC, this process's uid, and refusal messages compared without the id.

use backend::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};

/// An eager ALLOC of `size` bytes of 4 KiB pages on node 0 (no huge pages
/// needed where the page size does not matter).
pub fn req_4k(size: u64) -> AllocRequest {
    AllocRequest {
        total_size: size,
        page_policy: PagePolicy::Base4K,
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: vec![AllocPart { node: 0, size }],
        want_paths: false,
    }
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A refusal's message with the allocation id taken out, so refusals of
/// different ids compare (they must read alike).
pub fn without_id(message: &str, id: u64) -> String {
    message.replace(&id.to_string(), "<id>")
}
