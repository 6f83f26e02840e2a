//! Why a state document could not be written, or a field of one does not
//! decode.

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
