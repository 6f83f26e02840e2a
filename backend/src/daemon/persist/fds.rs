//! The fds a state document names, by their index in its fd list: as the
//! writer collects them ([`FdList`]) and as the successor takes them
//! ([`Fds`]). Each component numbers its own fds while saving its state,
//! and takes them back by number while restoring it.

use std::os::fd::{BorrowedFd, OwnedFd};

use super::error::SaveError;

/// The fds a state document names, by index: duplicated for a successor,
/// only numbered for systemd's fd store (which keeps each fd by name, so
/// the periodic sync duplicates nothing).
#[derive(Debug)]
pub struct FdList {
    fds: Option<Vec<OwnedFd>>,
    next: usize,
}

impl FdList {
    /// A list that duplicates each fd (`collect`), or only numbers them.
    pub fn new(collect: bool) -> Self {
        Self {
            fds: collect.then(Vec::new),
            next: 0,
        }
    }

    /// Index of `fd` in the document (and its duplicate when collecting).
    ///
    /// # Errors
    ///
    /// The duplicate cannot be made.
    pub fn add(&mut self, fd: BorrowedFd<'_>) -> Result<usize, SaveError> {
        if let Some(v) = &mut self.fds {
            v.push(fd.try_clone_to_owned().map_err(SaveError::DupFd)?);
        }
        self.next += 1;
        Ok(self.next - 1)
    }

    /// The duplicates, in document order (none when only numbering).
    pub fn into_fds(self) -> Vec<OwnedFd> {
        self.fds.unwrap_or_default()
    }
}

/// The fds that came with a state document (an `Option` each, taken as
/// they are used).
#[derive(Debug, Default)]
pub struct Fds(pub Vec<Option<OwnedFd>>);

impl Fds {
    /// Takes fd `i` (once).
    pub fn take(&mut self, i: usize) -> Option<OwnedFd> {
        self.0.get_mut(i).and_then(Option::take)
    }
}
