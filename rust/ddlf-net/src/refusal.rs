//! Refusals: a daemon declining a request without running it, and how the reason travels.
//!
//! The reason is a [`Refusal`] code from the protocol, the same on every path: over gRPC it rides in the
//! `ddlf-refusal` metadata of the error status; on a direct lane in the frame itself. The master decides what to
//! do from the code (re-provision a restarted daemon, report a request too large), never from a message's text.

use ddlf_proto::Refusal;
use tonic::{Code, Status};

/// The metadata key carrying a refusal's code (its decimal value) on a gRPC error status.
pub const REFUSAL_KEY: &str = "ddlf-refusal";

/// The gRPC status code a refusal is sent with (what a plain gRPC client sees).
pub fn grpc_code(refusal: Refusal) -> Code {
    match refusal {
        Refusal::None => Code::Ok,
        Refusal::Unauthenticated => Code::Unauthenticated,
        Refusal::Protocol => Code::FailedPrecondition,
        Refusal::Restarted => Code::FailedPrecondition,
        Refusal::TooLarge => Code::ResourceExhausted,
        Refusal::Malformed => Code::InvalidArgument,
        Refusal::ShuttingDown => Code::Unavailable,
    }
}

/// A gRPC error status carrying `refusal`.
pub fn status(refusal: Refusal, message: impl Into<String>) -> Status {
    let mut s = Status::new(grpc_code(refusal), message);
    s.metadata_mut().insert(
        REFUSAL_KEY,
        (refusal as i32)
            .to_string()
            .parse()
            .expect("a decimal number is valid metadata"),
    );
    s
}

/// The refusal a gRPC status carries, if any (a status from the transport or from tonic itself carries none).
pub fn of_status(status: &Status) -> Option<Refusal> {
    let code = status.metadata().get(REFUSAL_KEY)?.to_str().ok()?;
    let code: i32 = code.parse().ok()?;
    match Refusal::try_from(code) {
        Ok(Refusal::None) | Err(_) => None,
        Ok(r) => Some(r),
    }
}

/// The refusal's name without the prefix, lower case (`"too_large"`): what Python's `RequestRejected.code` holds.
pub fn name(refusal: Refusal) -> String {
    refusal
        .as_str_name()
        .trim_start_matches("REFUSAL_")
        .to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_survives_the_status() {
        for r in [
            Refusal::Unauthenticated,
            Refusal::Protocol,
            Refusal::Restarted,
            Refusal::TooLarge,
            Refusal::Malformed,
            Refusal::ShuttingDown,
        ] {
            let s = status(r, "why");
            assert_eq!(of_status(&s), Some(r));
            assert_eq!(s.code(), grpc_code(r));
            assert_eq!(s.message(), "why");
        }
    }

    #[test]
    fn plain_statuses_carry_no_refusal() {
        assert_eq!(of_status(&Status::unavailable("gone")), None);
        let mut s = Status::internal("x");
        s.metadata_mut()
            .insert(REFUSAL_KEY, "not a number".parse().unwrap());
        assert_eq!(of_status(&s), None);
        s.metadata_mut()
            .insert(REFUSAL_KEY, "9999".parse().unwrap());
        assert_eq!(of_status(&s), None);
    }

    #[test]
    fn names_are_short() {
        assert_eq!(name(Refusal::TooLarge), "too_large");
        assert_eq!(name(Refusal::Restarted), "restarted");
    }
}
