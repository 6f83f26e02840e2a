//! Re-attach tokens: every allocation gets a random 16-byte token when it
//! is committed ([`crate::daemon::pool::Pool::commit`]); a client that
//! negotiated `FEATURE_REATTACH` receives it in the ALLOC reply and shows it
//! to take the allocation back after a restart.

/// Length of a re-attach token.
pub const TOKEN_SIZE: usize = hugemem_client::proto::TOKEN_SIZE;

/// A re-attach token.
pub type AllocToken = [u8; TOKEN_SIZE];

/// The kernel's CSPRNG gave no token.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("cannot make a re-attach token: {0}")]
pub struct TokenError(#[source] getrandom::Error);

/// A fresh random token (the kernel's CSPRNG, `getrandom(2)`).
///
/// # Errors
///
/// [`TokenError`] (the ALLOC then fails with INTERNAL).
pub(super) fn new_token() -> Result<AllocToken, TokenError> {
    let mut t = [0u8; TOKEN_SIZE];
    getrandom::fill(&mut t).map_err(TokenError)?;
    Ok(t)
}

/// `a == b` in time independent of where they differ (a token is a
/// secret: an early exit would tell a guesser how many bytes it has right).
pub(super) fn same_token(a: &AllocToken, b: &AllocToken) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // black_box: keep the compiler from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole_and_are_random() {
        let a = [7u8; TOKEN_SIZE];
        let mut b = a;
        assert!(same_token(&a, &b));
        for i in 0..TOKEN_SIZE {
            b = a;
            b[i] ^= 0x80;
            assert!(!same_token(&a, &b), "byte {i}");
        }
        let (x, y) = (new_token().expect("token"), new_token().expect("token"));
        assert_ne!(x, y, "two tokens from the CSPRNG");
    }
}
