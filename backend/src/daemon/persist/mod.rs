//! What every component saves into the state document (a takeover's, the
//! fd store's) and restores from it, below the takeover and every
//! component: the compact encodings inside the JSON and the fd list the
//! document names its fds by.

pub mod encoding;
pub mod fds;

use std::io;

/// Why a component's part could not be written into a state document.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// An fd the document names could not be duplicated for the successor.
    #[error("cannot duplicate an fd for the state document")]
    DupFd(#[source] io::Error),
}

/// Why a field of a state document does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A character that is not a page state.
    #[error("page state {0:?}")]
    PageState(char),
    /// Hex of odd length.
    #[error("odd-length hex")]
    OddHex,
    /// A character that is not a hex digit.
    #[error("bad hex")]
    BadHex,
}
