//! Byte sizes and rates, one syntax and one format for the whole project:
//! the CLI, the daemon's configuration and messages, byte ranges of
//! REBALANCE, benchmark reports. Sizes: `1G`, `512M`, `4K`, `2GiB`,
//! `1073741824`, `0x200000`; suffixes are binary (K = 1024).

/// Errors parsing a size.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    /// Not a number (decimal, or hex with `0x`) with an optional K/M/G/T suffix.
    #[error("invalid size {0:?}: expected a number (decimal or 0x hex) with an optional K, M, G or T suffix (powers of 1024)")]
    Invalid(String),
    /// Larger than 2^64 bytes.
    #[error("size {0:?} does not fit in 64 bits")]
    Overflow(String),
}

/// Parses a size in bytes; suffixes are binary (K = 1024).
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let invalid = || SizeError::Invalid(text.to_string());
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let (digits, radix) = match digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        Some(hex) => (hex, 16),
        None => (digits, 10),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(invalid());
    }
    let value =
        u64::from_str_radix(digits, radix).map_err(|_| SizeError::Overflow(text.to_string()))?;
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::Overflow(text.to_string()))
}

/// Formats bytes with the largest exact binary unit (`1G`, `512M`, `4097`).
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// GB/s (10^9 bytes per second) of `bytes` in `seconds`; 0 for no time.
pub fn gb_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        // Precision loss above 2^53 bytes is irrelevant for a rate.
        #[allow(clippy::cast_precision_loss)]
        let b = bytes as f64;
        b / 1e9 / seconds
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("12345"), Ok(12345));
        assert_eq!(parse_size(" 8G "), Ok(8 << 30));
        assert_eq!(parse_size("0x200000"), Ok(2 << 20));
        assert_eq!(parse_size("0x2M"), Ok(2 << 20));
    }

    #[test]
    fn rates() {
        assert_eq!(gb_per_s(2_000_000_000, 2.0), 1.0);
        assert_eq!(gb_per_s(1, 0.0), 0.0);
    }

    #[test]
    fn rejects_bad_sizes() {
        for bad in ["", "G", "1.5G", "-1G", "1X", "one", "0x", "0xZ"] {
            assert!(
                matches!(parse_size(bad), Err(SizeError::Invalid(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            parse_size("99999999999T"),
            Err(SizeError::Overflow(_))
        ));
    }

    #[test]
    fn formats_sizes() {
        assert_eq!(format_size(1 << 30), "1G");
        assert_eq!(format_size(3 << 20), "3M");
        assert_eq!(format_size(4097), "4097");
        assert_eq!(format_size(0), "0");
    }
}
