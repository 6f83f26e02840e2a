//! Compact encodings the state document uses inside its JSON: page states
//! as one digit each, bytes as hex. The components use them to save and
//! restore their own states.

use super::error::DecodeError;

/// Page states as one digit each.
pub fn encode_pages(states: &[guest_mem::PageState]) -> String {
    states.iter().map(|s| char::from(b'0' + *s as u8)).collect()
}

/// The inverse of [`encode_pages`].
///
/// # Errors
///
/// A character that is not a page state.
pub fn decode_pages(text: &str) -> Result<Vec<guest_mem::PageState>, DecodeError> {
    use guest_mem::PageState;
    text.bytes()
        .map(|b| {
            PageState::ALL
                .iter()
                .copied()
                .find(|s| *s as u8 + b'0' == b)
                .ok_or(DecodeError::PageState(char::from(b)))
        })
        .collect()
}

/// Bytes as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The inverse of [`hex`].
///
/// # Errors
///
/// Odd length or a non-hex digit.
pub fn unhex(text: &str) -> Result<Vec<u8>, DecodeError> {
    if !text.len().is_multiple_of(2) {
        return Err(DecodeError::OddHex);
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or(DecodeError::BadHex)
        })
        .collect()
}
