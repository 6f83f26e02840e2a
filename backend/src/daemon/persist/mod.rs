//! What every component saves into the state document (a takeover's, the
//! fd store's) and restores from it, below the takeover and every
//! component: the compact encodings inside the JSON and the fd list the
//! document names its fds by, and the one interface every component saves
//! and restores through ([`Persist`]).

pub mod component;
pub mod encoding;
pub mod error;
pub mod fds;

pub use component::{Persist, RestoreContext, SaveContext};
pub use error::{DecodeError, SaveError};
