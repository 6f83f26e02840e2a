//! What every component saves into the state document (a takeover's, the
//! fd store's) and restores from it, below the takeover and every
//! component: the compact encodings inside the JSON and the fd list the
//! document names its fds by.

pub mod encoding;
pub mod fds;
