//! How many fds each request carries, as data: the request table of
//! `docs/protocol.md` (its payload column says which requests carry fds,
//! and which flags add one), one rule per code.

use super::header::Code;
use super::header::MAX_FDS;
use super::messages::{PARK_FLAG_VERIFY, RESTORE_FLAG_POSTCOPY};

/// The fds a request carries: `base`, plus one for each bit of `per_flag`
/// set in the request's flags word ([`Request::flags`](super::messages::Request::flags)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdRule {
    /// Fds every request of the code carries.
    pub base: usize,
    /// Flag bits that each add one fd when set.
    pub per_flag: u32,
}

impl FdRule {
    /// No fds, whatever the flags.
    pub const NONE: FdRule = FdRule {
        base: 0,
        per_flag: 0,
    };

    /// Exactly one fd, whatever the flags.
    pub const ONE: FdRule = FdRule {
        base: 1,
        per_flag: 0,
    };

    /// The fds a request with these flags carries.
    pub const fn count(self, flags: u32) -> usize {
        self.base + (flags & self.per_flag).count_ones() as usize
    }

    /// The most fds any request of the code carries (every flag set).
    pub const fn most(self) -> usize {
        self.base + self.per_flag.count_ones() as usize
    }
}

impl Code {
    /// The fds a request of this code carries, as `docs/protocol.md`'s
    /// request table says. No `_` arm: a new code fails to compile here
    /// until its rule is stated.
    pub const fn request_fds(self) -> FdRule {
        match self {
            // The userfaultfd; the migration socket a saver or a clone's
            // launcher receives on.
            Code::Uffd | Code::Export | Code::Clone => FdRule::ONE,
            // The migration socket, and with VERIFY the saved VM's manifest.
            Code::Park => FdRule {
                base: 1,
                per_flag: PARK_FLAG_VERIFY,
            },
            // The migration socket, and with POSTCOPY the fault connection.
            Code::Restore => FdRule {
                base: 1,
                per_flag: RESTORE_FLAG_POSTCOPY,
            },
            Code::Handshake
            | Code::Alloc
            | Code::Free
            | Code::Lock
            | Code::Unlock
            | Code::Rebalance
            | Code::Stats
            | Code::Reattach
            | Code::Handoff
            | Code::Unpark => FdRule::NONE,
        }
    }
}

// Every request fits in one message: the frame readers refuse a message
// with more than MAX_FDS fds, so a rule above it could never be served.
const _: () = {
    let mut i = 0;
    while i < Code::ALL.len() {
        assert!(Code::ALL[i].request_fds().most() <= MAX_FDS);
        i += 1;
    }
};

#[cfg(test)]
#[path = "fd_rules_tests.rs"]
mod tests;
