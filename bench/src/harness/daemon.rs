//! A bench's private daemon in its own process: the configuration every
//! bench starts from, and the ALLOC it asks for.

use std::path::PathBuf;

use backend::daemon::{ByteSize, Config};
use backend::proto::{AllocRequest, ClearMode, PagePolicy};
use guest_mem::PageSize;

/// The defaults on `socket`, with a pool that keeps at least `holds`
/// freed bytes (its target and limit raised to it) and looks for other
/// holders every `recheck_ms`.
pub(crate) fn holding(socket: PathBuf, holds: u64, recheck_ms: u64) -> Config {
    let mut config = Config {
        socket,
        ..Config::default()
    };
    config.pool.target = config.pool.target.max(ByteSize(holds));
    config.pool.limit = config.pool.limit.max(ByteSize(holds));
    config.pool.recheck_ms = recheck_ms;
    config
}

/// The ALLOC policy for exactly `page` pages.
pub(crate) fn policy(page: PageSize) -> PagePolicy {
    match page {
        PageSize::Huge1G => PagePolicy::Huge1G,
        PageSize::Huge2M => PagePolicy::Huge2M,
        PageSize::Base4K => PagePolicy::Base4K,
    }
}

/// An eager ALLOC of `size` bytes on exactly `page` pages, unlocked, the
/// daemon placing it (no parts), fds only.
pub(crate) fn eager_request(size: u64, page: PageSize) -> AllocRequest {
    AllocRequest {
        total_size: size,
        page_policy: policy(page),
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: Vec::new(),
        want_paths: false,
    }
}
