//! Everything a daemon-level test file uses, in one `use`.

pub use crate::daemon::*;
pub use crate::hugepages::*;
pub use crate::map::*;
pub use crate::metrics::*;
