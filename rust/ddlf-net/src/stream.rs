//! Streamed calls on the wire: a request or reply value cut into chunks, and read back. Shared by the master's
//! client and the worker's service, so both ends speak exactly the same framing.

use bytes::Bytes;
use ddlf_core::frame::{self, Assembler, FrameError, FrameLimits};
use ddlf_proto::{CallReply, CallRequest, Chunk, Value};
use tonic::{Status, Streaming};

/// The first chunk's message.
pub enum Header {
    /// The master's request.
    Request(CallRequest),
    /// The worker's reply.
    Reply(CallReply),
}

/// Cut a message and its value into chunks of at most `chunk_bytes` data bytes, without copying the data. The
/// first chunk carries the message (with only the value's shared-memory reference, if any) and the declared
/// lengths.
pub fn to_chunks(header: Header, mut value: Value, chunk_bytes: usize) -> Vec<Chunk> {
    let shm = value.shm.take().map(|shm| Value {
        shm: Some(shm),
        ..Default::default()
    });
    let mut first = Chunk {
        lengths: frame::lengths(&value.pickle, &value.buffers),
        ..Default::default()
    };
    match header {
        Header::Request(mut r) => {
            r.value = shm;
            first.request = Some(r);
        }
        Header::Reply(mut r) => {
            r.value = shm;
            first.reply = Some(r);
        }
    }
    let mut chunks = vec![first];
    chunks.extend(
        frame::split(&value.pickle, &value.buffers, chunk_bytes)
            .into_iter()
            .map(|data| Chunk {
                data,
                ..Default::default()
            }),
    );
    chunks
}

/// Failure while reading a stream.
#[derive(Debug)]
pub enum StreamError {
    /// The transport failed.
    Status(Status),
    /// The peer sent something malformed or over the limits.
    Frame(FrameError),
    /// The stream does not start with the expected message.
    Malformed(&'static str),
}

impl From<Status> for StreamError {
    fn from(s: Status) -> Self {
        StreamError::Status(s)
    }
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::Status(s) => write!(f, "{}", s.message()),
            StreamError::Frame(e) => write!(f, "{e}"),
            StreamError::Malformed(m) => write!(f, "{m}"),
        }
    }
}

/// Which message a stream must start with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A [`CallRequest`] (the daemon reading a call).
    Request,
    /// A [`CallReply`] (the master reading an answer).
    Reply,
}

/// Read a stream to its end: the first chunk (its message still in place) and the assembled value, whose
/// declared sizes were checked against `limits` before anything was allocated.
pub async fn from_chunks(
    mut stream: Streaming<Chunk>,
    limits: FrameLimits,
    expect: Expect,
) -> Result<(Chunk, Value), StreamError> {
    let mut first = stream
        .message()
        .await?
        .ok_or(StreamError::Malformed("empty stream"))?;
    match expect {
        Expect::Request if first.request.is_none() => {
            return Err(StreamError::Malformed("the first chunk carries no request"))
        }
        Expect::Reply if first.reply.is_none() => {
            return Err(StreamError::Malformed("the first chunk carries no reply"))
        }
        _ => {}
    }
    let mut assembler = Assembler::new(&first.lengths, limits).map_err(StreamError::Frame)?;
    assembler
        .push(&std::mem::take(&mut first.data))
        .map_err(StreamError::Frame)?;
    while !assembler.is_complete() {
        match stream.message().await? {
            Some(chunk) => assembler.push(&chunk.data).map_err(StreamError::Frame)?,
            None => break,
        }
    }
    let (pickle, buffers) = assembler.finish().map_err(StreamError::Frame)?;
    let shm = first
        .request
        .as_mut()
        .and_then(|r| r.value.take())
        .or_else(|| first.reply.as_mut().and_then(|r| r.value.take()))
        .and_then(|v| v.shm);
    Ok((
        first,
        Value {
            pickle: pickle.into(),
            buffers: buffers.into_iter().map(Bytes::from).collect(),
            shm,
        },
    ))
}
