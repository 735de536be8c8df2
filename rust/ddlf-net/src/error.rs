//! Errors of talking to one worker. Every variant names the worker's address, so that a user with 64 workers
//! knows which one to look at.

use std::time::Duration;

/// What went wrong on the way to (or back from) one worker daemon.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The daemon could not be reached, or the connection broke (it died, was killed, the link went down).
    #[error("worker {address} is unavailable: {reason}")]
    Unavailable { address: String, reason: String },
    /// The call did not complete within its deadline.
    #[error("worker {address} did not answer within {:.3} s", .after.as_secs_f64())]
    DeadlineExceeded { address: String, after: Duration },
    /// The daemon refused our token (or we sent none and it requires one).
    #[error("worker {address} refused authentication: {reason}")]
    Unauthenticated { address: String, reason: String },
    /// Master and worker speak different protocol versions.
    #[error(
        "protocol mismatch with worker {address}: master speaks protocol {ours} (ddlf {our_version}), \
         worker speaks protocol {theirs} (ddlf {their_version})"
    )]
    ProtocolMismatch {
        address: String,
        ours: u32,
        our_version: String,
        theirs: u32,
        their_version: String,
    },
    /// The daemon refused the request itself (too large, malformed, ...). It keeps serving.
    #[error("worker {address} rejected the request ({code}): {message}")]
    Rejected {
        address: String,
        code: String,
        message: String,
    },
    /// The daemon at this address restarted since we connected: what was pushed to it is gone.
    #[error("worker {address} restarted since this master connected to it: what was pushed to it is gone")]
    Restarted { address: String },
    /// The address is not something we can connect to.
    #[error("invalid worker address {address:?}: {reason}")]
    InvalidAddress { address: String, reason: String },
}

/// How a daemon begins its refusal of a request addressed to an earlier instance of itself.
pub const RESTARTED: &str = "daemon restarted";

impl NetError {
    /// Classify a gRPC status returned by a call to `address`.
    pub fn from_status(address: &str, status: &tonic::Status) -> Self {
        use tonic::Code;
        let address = address.to_string();
        let message = status.message().to_string();
        match status.code() {
            Code::Unauthenticated | Code::PermissionDenied => NetError::Unauthenticated {
                address,
                reason: message,
            },
            Code::DeadlineExceeded => NetError::DeadlineExceeded {
                address,
                after: Duration::ZERO,
            },
            Code::Unavailable | Code::Cancelled | Code::Unknown | Code::Aborted => {
                NetError::Unavailable {
                    address,
                    reason: describe_transport(status),
                }
            }
            Code::FailedPrecondition if message.starts_with(RESTARTED) => {
                NetError::Restarted { address }
            }
            code => NetError::Rejected {
                address,
                code: format!("{code:?}"),
                message,
            },
        }
    }

    /// The address of the worker this error is about.
    pub fn address(&self) -> &str {
        match self {
            NetError::Unavailable { address, .. }
            | NetError::DeadlineExceeded { address, .. }
            | NetError::Unauthenticated { address, .. }
            | NetError::ProtocolMismatch { address, .. }
            | NetError::Rejected { address, .. }
            | NetError::Restarted { address }
            | NetError::InvalidAddress { address, .. } => address,
        }
    }
}

/// A readable reason for a transport-level failure, including the source chain (tonic hides the interesting
/// part, such as "connection refused", a few levels down).
pub(crate) fn describe_transport(status: &tonic::Status) -> String {
    let mut text = status.message().to_string();
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        let s = err.to_string();
        if !text.contains(&s) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&s);
        }
        source = err.source();
    }
    if text.is_empty() {
        text = "connection lost".into();
    }
    text
}

pub fn describe_error(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        let s = e.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_are_classified() {
        let s = tonic::Status::unauthenticated("bad token");
        assert!(matches!(
            NetError::from_status("a:1", &s),
            NetError::Unauthenticated { .. }
        ));
        let s = tonic::Status::unavailable("gone");
        assert!(matches!(
            NetError::from_status("a:1", &s),
            NetError::Unavailable { .. }
        ));
        let s = tonic::Status::resource_exhausted("too big");
        let e = NetError::from_status("a:1", &s);
        assert!(matches!(e, NetError::Rejected { .. }));
        assert_eq!(e.address(), "a:1");
        assert!(e.to_string().contains("too big"));
    }
}
