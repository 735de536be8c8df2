//! Errors of talking to one worker. Every variant names the worker's address, so that a user with 64 workers
//! knows which one to look at.

use std::time::Duration;

use ddlf_proto::Refusal;

/// What went wrong on the way to (or back from) one worker daemon.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The daemon could not be reached, or the connection broke (it died, was killed, the link went down).
    #[error("worker {address} is unavailable: {reason}")]
    Unavailable {
        /// The worker's address.
        address: String,
        /// What broke, as the transport tells it.
        reason: String,
    },
    /// The call did not complete within its deadline.
    #[error("worker {address} did not answer within {:.3} s", .after.as_secs_f64())]
    DeadlineExceeded {
        /// The worker's address.
        address: String,
        /// The deadline that passed (zero when only gRPC's status said so).
        after: Duration,
    },
    /// The daemon refused our token (or we sent none and it requires one).
    #[error("worker {address} refused authentication: {reason}")]
    Unauthenticated {
        /// The worker's address.
        address: String,
        /// The daemon's message.
        reason: String,
    },
    /// Master and worker speak different protocol versions.
    #[error(
        "protocol mismatch with worker {address}: master speaks protocol {ours} (ddlf {our_version}), \
         worker speaks protocol {theirs} (ddlf {their_version})"
    )]
    ProtocolMismatch {
        /// The worker's address.
        address: String,
        /// The master's protocol version.
        ours: u32,
        /// The master's ddlf version.
        our_version: String,
        /// The worker's protocol version.
        theirs: u32,
        /// The worker's ddlf version.
        their_version: String,
    },
    /// The daemon refused the request itself (too large, malformed, ...), for a reason given by its code. It
    /// keeps serving.
    #[error("worker {address} rejected the request ({}): {message}", crate::refusal::name(*.refusal))]
    Refused {
        /// The worker's address.
        address: String,
        /// The protocol's refusal code.
        refusal: Refusal,
        /// The daemon's message.
        message: String,
    },
    /// The daemon at this address restarted since we connected: what was pushed to it is gone.
    #[error("worker {address} restarted since this master connected to it: what was pushed to it is gone")]
    Restarted {
        /// The worker's address.
        address: String,
    },
    /// The worker's answer could not be decoded (a broken or hostile peer): the master refused it.
    #[error("worker {address} sent a reply that cannot be decoded: {reason}")]
    InvalidReply {
        /// The worker's address.
        address: String,
        /// What was wrong with it.
        reason: String,
    },
    /// The wait was interrupted on the master (Ctrl-C): the worker may still run the request.
    #[error("the call to worker {address} was interrupted")]
    Interrupted {
        /// The worker's address.
        address: String,
    },
    /// The address (or a setting for it, such as the token) is not something we can connect with.
    #[error("invalid worker address {address:?}: {reason}")]
    InvalidAddress {
        /// The address as given.
        address: String,
        /// Why it cannot be used.
        reason: String,
    },
}

impl NetError {
    /// Classify a gRPC status returned by a call to `address`: by its refusal code when the daemon gave one,
    /// else by the status code (a transport failure, or tonic's own error).
    pub fn from_status(address: &str, status: &tonic::Status) -> Self {
        use tonic::Code;
        let address = address.to_string();
        let message = status.message().to_string();
        if let Some(refusal) = crate::refusal::of_status(status) {
            return Self::refused(address, refusal, message);
        }
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
            Code::ResourceExhausted => NetError::Refused {
                address,
                refusal: Refusal::TooLarge,
                message,
            },
            _ => NetError::InvalidReply {
                address,
                reason: format!("{:?}: {message}", status.code()),
            },
        }
    }

    /// The error for a refusal with this code (from gRPC metadata or a lane frame).
    pub fn refused(address: String, refusal: Refusal, message: String) -> Self {
        match refusal {
            Refusal::Restarted => NetError::Restarted { address },
            Refusal::Unauthenticated => NetError::Unauthenticated {
                address,
                reason: message,
            },
            Refusal::ShuttingDown => NetError::Unavailable {
                address,
                reason: message,
            },
            refusal => NetError::Refused {
                address,
                refusal,
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
            | NetError::Refused { address, .. }
            | NetError::Restarted { address }
            | NetError::InvalidReply { address, .. }
            | NetError::Interrupted { address }
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

/// A readable reason for any error, its source chain included (each source's text once).
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
        assert!(matches!(
            e,
            NetError::Refused {
                refusal: Refusal::TooLarge,
                ..
            }
        ));
        assert_eq!(e.address(), "a:1");
        assert!(e.to_string().contains("too big"));
    }

    #[test]
    fn refusal_codes_decide_not_messages() {
        let s = crate::refusal::status(Refusal::Restarted, "anything at all");
        assert!(matches!(
            NetError::from_status("a:1", &s),
            NetError::Restarted { .. }
        ));
        // The old message prefix alone no longer means anything.
        let s = tonic::Status::failed_precondition("daemon restarted: ...");
        assert!(matches!(
            NetError::from_status("a:1", &s),
            NetError::InvalidReply { .. }
        ));
        let s = crate::refusal::status(Refusal::Malformed, "bad op");
        let e = NetError::from_status("a:1", &s);
        assert!(matches!(
            e,
            NetError::Refused {
                refusal: Refusal::Malformed,
                ..
            }
        ));
        assert!(e.to_string().contains("(malformed)"));
    }
}
