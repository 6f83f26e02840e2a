//! Byte counts in the configuration.

use std::fmt;

use guest_mem::size::{format_size, parse_size};
use serde::{Deserialize, Deserializer};

/// A byte count that deserializes from an integer or a `"2G"`-style string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ByteSize(pub u64);

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_size(self.0))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(v) => Ok(ByteSize(v)),
            Raw::Text(t) => parse_size(&t)
                .map(ByteSize)
                .map_err(serde::de::Error::custom),
        }
    }
}
