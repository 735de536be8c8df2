//! Shared-token authentication primitives.
//!
//! The daemon compares the token presented by a request with its own in constant time, so that the time a
//! refusal takes says nothing about how much of a guessed token was right.

use subtle::ConstantTimeEq;

/// The metadata key that carries the token on every request.
pub const TOKEN_HEADER: &str = "authorization";

/// The scheme prefix of the header value (`authorization: Bearer <token>`).
pub const BEARER_PREFIX: &str = "Bearer ";

/// A daemon's shared secret. Never printed: `Debug` shows only its length.
#[derive(Clone)]
pub struct Token(Vec<u8>);

impl Token {
    /// Build a token, refusing an empty one (an empty token would accept anybody).
    pub fn new(secret: impl Into<Vec<u8>>) -> Option<Self> {
        let bytes: Vec<u8> = secret.into();
        let trimmed = bytes.trim_ascii();
        if trimmed.is_empty() {
            None
        } else {
            Some(Token(trimmed.to_vec()))
        }
    }

    /// Whether the `authorization` header value presented by a request carries this token.
    /// Runs in time that depends only on the lengths involved, never on the bytes.
    pub fn verify_header(&self, header_value: &[u8]) -> bool {
        let presented = header_value
            .strip_prefix(BEARER_PREFIX.as_bytes())
            .unwrap_or(header_value);
        self.verify(presented)
    }

    /// Constant-time comparison of a presented secret with this token.
    pub fn verify(&self, presented: &[u8]) -> bool {
        bool::from(self.0.as_slice().ct_eq(presented))
    }

    /// The secret itself, for presenting it on a link that carries no header (a worker's peer link).
    pub fn secret(&self) -> &[u8] {
        &self.0
    }

    /// The header value a client sends.
    pub fn header_value(&self) -> String {
        format!("{BEARER_PREFIX}{}", String::from_utf8_lossy(&self.0))
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(<{} bytes>)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_or_blank_token_is_refused() {
        assert!(Token::new("").is_none());
        assert!(Token::new("  \n").is_none());
    }

    #[test]
    fn token_is_trimmed_like_a_token_file() {
        let t = Token::new("s3cret\n").unwrap();
        assert!(t.verify(b"s3cret"));
    }

    #[test]
    fn verify_accepts_only_the_exact_token() {
        let t = Token::new("abc").unwrap();
        assert!(t.verify(b"abc"));
        assert!(!t.verify(b"abd"));
        assert!(!t.verify(b"ab"));
        assert!(!t.verify(b"abcd"));
        assert!(!t.verify(b""));
    }

    #[test]
    fn header_round_trip() {
        let t = Token::new("xyz").unwrap();
        assert_eq!(t.header_value(), "Bearer xyz");
        assert!(t.verify_header(t.header_value().as_bytes()));
        assert!(t.verify_header(b"xyz"));
        assert!(!t.verify_header(b"Bearer xy"));
    }

    #[test]
    fn debug_does_not_leak_the_secret() {
        let t = Token::new("topsecret").unwrap();
        assert!(!format!("{t:?}").contains("topsecret"));
    }
}
