//! What every request goes through, whichever way it came (gRPC or a direct lane): the screen before it is
//! queued, its label in logs and status, and the line logged when it is answered.

use std::time::Duration;

use ddlf_net::refusal;
use ddlf_proto::{CallReply, CallRequest, Op, Refusal};
use tonic::Status;

use crate::state::WorkerState;

/// One line per answered call: a warning naming the exception when it failed, else a debug line.
pub fn log_reply(reply: &CallReply, took: Duration) {
    if let Some(e) = reply.exception.as_ref().filter(|_| reply.error != 0) {
        tracing::warn!(
            error = reply.error,
            compute_s = reply.compute_seconds,
            "call failed: {}: {}",
            e.type_name,
            first_line(&e.message)
        );
    } else {
        tracing::debug!(
            micros = took.as_micros() as u64,
            compute_s = reply.compute_seconds,
            "call served"
        );
    }
}

/// The first line of a message, at most 500 characters (a log line stays one line).
fn first_line(message: &str) -> &str {
    let line = message.lines().next().unwrap_or("");
    match line.char_indices().nth(500) {
        Some((i, _)) => &line[..i],
        None => line,
    }
}

/// Checks every request passes before it is queued, whichever way it came: a known operation, addressed to this
/// instance of the daemon.
pub fn screen(state: &WorkerState, req: &CallRequest) -> Result<(), Status> {
    if Op::try_from(req.op).unwrap_or(Op::Unspecified) == Op::Unspecified {
        return Err(state.reject(refusal::status(
            Refusal::Malformed,
            format!("unknown operation code {}", req.op),
        )));
    }
    if req.instance != 0 && req.instance != state.instance {
        tracing::info!(
            expected = req.instance,
            ours = state.instance,
            "request for an earlier instance of this daemon: the master must re-provision it"
        );
        return Err(refusal::status(
            Refusal::Restarted,
            "this daemon started after the master connected, and holds nothing it pushed",
        ));
    }
    Ok(())
}

/// `op:name`, for logs and status.
pub fn label(request: &CallRequest) -> String {
    let op = Op::try_from(request.op).unwrap_or(Op::Unspecified);
    let op = op
        .as_str_name()
        .trim_start_matches("OP_")
        .to_ascii_lowercase();
    if request.name.is_empty() {
        op
    } else {
        format!("{op}:{}", request.name)
    }
}
