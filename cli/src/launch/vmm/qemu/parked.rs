//! What the daemon keeps of a parked QEMU VM, in the documents a park
//! carries (the daemon's PARK speaks cloud-hypervisor's local migration,
//! `Start → MemoryFd ×N → Config → State → Complete`, and checks only the
//! configuration's `memory_manager_data.guest_ram_mappings`, the memory
//! fds and the bounds; it stores the rest as it came):
//!
//! - the configuration ([`ParkedConfig`], JSON): `"vmm": "qemu"`, the
//!   program and the user's arguments as the launcher ran them (without
//!   hugemem's memory options), one entry per memory region (size, node),
//!   and one guest RAM mapping per region (slot `i`, its whole file);
//! - the state ([`ParkedState`], JSON): QEMU's migration stream (its device
//!   state; `x-ignore-shared` leaves the guest RAM out), base64-encoded,
//!   since the daemon keeps the state as UTF-8.

use std::ffi::OsString;

use serde::{Deserialize, Serialize};

/// The `vmm` field of a QEMU VM's configuration.
pub const VMM_QEMU: &str = "qemu";

/// The format's version.
pub const FORMAT: u32 = 1;

/// QEMU's migration stream may take at most this many bytes: its base64
/// text and the document around it stay under the daemon's 64 MiB bound
/// on a state.
pub const MAX_STREAM: usize = 44 << 20;

/// One memory region of the parked VM, in hugemem's order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedRegion {
    /// Bytes.
    pub size: u64,
    /// The host node it was bound to.
    pub node: Option<u32>,
}

/// One guest RAM mapping, as the daemon checks them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestRamMapping {
    /// The memory slot (the region's index).
    pub slot: u32,
    /// The region's offset in hugemem's order (QEMU places the regions in
    /// guest-physical space itself).
    pub gpa: u64,
    /// Bytes.
    pub size: u64,
    /// Where in the slot's file (0: the whole file).
    pub file_offset: u64,
}

/// The mappings, where the daemon looks for them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryManagerData {
    /// One per region.
    pub guest_ram_mappings: Vec<GuestRamMapping>,
}

/// A parked QEMU VM's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedConfig {
    /// Always [`VMM_QEMU`].
    pub vmm: String,
    /// [`FORMAT`].
    pub format: u32,
    /// The QEMU program the VM ran in.
    pub program: String,
    /// The user's arguments (without hugemem's memory options).
    pub args: Vec<String>,
    /// The memory regions, in hugemem's order.
    pub regions: Vec<ParkedRegion>,
    /// For the daemon's checks.
    pub memory_manager_data: MemoryManagerData,
}

/// A parked QEMU VM's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedState {
    /// Always [`VMM_QEMU`].
    pub vmm: String,
    /// The stream's bytes.
    pub bytes: u64,
    /// QEMU's migration stream, base64 (RFC 4648, with padding).
    pub migration_stream: String,
}

/// Why a parked VM's documents cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
    /// Not JSON of the expected shape.
    #[error("the parked VM's {what} is not a QEMU VM's: {source}")]
    Shape {
        /// Which document.
        what: &'static str,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// Another VMM's VM, or another format.
    #[error("the parked VM is {0}")]
    NotQemu(String),
    /// The stream does not decode, or its length is not what it says.
    #[error("the parked VM's QEMU migration stream is damaged: {0}")]
    Stream(String),
    /// An argument that is not UTF-8.
    #[error("QEMU argument {0:?} is not UTF-8: a parked VM keeps its command line as text")]
    NotUtf8(OsString),
}

impl ParkedConfig {
    /// The configuration of a VM running `program` with `args` on `regions`.
    ///
    /// # Errors
    ///
    /// [`ParkedError::NotUtf8`] for an argument that is not text.
    pub fn new(
        program: &OsString,
        args: &[OsString],
        regions: Vec<ParkedRegion>,
    ) -> Result<Self, ParkedError> {
        let text = |a: &OsString| {
            a.to_str()
                .map(str::to_owned)
                .ok_or_else(|| ParkedError::NotUtf8(a.clone()))
        };
        let mut gpa = 0;
        let mut mappings = Vec::with_capacity(regions.len());
        for (slot, r) in (0u32..).zip(&regions) {
            mappings.push(GuestRamMapping {
                slot,
                gpa,
                size: r.size,
                file_offset: 0,
            });
            gpa += r.size;
        }
        Ok(Self {
            vmm: VMM_QEMU.into(),
            format: FORMAT,
            program: text(program)?,
            args: args.iter().map(text).collect::<Result<_, _>>()?,
            regions,
            memory_manager_data: MemoryManagerData {
                guest_ram_mappings: mappings,
            },
        })
    }

