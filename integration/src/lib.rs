//! End-to-end tests of hugemem live in `tests/`; this library holds the
//! checks they share with the multi-node QEMU guest ([`checks`]).
//!
//! The tests drive the real binary (`hugemem`) and the real kernel interfaces
//! (hugetlb, userfaultfd, KVM); a test whose prerequisite is missing prints why
//! and skips rather than passing silently.

pub mod checks;
pub mod structure;
