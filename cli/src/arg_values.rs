//! Value parsers for clap that `hugemem`'s and `hugemem-bench`'s command
//! lines share: sizes, page sizes and page-size policies, with the messages
//! a user sees for a bad value.

use guest_mem::size::parse_size;
use guest_mem::PageSize;
use hugemem_client::proto::PagePolicy;

/// A size with K/M/G suffixes (powers of 1024).
///
/// # Errors
///
/// The parse error, as text for clap.
pub fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// A page size: 1G, 2M or 4K.
///
/// # Errors
///
/// What is expected, as text for clap.
pub fn parse_page_size_arg(s: &str) -> Result<PageSize, String> {
    PageSize::parse(s).ok_or_else(|| format!("invalid page size {s:?}: expected 1G, 2M or 4K"))
}

/// A page-size policy: best, 1G, 2M or 4K.
///
/// # Errors
///
/// What is expected, as text for clap.
pub fn parse_policy_arg(s: &str) -> Result<PagePolicy, String> {
    crate::launch::parse_page_policy(s)
        .ok_or_else(|| format!("invalid page size {s:?}: expected best, 1G, 2M or 4K"))
}