    /// Reads a parked VM's configuration.
    ///
    /// # Errors
    ///
    /// [`ParkedError`]: not a QEMU VM's (a cloud-hypervisor VM's names no
    /// `vmm`), or not of this format.
    pub fn parse(config: &[u8]) -> Result<Self, ParkedError> {
        let probe: serde_json::Value =
            serde_json::from_slice(config).map_err(|source| ParkedError::Shape {
                what: "configuration",
                source,
            })?;
        match probe.get("vmm").and_then(serde_json::Value::as_str) {
            Some(VMM_QEMU) => {}
            Some(other) => return Err(ParkedError::NotQemu(format!("a {other} VM"))),
            None => {
                return Err(ParkedError::NotQemu(
                    "a cloud-hypervisor VM: restore it with cloud-hypervisor".into(),
                ))
            }
        }
        let parsed: Self = serde_json::from_value(probe).map_err(|source| ParkedError::Shape {
            what: "configuration",
            source,
        })?;
        if parsed.format != FORMAT {
            return Err(ParkedError::NotQemu(format!(
                "of format {} (this hugemem reads {FORMAT})",
                parsed.format
            )));
        }
        Ok(parsed)
    }
}

impl ParkedState {
    /// The state holding `stream`.
    pub fn new(stream: &[u8]) -> Self {
        Self {
            vmm: VMM_QEMU.into(),
            bytes: stream.len() as u64,
            migration_stream: base64_encode(stream),
        }
    }

    /// QEMU's migration stream out of a parked VM's state.
    ///
    /// # Errors
    ///
    /// [`ParkedError`]: not a QEMU state, or a stream that does not decode
    /// to its stated length.
    pub fn stream(state: &[u8]) -> Result<Vec<u8>, ParkedError> {
        let parsed: Self = serde_json::from_slice(state).map_err(|source| ParkedError::Shape {
            what: "state",
            source,
        })?;
        if parsed.vmm != VMM_QEMU {
            return Err(ParkedError::NotQemu(format!("a {} VM", parsed.vmm)));
        }
        let stream = base64_decode(&parsed.migration_stream)
            .ok_or_else(|| ParkedError::Stream("not base64".into()))?;
        if stream.len() as u64 != parsed.bytes || stream.len() > MAX_STREAM {
            return Err(ParkedError::Stream(format!(
                "{} bytes, the state says {} (at most {MAX_STREAM})",
                stream.len(),
                parsed.bytes
            )));
        }
        Ok(stream)
    }
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// RFC 4648 base64 with padding.
pub fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes [`base64_encode`]'s text; `None` for anything else.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let value = |c: u8| ALPHABET.iter().position(|&a| a == c).map(|p| p as u32);
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    let quads = bytes.len() / 4;
    for (q, quad) in bytes.chunks(4).enumerate() {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && q + 1 != quads) {
            return None;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            n = (n << 6) | value(c)?;
        }
        n <<= 6 * pad as u32;
        let decoded = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&decoded[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_refuses_garbage() {
        for n in 0..40usize {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            let text = base64_encode(&bytes);
            assert_eq!(base64_decode(&text).as_deref(), Some(&bytes[..]), "{n}");
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        for bad in ["Zm9", "Zm=v", "Z===", "Zm8=Zm8=", "Zm9v!A=="] {
            assert!(base64_decode(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn documents_round_trip_and_name_other_vmms() {
        let config = ParkedConfig::new(
            &"qemu-system-x86_64".into(),
            &["-M".into(), "microvm".into()],
            vec![
                ParkedRegion {
                    size: 2 << 20,
                    node: None,
                },
                ParkedRegion {
                    size: 4 << 20,
                    node: Some(1),
                },
            ],
        )
        .expect("config");
        let maps = &config.memory_manager_data.guest_ram_mappings;
        assert_eq!(
            (maps[1].slot, maps[1].gpa, maps[1].size),
            (1, 2 << 20, 4 << 20)
        );
        let text = serde_json::to_vec(&config).expect("json");
        assert_eq!(ParkedConfig::parse(&text).expect("parse"), config);
        let ch = br#"{"cpus":{},"memory_manager_data":{"guest_ram_mappings":[]}}"#;
        let err = ParkedConfig::parse(ch).expect_err("a cloud-hypervisor VM");
        assert!(err.to_string().contains("cloud-hypervisor"), "{err}");
        let state = serde_json::to_vec(&ParkedState::new(b"QEVM\0\0\0\x03")).expect("json");
        assert_eq!(
            ParkedState::stream(&state).expect("stream"),
            b"QEVM\0\0\0\x03"
        );
        let forged = br#"{"vmm":"qemu","bytes":5,"migration_stream":"QUJD"}"#;
        assert!(ParkedState::stream(forged).is_err());
    }
}
