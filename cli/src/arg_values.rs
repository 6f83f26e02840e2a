//! Value parsers for clap that `hugemem`'s and `hugemem-bench`'s command
//! lines share: sizes, page sizes and page-size policies, with the messages
//! a user sees for a bad value.

use guest_mem::size::{parse_size, SizeError};
use guest_mem::PageSize;
use hugemem_client::proto::PagePolicy;

/// A bad value; clap prints it after the option's name.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArgValueError {
    /// Not a size.
    #[error(transparent)]
    Size(#[from] SizeError),
    /// Not a page size.
    #[error("invalid page size {0:?}: expected 1G, 2M or 4K")]
    PageSize(String),
    /// Not a page-size policy.
    #[error("invalid page size {0:?}: expected best, 1G, 2M or 4K")]
    Policy(String),
    /// Not a VMM this launcher knows.
    #[error("unknown VMM {0:?}: expected cloud-hypervisor or qemu")]
    Vmm(String),
    /// Not a clone mode.
    #[error("unknown clone mode {0:?}: expected shared or copy")]
    CloneMode(String),
}

/// A size with K/M/G suffixes (powers of 1024).
///
/// # Errors
///
/// [`ArgValueError::Size`].
pub fn parse_size_arg(s: &str) -> Result<u64, ArgValueError> {
    Ok(parse_size(s)?)
}

/// A page size: 1G, 2M or 4K.
///
/// # Errors
///
/// [`ArgValueError::PageSize`].
pub fn parse_page_size_arg(s: &str) -> Result<PageSize, ArgValueError> {
    PageSize::parse(s).ok_or_else(|| ArgValueError::PageSize(s.to_owned()))
}

/// A page-size policy: best, 1G, 2M or 4K.
///
/// # Errors
///
/// [`ArgValueError::Policy`].
pub fn parse_policy_arg(s: &str) -> Result<PagePolicy, ArgValueError> {
    crate::launch::parse_page_policy(s).ok_or_else(|| ArgValueError::Policy(s.to_owned()))
}
