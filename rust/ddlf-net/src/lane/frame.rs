//! The framing both ends of a direct lane share: [`write_frame`] and [`FrameReader`], the handshake messages,
//! socket settings and the lane's size rules.
//!
//! Every blocking read and write runs with a socket timeout; when it fires, the caller's `on_wait` decides
//! whether to keep waiting (the master checks its deadline and Ctrl-C there) or give up.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ddlf_core::frame::{check_lengths, FrameError, FrameLimits};
use ddlf_proto::{LaneFrame, Value};
use prost::Message;
use tokio::io::AsyncReadExt;

/// The largest message part of a frame (a request or reply without its pickle and buffers: names, exception
/// text, shared-memory references).
pub const MAX_MESSAGE: usize = 16 << 20;

/// The largest hello or welcome.
const MAX_HANDSHAKE: usize = 64 << 10;

/// A value's bytes on a lane: its pickle and inline buffers (buffers in shared memory travel as a reference).
pub fn value_bytes(value: Option<&Value>) -> usize {
    value.map_or(0, |v| {
        v.pickle.len() + v.buffers.iter().map(|b| b.len()).sum::<usize>()
    })
}

/// The read buffer of a lane: a small frame arrives with one `read`.
const READ_BUFFER: usize = 64 << 10;

/// Parts smaller than this are copied into the frame's one write (one segment on the wire for a small call);
/// larger ones are written from where they lie, never copied.
const COALESCE: usize = 64 << 10;

