//! QEMU `-object` values in both syntaxes, and what the wrapper does with
//! each memory backend.
//!
//! libvirt 9 writes `-object` as JSON (`{"qom-type":"memory-backend-file",
//! "id":"ram-node0",…}`); older libvirt, and people, write QEMU's key=value
//! form (`memory-backend-file,id=ram-node0,…`, a comma inside a value doubled).
//! Both parse into one [`QemuObject`]: its properties in the order they were
//! written, each a JSON value (a key=value value is a string until a typed
//! accessor reads it), and both are written back in the syntax they came in.
//!
//! [`classify`] is the policy, pure: a memory backend that asked for huge
//! pages is taken ([`Take`]); one that did not is left to QEMU with a note
//! ([`Decision::Leave`]); anything the daemon's memory cannot honestly stand
//! in for is an error ([`ObjectError::Unsupported`]) and the domain does not
//! start.
//!
//! `syntax.rs` parses and writes back; `classify.rs` decides.

mod classify;
mod syntax;
#[cfg(test)]
mod tests;

pub use classify::{classify, Decision, PathInfo, Take};
pub use syntax::{device_driver, ObjectError, QemuObject, Syntax};
