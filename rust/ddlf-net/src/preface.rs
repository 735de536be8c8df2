//! What a connection to a daemon's port may open with: the one table of prefaces, and [`judge`], which reads a
//! connection's first bytes against it.
//!
//! A daemon serves three kinds of connection on one port, told apart by their first bytes: gRPC (the HTTP/2
//! client preface, [`H2_PREFACE`], or on a TLS daemon a TLS handshake record), direct lanes ([`LANE_PREFACE`],
//! see [`crate::lane`]) and worker-to-worker peer links ([`PEER_PREFACE`], opened by the `ddlf-collective`
//! crate; on a TLS daemon their TLS handshake follows the preface). Every preface is 24 bytes long, so the
//! admission guard ([`crate::guard`]) reads the same number of bytes whatever comes.

use std::time::Duration;

/// The first bytes of every HTTP/2 connection (RFC 9113, section 3.4).
pub const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The first bytes of a lane connection, as long as the HTTP/2 preface so the daemon's admission check reads the
/// same number of bytes for both.
pub const LANE_PREFACE: &[u8; 24] = b"DDLF direct lane 1\r\n\r\n\r\n";

/// The first bytes of a peer link, as long as the HTTP/2 preface (the admission check reads 24 bytes for all).
pub const PEER_PREFACE: &[u8; 24] = b"DDLF peer link 1\r\n\r\n\r\n\r\n";

/// What an admitted connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// gRPC over HTTP/2 (or TLS carrying it).
    Grpc,
    /// A direct lane.
    Lane,
    /// A worker's peer link (a ring all-reduce).
    Peer,
}

/// Why a connection was rejected, by [`judge`] or by the admission guard around it (a connection, not a
/// request: a daemon declining a request says so with the protocol's `Refusal` code instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The connection limit was reached (this many were open).
    TooMany(u64),
    /// Nothing valid arrived within the handshake deadline.
    Silent(Duration),
    /// The connection closed before a whole preface arrived.
    Closed,
    /// An HTTP/1 request.
    Http1,
    /// A TLS handshake on a plaintext daemon.
    TlsOnPlain,
    /// Plaintext on a TLS daemon.
    PlainOnTls,
    /// Bytes that open no known connection.
    Garbage,
    /// A direct lane, on a daemon that serves none.
    LanesOff,
    /// A peer link, on a daemon that admits none.
    PeersOff,
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::TooMany(n) => write!(f, "connection limit reached ({n} open)"),
            Rejection::Silent(t) => write!(f, "sent nothing valid within {t:?} (half-open or idle)"),
            Rejection::Closed => write!(f, "closed before sending a complete preface"),
            Rejection::Http1 => write!(
                f,
                "an HTTP/1 request: this port speaks gRPC over HTTP/2 only"
            ),
            Rejection::TlsOnPlain => write!(
                f,
                "a TLS handshake on a plaintext port (the master uses TLS, this daemon does not)"
            ),
            Rejection::PlainOnTls => write!(
                f,
                "plaintext on a TLS port (the master does not use TLS, this daemon does)"
            ),
            Rejection::Garbage => write!(f, "not a gRPC connection (unrecognised bytes)"),
            Rejection::LanesOff => write!(
                f,
                "a direct lane (ddlf's plaintext master connection), and this daemon serves none (a TLS \
                 daemon's master speaks gRPC)"
            ),
            Rejection::PeersOff => write!(
                f,
                "a peer link, and this daemon admits none"
            ),
        }
    }
}