/// What can go wrong on a lane.
#[derive(Debug, thiserror::Error)]
pub enum LaneError {
    /// The socket failed (or a wait gave up: the caller's `on_wait` error).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The connection ended where a frame was expected.
    #[error("closed by the other end")]
    Closed,
    /// A frame's message part is over [`MAX_MESSAGE`].
    #[error("a frame message of {0} bytes exceeds the limit of {MAX_MESSAGE} bytes")]
    MessageTooLarge(usize),
    /// A frame's message part is not a valid protobuf message.
    #[error("undecodable frame: {0}")]
    Decode(#[from] prost::DecodeError),
    /// A frame's declared parts break the size limits (checked before anything is allocated).
    #[error("{0}")]
    Limits(#[from] FrameError),
    /// A well-formed frame that is not what the lane carries at this point.
    #[error("unexpected frame: {0}")]
    Unexpected(&'static str),
}

/// Called when a socket read or write times out: `Ok` waits on, `Err` gives up with that error.
pub type OnWait<'a> = &'a mut dyn FnMut() -> io::Result<()>;

pub(crate) fn waiting(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn write_all(dst: &mut impl Write, mut data: &[u8], on_wait: OnWait<'_>) -> Result<(), LaneError> {
    while !data.is_empty() {
        match dst.write(data) {
            Ok(0) => return Err(LaneError::Closed),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if waiting(&e) => on_wait()?,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Write one frame: `frame` (whose value, if any, must leave out the pickle and buffers), then `pickle` and
/// `buffers` raw, with their lengths declared in the message.
pub fn write_frame(
    dst: &mut impl Write,
    mut frame: LaneFrame,
    pickle: &[u8],
    buffers: &[Bytes],
    on_wait: OnWait<'_>,
) -> Result<(), LaneError> {
    frame.lengths = std::iter::once(pickle.len() as u64)
        .chain(buffers.iter().map(|b| b.len() as u64))
        .collect();
    let len = frame.encoded_len();
    if len > MAX_MESSAGE {
        return Err(LaneError::MessageTooLarge(len));
    }
    let small: usize = std::iter::once(pickle.len())
        .chain(buffers.iter().map(|b| b.len()))
        .filter(|&l| l < COALESCE)
        .sum();
    let mut head = Vec::with_capacity(4 + len + small);
    head.extend_from_slice(&(len as u32).to_le_bytes());
    frame
        .encode(&mut head)
        .map_err(|e| io::Error::other(e.to_string()))?;
    for part in std::iter::once(pickle).chain(buffers.iter().map(|b| &b[..])) {
        if part.len() < COALESCE {
            head.extend_from_slice(part);
        } else {
            write_all(dst, &head, on_wait)?;
            head.clear();
            write_all(dst, part, on_wait)?;
        }
    }
    write_all(dst, &head, on_wait)
}

/// What of a value travels in a frame's message: only its shared-memory reference, if it has one (the pickle and
/// buffers follow the message raw).
pub fn message_value(value: &Value) -> Option<Value> {
    value.shm.clone().map(|shm| Value {
        shm: Some(shm),
        ..Default::default()
    })
}

/// A value whole again: the parts read after a frame's message, and the shared-memory reference the message
/// carried (see [`message_value`]).
pub fn joined_value(message: Option<Value>, mut parts: Value) -> Value {
    parts.shm = message.and_then(|v| v.shm);
    parts
}

/// Reads frames from a lane through a small buffer (a whole small frame in one `read`).
pub struct FrameReader {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Default for FrameReader {
    fn default() -> Self {
        FrameReader {
            buf: vec![0; READ_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }
}

fn read_some(src: &mut impl Read, dst: &mut [u8], on_wait: OnWait<'_>) -> Result<usize, LaneError> {
    loop {
        match src.read(dst) {
            Ok(0) => return Err(LaneError::Closed),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if waiting(&e) => on_wait()?,
            Err(e) => return Err(e.into()),
        }
    }
}

/// How long a lane's reader spins (non-blocking reads, yielding the CPU between them) before it blocks: the
/// master after sending a request, the worker's interpreter thread after answering one. A reply or the next
/// request that comes within it is picked up without the thread sleeping, so no wake-up (an inter-processor
/// interrupt, costly in a VM) is paid for it. The default for both ends: `DDLF_LANE_SPIN_US` (0: block at
/// once), else 100 us; `Cluster(lane_spin_us=...)` and `ddlf-worker --lane-spin-us` set it per process.
pub fn default_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let Ok(text) = std::env::var("DDLF_LANE_SPIN_US") else {
            return Duration::from_micros(100);
        };
        match text.trim().parse::<u64>() {
            Ok(micros) if micros <= 1_000_000 => Duration::from_micros(micros),
            _ => {
                tracing::warn!(
                    value = %text,
                    "DDLF_LANE_SPIN_US must be whole microseconds from 0 to 1000000: using 100"
                );
                Duration::from_micros(100)
            }
        }
    })
}

impl std::fmt::Debug for FrameReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameReader")
            .field("buffered", &(self.end - self.start))
            .finish()
    }
}

impl FrameReader {
    /// Read whatever `src` has without blocking; returns whether anything (or the end of the stream, or an error
    /// such as a reset) came: the blocking read that follows then reports the end or the error.
    pub fn try_fill(&mut self, src: &TcpStream) -> bool {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        if self.end == self.buf.len() {
            return true;
        }
        let room = &mut self.buf[self.end..];
        // SAFETY: `room` is valid writable memory of `room.len()` bytes for the duration of the call.
        let n = unsafe {
            libc::recv(
                src.as_raw_fd(),
                room.as_mut_ptr().cast(),
                room.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            n if n > 0 => {
                self.end += n as usize;
                true
            }
            0 => true, // the end of the stream: the blocking read that follows reports it
            _ => !matches!(
                io::Error::last_os_error().kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
        }
    }

    /// Spin up to `spin` for bytes on `src` (see [`default_spin`]); returns whether they came.
    pub fn spin_for(&mut self, src: &TcpStream, spin: Duration) -> bool {
        if self.has_buffered() {
            return true;
        }
        if spin.is_zero() {
            return false;
        }
        let start = Instant::now();
        loop {
            if self.try_fill(src) {
                return true;
            }
            if start.elapsed() >= spin {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Whether bytes of a next frame are already buffered (then the socket may not poll readable for them).
    pub fn has_buffered(&self) -> bool {
        self.start < self.end
    }

    fn take_buffered(&mut self, dst: &mut [u8]) -> usize {
        let n = (self.end - self.start).min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
        n
    }

    fn read_exact(
        &mut self,
        src: &mut impl Read,
        dst: &mut [u8],
        on_wait: OnWait<'_>,
    ) -> Result<(), LaneError> {
        let mut done = self.take_buffered(dst);
        while done < dst.len() {
            if dst.len() - done >= self.buf.len() {
                // Large parts go straight to their destination.
                done += read_some(src, &mut dst[done..], on_wait)?;
            } else {
                let end = self.end;
                self.end += read_some(src, &mut self.buf[end..], on_wait)?;
                done += self.take_buffered(&mut dst[done..]);
            }
        }
        Ok(())
    }

    /// Read the message of the next frame (its pickle and buffers follow: [`Self::read_parts`] or
    /// [`Self::skip`]).
    pub fn read_message(
        &mut self,
        src: &mut impl Read,
        on_wait: OnWait<'_>,
    ) -> Result<LaneFrame, LaneError> {
        let mut len = [0u8; 4];
        self.read_exact(src, &mut len, on_wait)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_MESSAGE {
            return Err(LaneError::MessageTooLarge(len));
        }
        let mut msg = vec![0u8; len];
        self.read_exact(src, &mut msg, on_wait)?;
        Ok(LaneFrame::decode(&msg[..])?)
    }

    /// Read the pickle and buffers declared by `lengths`, after checking them against `limits`.
    pub fn read_parts(
        &mut self,
        src: &TcpStream,
        lengths: &[u64],
        limits: FrameLimits,
        on_wait: OnWait<'_>,
    ) -> Result<Value, LaneError> {
        let (lengths, _) = check_lengths(lengths, limits)?;
        let mut parts = Vec::with_capacity(lengths.len());
        for l in lengths {
            parts.push(Bytes::from(self.read_part(src, l, &mut *on_wait)?));
        }
        let mut parts = parts.into_iter();
        Ok(Value {
            pickle: parts.next().unwrap_or_default(),
            buffers: parts.collect(),
            shm: None,
        })
    }

    /// One part of `len` bytes, allocated at its size and filled by the socket directly (a large part is never
    /// zeroed first nor staged through the read buffer).
    fn read_part(
        &mut self,
        src: &TcpStream,
        len: usize,
        on_wait: OnWait<'_>,
    ) -> Result<Vec<u8>, LaneError> {
        let mut part = Vec::with_capacity(len);
        let n = (self.end - self.start).min(len);
        part.extend_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
        while part.len() < len {
            let rest = len - part.len();
            if rest < self.buf.len() {
                // A small remainder comes through the read buffer (one `read` may bring the next frame too).
                let done = part.len();
                part.resize(len, 0);
                self.read_exact(&mut &*src, &mut part[done..], on_wait)?;
                break;
            }
            let spare = &mut part.spare_capacity_mut()[..rest];
            match socket2::SockRef::from(src).recv(spare) {
                Ok(0) => return Err(LaneError::Closed),
                // SAFETY: `recv` initialised the first `k` bytes of the spare capacity.
                Ok(k) => unsafe { part.set_len(part.len() + k) },
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if waiting(&e) => on_wait()?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(part)
    }

    /// Read and discard `n` bytes (the parts of a refused request), keeping the lane in step.
    pub fn skip(
        &mut self,
        src: &mut impl Read,
        mut n: u64,
        on_wait: OnWait<'_>,
    ) -> Result<(), LaneError> {
        let mut sink = vec![0u8; READ_BUFFER];
        while n > 0 {
            let k = (n as usize).min(sink.len());
            self.read_exact(src, &mut sink[..k], on_wait)?;
            n -= k as u64;
        }
        Ok(())
    }
}

/// Set the socket options both ends of a lane use: no Nagle (a frame is written whole), TCP keepalive (a peer
/// whose host vanished is noticed while a call waits), and read/write timeouts of `poll`.
pub fn configure(stream: &TcpStream, poll: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(poll))?;
    stream.set_write_timeout(Some(poll))?;
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(2))
        .with_retries(3);
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

/// Encode a handshake message with its length prefix.
pub fn handshake_bytes(message: &impl Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + message.encoded_len());
    out.extend_from_slice(&(message.encoded_len() as u32).to_le_bytes());
    // Encoding into a Vec only fails for lack of capacity, which it grows.
    let _ = message.encode(&mut out);
    out
}

/// Read a length-prefixed handshake message (the hello on the daemon, the welcome on the master).
pub async fn read_handshake<M: Message + Default>(
    src: &mut (impl tokio::io::AsyncRead + Unpin),
) -> Result<M, LaneError> {
    let mut len = [0u8; 4];
    src.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_HANDSHAKE {
        return Err(LaneError::MessageTooLarge(len));
    }
    let mut msg = vec![0u8; len];
    src.read_exact(&mut msg).await?;
    Ok(M::decode(&msg[..])?)
}

/// How often a master waiting on a lane wakes to check its deadline and for Ctrl-C.
#[cfg(test)]
mod tests {
    use super::*;
    use ddlf_proto::CallRequest;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        configure(&a, Duration::from_millis(20)).unwrap();
        configure(&b, Duration::from_millis(20)).unwrap();
        (a, b)
    }

    fn give_up() -> impl FnMut() -> io::Result<()> {
        || Err(io::ErrorKind::TimedOut.into())
    }

    #[test]
    fn a_values_bytes_on_a_lane_are_its_pickle_and_inline_buffers() {
        let inline = |n: usize| Value {
            pickle: Bytes::from(vec![0u8; 100]),
            buffers: vec![Bytes::from(vec![0u8; n])],
            shm: None,
        };
        assert_eq!(value_bytes(None), 0);
        assert_eq!(value_bytes(Some(&inline(5000))), 5100);
        // A gigabyte in shared memory is a reference on the wire: only its pickle counts.
        let shared = Value {
            pickle: Bytes::from_static(b"p"),
            buffers: vec![],
            shm: Some(ddlf_proto::ShmRef {
                name: "ddlf-x".into(),
                offsets: vec![0],
                lengths: vec![1 << 30],
                pooled: true,
            }),
        };
        assert_eq!(value_bytes(Some(&shared)), 1);
        // Its reference travels in the frame's message and is joined back to the parts read after it.
        let parts = Value {
            pickle: shared.pickle.clone(),
            ..Default::default()
        };
        let whole = joined_value(message_value(&shared), parts);
        assert_eq!(whole, shared);
        assert_eq!(message_value(&inline(1)), None);
    }

    #[test]
    fn frames_round_trip_with_small_and_large_parts() {
        let (mut a, mut b) = pair();
        let big = Bytes::from(vec![7u8; 3 * READ_BUFFER + 5]);
        let parts = vec![Bytes::from_static(b"small"), big.clone(), Bytes::new()];
        let request = CallRequest {
            op: 8,
            name: "f".into(),
            request_id: 42,
            ..Default::default()
        };
        let frame = LaneFrame {
            request: Some(request.clone()),
            ..Default::default()
        };
        let writer = std::thread::spawn(move || {
            for _ in 0..2 {
                write_frame(&mut a, frame.clone(), b"pickle", &parts, &mut give_up()).unwrap();
            }
            a
        });
        let mut reader = FrameReader::default();
        let mut wait = || Ok(());
        for _ in 0..2 {
            let got = reader.read_message(&mut b, &mut wait).unwrap();
            assert_eq!(got.request.as_ref().unwrap().request_id, 42);
            assert_eq!(got.lengths, vec![6, 5, big.len() as u64, 0]);
            let value = reader
                .read_parts(&b, &got.lengths, FrameLimits::default(), &mut wait)
                .unwrap();
            assert_eq!(&value.pickle[..], b"pickle");
            assert_eq!(value.buffers[1], big);
            assert!(value.buffers[2].is_empty());
        }
        assert!(!reader.has_buffered());
        drop(writer.join().unwrap());
        assert!(matches!(
            reader.read_message(&mut b, &mut wait),
            Err(LaneError::Closed)
        ));
    }

    #[test]
    fn declared_lengths_are_checked_before_anything_is_read() {
        let (mut a, mut b) = pair();
        let frame = LaneFrame::default();
        write_frame(&mut a, frame, &[1u8; 100], &[], &mut give_up()).unwrap();
        let mut reader = FrameReader::default();
        let msg = reader.read_message(&mut b, &mut give_up()).unwrap();
        let small = FrameLimits {
            max_total: 10,
            ..Default::default()
        };
        let err = reader
            .read_parts(&b, &msg.lengths, small, &mut give_up())
            .unwrap_err();
        assert!(matches!(
            err,
            LaneError::Limits(FrameError::TooLarge { .. })
        ));
        // The refused bytes can be skipped and the lane stays in step.
        reader.skip(&mut b, 100, &mut give_up()).unwrap();
        write_frame(&mut a, LaneFrame::default(), b"ok", &[], &mut give_up()).unwrap();
        let msg = reader.read_message(&mut b, &mut give_up()).unwrap();
        assert_eq!(msg.lengths, vec![2]);
    }

    #[test]
    fn a_huge_or_garbage_message_is_an_error_not_an_allocation() {
        let (mut a, mut b) = pair();
        a.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let mut reader = FrameReader::default();
        assert!(matches!(
            reader.read_message(&mut b, &mut give_up()),
            Err(LaneError::MessageTooLarge(_))
        ));
        a.write_all(&3u32.to_le_bytes()).unwrap();
        a.write_all(&[0xff, 0xff, 0xff]).unwrap();
        assert!(matches!(
            reader.read_message(&mut b, &mut give_up()),
            Err(LaneError::Decode(_))
        ));
    }

    #[test]
    fn a_silent_peer_hands_control_to_on_wait() {
        let (_a, mut b) = pair();
        let mut reader = FrameReader::default();
        let mut waits = 0;
        let mut wait = || {
            waits += 1;
            if waits < 3 {
                Ok(())
            } else {
                Err(io::ErrorKind::TimedOut.into())
            }
        };
        let err = reader.read_message(&mut b, &mut wait).unwrap_err();
        assert!(matches!(err, LaneError::Io(e) if e.kind() == io::ErrorKind::TimedOut));
        assert_eq!(waits, 3);
    }
}
