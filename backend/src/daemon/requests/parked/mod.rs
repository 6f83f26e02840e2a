//! What the daemon keeps of parked VMs besides their memory: the memory it
//! still has to load from a tenant's files (`loads`, and their part of the
//! state document, `loads_record`), its note of parked VMs on disk (`note`),
//! the parked VMs being saved (`saving`), the shared clones that map
//! a parked VM (`clones`) and the copy clones reading one (`copy_fills`). Below the park room, so that
//! the rooms and STATS read them without importing the room.

pub mod clones;
pub mod copy_fills;
pub mod loads;
pub mod loads_record;
pub mod note;
pub mod saving;