/// Judge the first bytes of a connection: `Ok` admits it (saying what it speaks), `Err` says why it is rejected.
pub fn judge(first: &[u8], tls: bool) -> Result<Admission, Rejection> {
    let is_tls_record = first.first() == Some(&0x16) && first.get(1) == Some(&0x03);
    if tls {
        if is_tls_record {
            return Ok(Admission::Grpc);
        }
        if H2_PREFACE.starts_with(first) || first.starts_with(H2_PREFACE) {
            return Err(Rejection::PlainOnTls);
        }
        if first == &LANE_PREFACE[..first.len().min(LANE_PREFACE.len())] && !first.is_empty() {
            return Err(Rejection::LanesOff);
        }
        // A peer link's preface comes in the clear, its TLS handshake after it.
        if first == PEER_PREFACE {
            return Ok(Admission::Peer);
        }
    } else {
        if first == H2_PREFACE {
            return Ok(Admission::Grpc);
        }
        if first == LANE_PREFACE {
            return Ok(Admission::Lane);
        }
        if first == PEER_PREFACE {
            return Ok(Admission::Peer);
        }
        if is_tls_record {
            return Err(Rejection::TlsOnPlain);
        }
    }
    const HTTP1: [&[u8]; 9] = [
        b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC", b"CONN", b"TRAC",
    ];
    if HTTP1.iter().any(|m| first.starts_with(m)) {
        return Err(Rejection::Http1);
    }
    Err(Rejection::Garbage)
}

/// Bytes needed before [`judge`] can decide.
pub(crate) fn needed(tls: bool) -> usize {
    if tls {
        3
    } else {
        H2_PREFACE.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preface_is_accepted_and_everything_else_named() {
        assert_eq!(judge(H2_PREFACE, false), Ok(Admission::Grpc));
        assert_eq!(judge(LANE_PREFACE, false), Ok(Admission::Lane));
        assert_eq!(judge(PEER_PREFACE, false), Ok(Admission::Peer));
        // A TLS daemon admits peer links (their TLS handshake follows the preface), never lanes.
        assert_eq!(judge(PEER_PREFACE, true), Ok(Admission::Peer));
        assert_eq!(judge(LANE_PREFACE, true), Err(Rejection::LanesOff));
        assert_eq!(judge(&LANE_PREFACE[..6], true), Err(Rejection::LanesOff));
        assert_eq!(judge(&LANE_PREFACE[..10], false), Err(Rejection::Garbage));
        assert_eq!(judge(b"GET / HTTP/1.1\r\n", false), Err(Rejection::Http1));
        assert_eq!(
            judge(&[0x16, 0x03, 0x01], false),
            Err(Rejection::TlsOnPlain)
        );
        assert_eq!(judge(&[0x16, 0x03, 0x01], true), Ok(Admission::Grpc));
        assert_eq!(judge(&H2_PREFACE[..3], true), Err(Rejection::PlainOnTls));
        assert_eq!(judge(b"\x00\xffjunk", false), Err(Rejection::Garbage));
        assert_eq!(judge(b"", false), Err(Rejection::Garbage));
    }

    #[test]
    fn the_prefaces_are_as_long_as_http2s() {
        assert_eq!(LANE_PREFACE.len(), H2_PREFACE.len());
        assert!(!H2_PREFACE.starts_with(&LANE_PREFACE[..1]));
        assert_eq!(PEER_PREFACE.len(), H2_PREFACE.len());
    }

    #[test]
    fn rejections_read_as_sentences() {
        for r in [
            Rejection::TooMany(3),
            Rejection::Silent(Duration::from_secs(1)),
            Rejection::Closed,
            Rejection::Http1,
            Rejection::TlsOnPlain,
            Rejection::PlainOnTls,
            Rejection::Garbage,
            Rejection::LanesOff,
            Rejection::PeersOff,
        ] {
            assert!(r.to_string().len() > 10, "{r:?}");
        }
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// No first bytes make the judge panic, and only a real preface (or TLS record) is accepted.
            #[test]
            fn judge_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64), tls: bool) {
                match judge(&bytes, tls) {
                    Ok(Admission::Grpc) if tls => prop_assert!(bytes[0] == 0x16 && bytes[1] == 0x03),
                    Ok(Admission::Grpc) => prop_assert_eq!(&bytes[..], &H2_PREFACE[..]),
                    Ok(Admission::Lane) => {
                        prop_assert!(!tls);
                        prop_assert_eq!(&bytes[..], &LANE_PREFACE[..]);
                    }
                    Ok(Admission::Peer) => {
                        // Either kind of daemon admits peer links: their TLS handshake follows the preface.
                        prop_assert_eq!(&bytes[..], &PEER_PREFACE[..]);
                    }
                    Err(_) => {}
                }
            }
        }
    }
}
