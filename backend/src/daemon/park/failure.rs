//! What a tenant reads when its VM's files could not be read (a disk
//! error, a file truncated meanwhile): the fill engine's error with its
//! causes, and the file it came from, by its path.

use std::os::fd::{AsRawFd, BorrowedFd};

use guest_mem::FillError;

/// The source a fill error names, if any.
fn source_index(e: &FillError) -> Option<usize> {
    match e {
        FillError::Stat { index, .. }
        | FillError::NotRegular { index, .. }
        | FillError::OutOfRegion { index, .. }
        | FillError::FileRange { index, .. }
        | FillError::TooShort { index, .. }
        | FillError::ShortRead { index, .. }
        | FillError::Read { index, .. }
        | FillError::Seek { index, .. } => Some(*index),
        _ => None,
    }
}

/// The innermost fill error in `e`'s chain (the runner wraps a worker's).
fn innermost(e: &FillError) -> &FillError {
    let mut found = e;
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(f) = c.downcast_ref::<FillError>() {
            found = f;
        }
        cur = c.source();
    }
    found
}

/// `e` with its causes, and the path of the file its source reads
/// (`file_of(source)`, as this process's `/proc/self/fd` names it).
pub fn describe<'a>(e: &FillError, file_of: impl Fn(usize) -> Option<BorrowedFd<'a>>) -> String {
    let mut text = hugemem_client::diag::chain(e);
    if let Some((index, fd)) = source_index(innermost(e)).and_then(|i| Some((i, file_of(i)?))) {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        if let Ok(path) = link {
            text.push_str(&format!(" (source {index} is {})", path.display()));
        }
    }
    text
}
