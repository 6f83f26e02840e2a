//! End-to-end tests of hugemem live in `tests/`; this library is empty on purpose.
//!
//! The tests drive the real binary (`hugemem`) and the real kernel interfaces
//! (hugetlb, userfaultfd, KVM); a test whose prerequisite is missing prints why
//! and skips rather than passing silently.
