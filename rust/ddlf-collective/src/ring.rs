//! The ring all-reduce itself: reduce-scatter then all-gather over one left and one right TCP link, pipelined.
//!
//! `data` is cut into `n` chunks (sizes differ by at most one element). In step `t` of `2(n-1)`, rank `r` sends
//! chunk `(r - t) mod n` to its right neighbour and receives chunk `(r - t - 1) mod n` from its left one: during the
//! first `n - 1` steps (reduce-scatter) the received elements are added to its own, during the last `n - 1`
//! (all-gather) they replace them. Each rank thus sends and receives `2(n-1)/n` times the data, whatever `n`.
//!
//! Everything runs on the calling thread over non-blocking sockets and `poll(2)`: bytes of step `t + 1` go out as
//! soon as the same elements of step `t` have been received and reduced, so sending, receiving and adding overlap
//! within a step (the kernel's socket buffers carry the transfer while this thread adds). One thread owns `data`
//! throughout, so there is no shared mutable memory and no `unsafe`.
//!
//! Why the all-gather never overwrites an element before this rank has sent its reduce-scatter value: the value
//! that arrives for element `i` of chunk `c` in the all-gather is the finished sum, which includes what this rank
//! sent for `i` during the reduce-scatter, so that send happened first.
//!
//! Every call starts by exchanging a 16-byte header with both neighbours (element type, wire type and count), so
//! ranks that disagree about what they reduce fail with [`RingError::Mismatch`] instead of adding unrelated bytes.
//!
//! **Half precision on the wire** ([`allreduce_over`] with a [`Codec`] such as [`F16Wire`]): every hop sends the
//! elements as float16 or bfloat16 (half the bytes) and every rank adds in float32. In the all-gather each reduced
//! chunk leaves its owner rounded to the wire type, and the owner keeps the same rounded value, so every rank still
//! ends with identical bits (a received value re-encodes to the same bits it arrived as).

use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

pub use crate::link::Link;

/// What one reduction does with the summed values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The element-wise sum over ranks.
    Sum,
    /// The element-wise mean over ranks (the sum divided by `n`).
    Mean,
}

/// An element type the ring reduces: plain bytes on the wire (little-endian hosts; see `peer.rs`).
pub trait Elem: bytemuck::Pod + Send + Sync {
    /// Code in the call header, so ranks reducing different types refuse instead of mixing bytes.
    const CODE: u32;
    /// Name in error messages.
    const NAME: &'static str;
    fn add(self, other: Self) -> Self;
    fn scale(self, by: f64) -> Self;
}

impl Elem for f32 {
    const CODE: u32 = 1;
    const NAME: &'static str = "float32";
    fn add(self, other: Self) -> Self {
        self + other
    }
    fn scale(self, by: f64) -> Self {
        (self as f64 * by) as f32
    }
}

impl Elem for f64 {
    const CODE: u32 = 2;
    const NAME: &'static str = "float64";
    fn add(self, other: Self) -> Self {
        self + other
    }
    fn scale(self, by: f64) -> Self {
        self * by
    }
}

/// How elements of type `T` travel: as themselves ([`Plain`]), or narrowed to a smaller type and widened again on
/// arrival (the sum is always kept in `T`).
pub trait Codec<T: Elem>: Send + Sync {
    /// The element type on the wire.
    type W: bytemuck::Pod + Send + Sync;
    /// Code in the call header (with `T::CODE`): ranks sending different wire types refuse.
    const CODE: u32;
    /// Name in error messages.
    const NAME: &'static str;
    /// `true` when `W` is `T` itself: bytes are sent straight from the data, without staging.
    const PLAIN: bool;
    /// Narrow `src` into `out` (same length).
    fn encode(src: &[T], out: &mut [Self::W]);
    /// Add the widened `src` to `dst` (same length).
    fn add(dst: &mut [T], src: &[Self::W]);
    /// Replace `dst` by the widened `src` (same length).
    fn copy(dst: &mut [T], src: &[Self::W]);
}

/// Elements travel as themselves.
pub struct Plain;

impl<T: Elem> Codec<T> for Plain {
    type W = T;
    const CODE: u32 = 0;
    const NAME: &'static str = "";
    const PLAIN: bool = true;
    fn encode(src: &[T], out: &mut [T]) {
        out.copy_from_slice(src);
    }
    fn add(dst: &mut [T], src: &[T]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = d.add(*s);
        }
    }
    fn copy(dst: &mut [T], src: &[T]) {
        dst.copy_from_slice(src);
    }
}

/// float32 summed, IEEE float16 on the wire (values beyond ±65504 become infinite: for gradients and deltas).
pub struct F16Wire;

impl Codec<f32> for F16Wire {
    type W = half::f16;
    const CODE: u32 = 1;
    const NAME: &'static str = " over float16";
    const PLAIN: bool = false;
    fn encode(src: &[f32], out: &mut [half::f16]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(out, src);
    }
    fn add(dst: &mut [f32], src: &[half::f16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += s.to_f32();
        }
    }
    fn copy(dst: &mut [f32], src: &[half::f16]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}

/// float32 summed, bfloat16 on the wire (float32's range, 8 bits of mantissa).
pub struct Bf16Wire;

impl Codec<f32> for Bf16Wire {
    type W = half::bf16;
    const CODE: u32 = 2;
    const NAME: &'static str = " over bfloat16";
    const PLAIN: bool = false;
    fn encode(src: &[f32], out: &mut [half::bf16]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(out, src);
    }
    fn add(dst: &mut [f32], src: &[half::bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += s.to_f32();
        }
    }
    fn copy(dst: &mut [f32], src: &[half::bf16]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}

/// Why one ring pass failed. The caller knows the neighbours' ranks and addresses and names them.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("the link to the {side} neighbour failed: {source}")]
    Io { side: Side, source: io::Error },
    #[error("the {side} neighbour closed the link")]
    Closed { side: Side },
    #[error("the {side} neighbour made no progress for {after:?} (stopped, or its link is down)")]
    Stalled { side: Side, after: Duration },
    #[error(
        "the {side} neighbour made no progress for {after:?} and its daemon did not answer a liveness probe \
         ({reason}): its process is stopped or its host unreachable"
    )]
    Unresponsive {
        side: Side,
        after: Duration,
        reason: String,
    },
    #[error(
        "the left neighbour reduces {their_len} {their_type} elements and this rank {our_len} {our_type}: \
         every rank must pass arrays of the same dtypes and sizes, with the same wire precision"
    )]
    Mismatch {
        their_len: u64,
        their_type: String,
        our_len: u64,
        our_type: String,
    },
    #[error("the left neighbour sent an unreadable header (not a ddlf ring)")]
    BadHeader,
}

/// Which neighbour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Left,
    Right,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Left => "left",
            Side::Right => "right",
        })
    }
}

/// One rank's two links in one ring: data comes in from the left, goes out to the right. Both non-blocking.
#[derive(Debug)]
pub struct Links {
    pub left: Link,
    pub right: Link,
}

impl Links {
    /// Push encrypted bytes still waiting on the right link (TLS); whether any moved.
    fn flush(&mut self) -> Result<bool, RingError> {
        self.right.flush().map_err(|e| io_error(Side::Right, e))
    }
}

const MAGIC: u32 = 0x444c_5246; // "DLRF"

/// Bytes read from the left per `read` call at most (the scratch buffer; a few socket buffers' worth).
const SCRATCH_BYTES: usize = 1 << 20;

/// How long one `poll` waits before the stall clock is checked again.
const POLL_SLICE: Duration = Duration::from_millis(200);

/// Asks whether the neighbour on one side is still alive (its daemon answers), and says why not.
pub type Probe<'a> = &'a (dyn Fn(Side) -> Result<(), String> + Sync);

/// How long a pass waits for its neighbours, and how it tells a slow neighbour from a dead one.
///
/// A neighbour may legitimately go quiet for a long time (still computing before it joins the reduction), so
/// silence alone fails a pass only after `stall`. A neighbour whose process is stopped (`SIGSTOP`, swapped out,
/// a debugger) or whose host froze keeps its TCP connections open, and its kernel even answers keepalives: only
/// asking its process tells it apart. After `probe_every` without progress, and again every `probe_every`, the
/// pass calls `probe` for the neighbour it waits on; a probe that fails ends the pass at once.
#[derive(Clone, Copy)]
pub struct Watch<'a> {
    pub stall: Duration,
    pub probe_every: Duration,
    pub probe: Option<Probe<'a>>,
}

impl Watch<'static> {
    /// Fail after `stall` without progress; never probe.
    pub fn stall(stall: Duration) -> Self {
        Watch {
            stall,
            probe_every: stall,
            probe: None,
        }
    }
}

/// The progress clock of one pass: when something last moved, and when the neighbours last proved alive.
struct Clock {
    last: Instant,
    alive: Instant,
}

impl Clock {
    fn new() -> Self {
        let now = Instant::now();
        Clock {
            last: now,
            alive: now,
        }
    }

    fn progressed(&mut self) {
        self.last = Instant::now();
    }
}

/// The element range of chunk `c` of `n` over `len` elements.
pub fn chunk(len: usize, n: usize, c: usize) -> Range<usize> {
    let at = |i: usize| ((i as u128 * len as u128) / n as u128) as usize;
    at(c)..at(c + 1)
}

/// All-reduce `data` in place with the ranks of this ring. `n == 1` leaves `data` as it is (a mean of one).
/// `watch`: how long either neighbour may go without progress, and how its liveness is checked meanwhile.
pub fn allreduce<T: Elem>(
    data: &mut [T],
    rank: usize,
    n: usize,
    links: &mut Links,
    op: Op,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    allreduce_over::<T, Plain>(data, rank, n, links, op, watch)
}

/// [`allreduce`] with the elements sent as `C::W` (see the module docs on half precision).
pub fn allreduce_over<T: Elem, C: Codec<T>>(
    data: &mut [T],
    rank: usize,
    n: usize,
    links: &mut Links,
    op: Op,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    if n <= 1 {
        return Ok(());
    }
    exchange_header::<T, C>(data.len() as u64, links, watch)?;
    Pass::new(data.len(), rank, n).run::<T, C>(data, links, watch)?;
    if op == Op::Mean {
        let by = 1.0 / n as f64;
        for x in data.iter_mut() {
            *x = x.scale(by);
        }
    }
    Ok(())
}

/// The header's type word: the element type in the low byte, the wire type in the next.
fn type_word<T: Elem, C: Codec<T>>() -> u32 {
    T::CODE | (C::CODE << 8)
}

fn type_name(word: u32) -> String {
    let elem = match word & 0xff {
        1 => "float32",
        2 => "float64",
        _ => "unknown",
    };
    let wire = match word >> 8 {
        0 => "",
        1 => " over float16",
        2 => " over bfloat16",
        _ => " over an unknown wire type",
    };
    format!("{elem}{wire}")
}

fn exchange_header<T: Elem, C: Codec<T>>(
    len: u64,
    links: &mut Links,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    let ours_word = type_word::<T, C>();
    let mut ours = [0u8; 16];
    ours[..4].copy_from_slice(&MAGIC.to_le_bytes());
    ours[4..8].copy_from_slice(&ours_word.to_le_bytes());
    ours[8..].copy_from_slice(&len.to_le_bytes());
    let mut theirs = [0u8; 16];
    let (mut sent, mut got) = (0usize, 0usize);
    let mut clock = Clock::new();
    while sent < 16 || got < 16 || links.right.pending() {
        let mut progressed = links.flush()?;
        if sent < 16 {
            match links.right.write(&ours[sent..]) {
                Ok(k) => (sent, progressed) = (sent + k, true),
                Err(e) if retry(&e) => {}
                Err(e) => return Err(io_error(Side::Right, e)),
            }
        }
        if got < 16 {
            match links.left.read(&mut theirs[got..]) {
                Ok(0) => return Err(RingError::Closed { side: Side::Left }),
                Ok(k) => (got, progressed) = (got + k, true),
                Err(e) if retry(&e) => {}
                Err(e) => return Err(io_error(Side::Left, e)),
            }
        }
        if progressed {
            clock.progressed();
        } else {
            let want_out = sent < 16 || links.right.pending();
            wait(links, got < 16, want_out, &mut clock, watch)?;
        }
    }
    let word = |r: Range<usize>| u32::from_le_bytes(theirs[r].try_into().unwrap_or_default());
    if word(0..4) != MAGIC {
        return Err(RingError::BadHeader);
    }
    let their_len = u64::from_le_bytes(theirs[8..].try_into().unwrap_or_default());
    let their_code = word(4..8);
    if their_code != ours_word || their_len != len {
        return Err(RingError::Mismatch {
            their_len,
            their_type: type_name(their_code),
            our_len: len,
            our_type: format!("{}{}", T::NAME, C::NAME),
        });
    }
    Ok(())
}

/// The progress of one pass.
struct Pass {
    len: usize,
    rank: usize,
    n: usize,
    steps: usize,
    /// Send side: step, and bytes of that step's chunk written.
    send_step: usize,
    sent: usize,
    /// Receive side: step, and elements of that step's chunk reduced (or copied).
    recv_step: usize,
    done: usize,
}

impl Pass {
    fn new(len: usize, rank: usize, n: usize) -> Self {
        Pass {
            len,
            rank,
            n,
            steps: 2 * (n - 1),
            send_step: 0,
            sent: 0,
            recv_step: 0,
            done: 0,
        }
    }

    fn send_chunk(&self, t: usize) -> Range<usize> {
        chunk(self.len, self.n, (self.rank + 2 * self.n - t) % self.n)
    }

    fn recv_chunk(&self, t: usize) -> Range<usize> {
        chunk(self.len, self.n, (self.rank + 2 * self.n - t - 1) % self.n)
    }

    /// Elements of the current send step's chunk that are ready: all of them in step 0 (this rank's own data) and
    /// once the previous step's receive is complete; otherwise those the previous step has received so far.
    fn ready(&self) -> usize {
        let whole = self.send_chunk(self.send_step).len();
        if self.send_step == 0 || self.recv_step >= self.send_step {
            whole
        } else {
            self.done
        }
    }

    fn run<T: Elem, C: Codec<T>>(
        mut self,
        data: &mut [T],
        links: &mut Links,
        watch: Watch<'_>,
    ) -> Result<(), RingError> {
        let size = std::mem::size_of::<C::W>();
        let mut scratch = vec![<C::W as bytemuck::Zeroable>::zeroed(); SCRATCH_BYTES / size];
        // Narrowed elements of the current send step (unused when elements travel as themselves): `staged` of
        // them encoded so far.
        let mut stage = vec![
            <C::W as bytemuck::Zeroable>::zeroed();
            if C::PLAIN {
                0
            } else {
                self.len.div_ceil(self.n)
            }
        ];
        let mut staged = 0usize;
        let mut filled = 0usize; // bytes of `scratch` holding received data not yet applied
                                 // Bytes this pass still receives: reads never go past them (into the next call's header, which a fast
                                 // left neighbour may already have sent).
        let mut expected: usize = (0..self.steps)
            .map(|t| self.recv_chunk(t).len() * size)
            .sum();
        let mut clock = Clock::new();
        // A TLS link may hold encrypted bytes after the last write: the pass ends once they are out too.
        while self.send_step < self.steps || self.recv_step < self.steps || links.right.pending() {
            let mut progressed = links.flush()?;
            // Send what is ready of the current step; a finished step moves on at once.
            while self.send_step < self.steps {
                let range = self.send_chunk(self.send_step);
                let ready_elems = self.ready();
                let ready = ready_elems * size;
                if self.sent < ready {
                    let bytes: &[u8] = if C::PLAIN {
                        bytemuck::cast_slice(&data[range.clone()])
                    } else {
                        if staged < ready_elems {
                            let fresh = range.start + staged..range.start + ready_elems;
                            C::encode(&data[fresh.clone()], &mut stage[staged..ready_elems]);
                            if self.send_step == self.n - 1 {
                                // This rank's finished chunk leaves rounded: keep the rounded value too, so
                                // every rank ends with the same bits.
                                C::copy(&mut data[fresh], &stage[staged..ready_elems]);
                            }
                            staged = ready_elems;
                        }
                        bytemuck::cast_slice(&stage[..range.len()])
                    };
                    match links.right.write(&bytes[self.sent..ready]) {
                        Ok(k) => (self.sent, progressed) = (self.sent + k, true),
                        Err(e) if retry(&e) => break,
                        Err(e) => return Err(io_error(Side::Right, e)),
                    }
                }
                if self.sent == range.len() * size {
                    (self.send_step, self.sent, staged) = (self.send_step + 1, 0, 0);
                    progressed = true;
                } else {
                    break;
                }
            }
            // Receive whatever has arrived and apply every whole element of it (empty chunks complete first: a
            // neighbour that finished may already have closed, and nothing is read for them).
            if filled == 0 {
                self.apply::<T, C>(data, &[]);
            }
            if self.recv_step < self.steps {
                let room: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..]);
                let end = room.len().min(filled + expected);
                match links.left.read(&mut room[filled..end]) {
                    Ok(0) => return Err(RingError::Closed { side: Side::Left }),
                    Ok(k) => (filled, expected, progressed) = (filled + k, expected - k, true),
                    Err(e) if retry(&e) => {}
                    Err(e) => return Err(io_error(Side::Left, e)),
                }
                let applied = self.apply::<T, C>(data, &scratch[..filled / size]);
                let used = applied * size;
                if used > 0 {
                    let room: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..]);
                    room.copy_within(used..filled, 0);
                    filled -= used;
                    progressed = true;
                }
            }
            if progressed {
                clock.progressed();
            } else {
                let want_out = (self.send_step < self.steps && self.sent < self.ready() * size)
                    || links.right.pending();
                wait(
                    links,
                    self.recv_step < self.steps,
                    want_out,
                    &mut clock,
                    watch,
                )?;
            }
        }
        Ok(())
    }

    /// Reduce (reduce-scatter steps) or copy (all-gather steps) received elements into `data`, moving through the
    /// steps as chunks complete (empty chunks, when there are fewer elements than ranks, complete at once).
    /// Returns how many elements of `got` were used.
    fn apply<T: Elem, C: Codec<T>>(&mut self, data: &mut [T], got: &[C::W]) -> usize {
        let mut used = 0;
        while self.recv_step < self.steps {
            let range = self.recv_chunk(self.recv_step);
            let take = (range.len() - self.done).min(got.len() - used);
            let dst = &mut data[range.start + self.done..range.start + self.done + take];
            let src = &got[used..used + take];
            if self.recv_step < self.n - 1 {
                C::add(dst, src);
            } else {
                C::copy(dst, src);
            }
            used += take;
            self.done += take;
            if self.done == range.len() {
                (self.recv_step, self.done) = (self.recv_step + 1, 0);
            } else {
                break;
            }
        }
        used
    }
}

fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

fn io_error(side: Side, source: io::Error) -> RingError {
    match source.kind() {
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::UnexpectedEof => RingError::Closed { side },
        _ => RingError::Io { side, source },
    }
}

/// Wait until the left link is readable (`want_in`) or the right writable (`want_out`), failing once nothing has
/// moved for `watch.stall`, or once the neighbour waited on fails a liveness probe (see [`Watch`]).
fn wait(
    links: &Links,
    want_in: bool,
    want_out: bool,
    clock: &mut Clock,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    let waited = clock.last.elapsed();
    let stall = watch.stall;
    if waited >= stall {
        // Blame the side we were waiting for; waiting to send means the right neighbour stopped reading.
        let side = if want_in { Side::Left } else { Side::Right };
        return Err(RingError::Stalled { side, after: stall });
    }
    if let Some(probe) = watch.probe {
        if clock.last.max(clock.alive).elapsed() >= watch.probe_every {
            let sides = [(want_in, Side::Left), (want_out, Side::Right)];
            for (_, side) in sides.into_iter().filter(|(wanted, _)| *wanted) {
                if let Err(reason) = probe(side) {
                    return Err(RingError::Unresponsive {
                        side,
                        after: clock.last.elapsed(),
                        reason,
                    });
                }
            }
            clock.alive = Instant::now();
        }
    }
    let mut fds = [
        libc::pollfd {
            fd: links.left.as_raw_fd(),
            events: if want_in { libc::POLLIN } else { 0 },
            revents: 0,
        },
        libc::pollfd {
            fd: links.right.as_raw_fd(),
            events: if want_out { libc::POLLOUT } else { 0 },
            revents: 0,
        },
    ];
    let ms = (stall - waited).min(POLL_SLICE).as_millis().max(1) as libc::c_int;
    // SAFETY: `fds` is a valid array of two initialised `pollfd`s that outlives the call, and its length is
    // passed exactly; both descriptors belong to sockets `links` keeps open for the whole call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(RingError::Io {
                side: Side::Left,
                source: e,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// `n` ranks' links over loopback sockets: rank r's right is rank r+1's left.
    fn ring(n: usize) -> Vec<Links> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut rights = Vec::new();
        let mut lefts = Vec::new();
        for _ in 0..n {
            rights.push(TcpStream::connect(addr).unwrap());
            lefts.push(listener.accept().unwrap().0);
        }
        // rights[r] is accepted as lefts[r]; rank (r+1)'s left must be rank r's right.
        lefts.rotate_right(1);
        rights
            .into_iter()
            .zip(lefts)
            .map(|(right, left)| {
                right.set_nonblocking(true).unwrap();
                left.set_nonblocking(true).unwrap();
                Links {
                    left: left.into(),
                    right: right.into(),
                }
            })
            .collect()
    }

    fn run<T: Elem + Copy>(inputs: Vec<Vec<T>>, op: Op) -> Vec<Result<Vec<T>, String>> {
        let n = inputs.len();
        let links = ring(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = inputs
                .into_iter()
                .zip(links)
                .enumerate()
                .map(|(rank, (mut data, mut links))| {
                    s.spawn(move || {
                        allreduce(
                            &mut data,
                            rank,
                            n,
                            &mut links,
                            op,
                            Watch::stall(Duration::from_secs(10)),
                        )
                        .map(|_| data)
                        .map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Like `run`, each rank with its own codec (`wires[r]`: 0 plain, 1 float16, 2 bfloat16).
    fn run_wire(inputs: Vec<Vec<f32>>, wires: &[u8], op: Op) -> Vec<Result<Vec<f32>, String>> {
        let n = inputs.len();
        let links = ring(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = inputs
                .into_iter()
                .zip(links)
                .enumerate()
                .map(|(rank, (mut data, mut links))| {
                    let wire = wires[rank];
                    s.spawn(move || {
                        let d = Watch::stall(Duration::from_secs(10));
                        match wire {
                            1 => allreduce_over::<f32, F16Wire>(
                                &mut data, rank, n, &mut links, op, d,
                            ),
                            2 => allreduce_over::<f32, Bf16Wire>(
                                &mut data, rank, n, &mut links, op, d,
                            ),
                            _ => allreduce(&mut data, rank, n, &mut links, op, d),
                        }
                        .map(|_| data)
                        .map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn half_on_the_wire_sums_in_float32_and_every_rank_agrees() {
        for (wire, tol) in [(1u8, 2e-3f32), (2u8, 1.6e-2f32)] {
            for n in [2, 3, 5] {
                for len in [0, 1, 7, 1023, 100_003] {
                    let ins: Vec<Vec<f32>> = (0..n)
                        .map(|r| {
                            (0..len)
                                .map(|i| ((i * 7919 + r * 104_729) % 2000) as f32 * 1e-3 - 1.0)
                                .collect()
                        })
                        .collect();
                    let want: Vec<f32> = (0..len).map(|i| ins.iter().map(|v| v[i]).sum()).collect();
                    let outs: Vec<Vec<f32>> = run_wire(ins, &vec![wire; n], Op::Sum)
                        .into_iter()
                        .map(|o| o.unwrap_or_else(|e| panic!("wire {wire} n={n} len={len}: {e}")))
                        .collect();
                    for (i, w) in want.iter().enumerate() {
                        // Each hop rounds the partial sum to the wire type: error grows with the ranks.
                        let err = (outs[0][i] - w).abs();
                        assert!(
                            err <= tol * n as f32 * w.abs().max(1.0),
                            "wire {wire} n={n} i={i}: {err}"
                        );
                    }
                    for o in &outs[1..] {
                        assert!(
                            o.iter()
                                .zip(&outs[0])
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "wire {wire} n={n} len={len}: ranks differ"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn half_on_the_wire_keeps_exact_values_exact() {
        // Small integers are exact in float16: a mean of them comes back exactly.
        let ins: Vec<Vec<f32>> = (0..4).map(|r| vec![r as f32 * 4.0; 4097]).collect();
        for out in run_wire(ins, &[1; 4], Op::Mean) {
            assert_eq!(out.unwrap(), vec![6.0f32; 4097]);
        }
    }

    #[test]
    fn ranks_with_different_wire_types_refuse() {
        let ins: Vec<Vec<f32>> = (0..3).map(|_| vec![1.0f32; 100]).collect();
        let outs = run_wire(ins, &[0, 1, 1], Op::Sum);
        assert!(
            outs.iter().any(|o| o
                .as_ref()
                .is_err_and(|e| e.contains("float32 over float16"))),
            "{outs:?}"
        );
    }

    fn inputs(n: usize, len: usize) -> Vec<Vec<f64>> {
        (0..n)
            .map(|r| (0..len).map(|i| (r * 1000 + i) as f64 * 0.5).collect())
            .collect()
    }

    #[test]
    fn chunks_cover_every_element_once() {
        for (len, n) in [(0, 3), (1, 4), (7, 3), (10, 10), (1000, 7)] {
            let mut next = 0;
            for c in 0..n {
                let r = chunk(len, n, c);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn sums_match_for_odd_sizes_and_rank_counts() {
        for n in 2..=6 {
            for len in [0, 1, 2, 5, 1023, 300_001] {
                let ins = inputs(n, len);
                let want: Vec<f64> = (0..len).map(|i| ins.iter().map(|v| v[i]).sum()).collect();
                for out in run(ins, Op::Sum) {
                    let out = out.unwrap_or_else(|e| panic!("n={n} len={len}: {e}"));
                    assert_eq!(out, want, "n={n} len={len}");
                }
            }
        }
    }

    #[test]
    fn back_to_back_passes_on_the_same_links_stay_apart() {
        // A fast rank starts the next pass (its header) while a slow one still reads the last: never mixed.
        let n = 4;
        let links = ring(n);
        std::thread::scope(|s| {
            for (rank, mut l) in links.into_iter().enumerate() {
                s.spawn(move || {
                    for pass in 0..30usize {
                        let len = 1 + (pass * 7919) % 5000;
                        let mut data: Vec<f64> =
                            (0..len).map(|i| (rank + i + pass) as f64).collect();
                        allreduce(
                            &mut data,
                            rank,
                            n,
                            &mut l,
                            Op::Sum,
                            Watch::stall(Duration::from_secs(10)),
                        )
                        .unwrap();
                        let want: Vec<f64> = (0..len)
                            .map(|i| (0..n).map(|r| (r + i + pass) as f64).sum())
                            .collect();
                        assert_eq!(data, want, "rank {rank} pass {pass}");
                    }
                });
            }
        });
    }

    #[test]
    fn mean_divides_by_the_rank_count() {
        let ins: Vec<Vec<f32>> = (0..3).map(|r| vec![r as f32 * 3.0; 10]).collect();
        for out in run(ins, Op::Mean) {
            assert_eq!(out.unwrap(), vec![3.0f32; 10]);
        }
    }

    #[test]
    fn every_rank_ends_with_identical_bits() {
        // Float addition is not associative: the ring must still give every rank the same bits.
        let ins: Vec<Vec<f32>> = (0..5)
            .map(|r| {
                (0..10_007)
                    .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 * 1e-3 + 1e-7)
                    .collect()
            })
            .collect();
        let outs: Vec<_> = run(ins, Op::Sum).into_iter().map(Result::unwrap).collect();
        for o in &outs[1..] {
            assert!(o
                .iter()
                .zip(&outs[0])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn ranks_that_disagree_on_sizes_refuse() {
        let mut ins = inputs(3, 100);
        ins[1].push(1.0);
        let outs = run(ins, Op::Sum);
        assert!(
            outs.iter()
                .any(|o| o.as_ref().is_err_and(|e| e.contains("101"))),
            "{outs:?}"
        );
    }

    #[test]
    fn a_neighbour_that_leaves_fails_the_pass_instead_of_hanging() {
        let mut links = ring(3);
        let gone = links.pop().unwrap(); // rank 2 never runs
        drop(gone);
        let t0 = Instant::now();
        let outs: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = links
                .into_iter()
                .enumerate()
                .map(|(rank, mut l)| {
                    s.spawn(move || {
                        let mut data = vec![1.0f32; 1 << 20];
                        allreduce(
                            &mut data,
                            rank,
                            3,
                            &mut l,
                            Op::Sum,
                            Watch::stall(Duration::from_secs(5)),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(outs.iter().all(Result::is_err), "{outs:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(4),
            "took {:?}",
            t0.elapsed()
        );
    }

    #[test]
    fn a_silent_neighbour_stalls_out() {
        let mut links = ring(2);
        let _silent = links.pop().unwrap(); // open but never runs
        let mut mine = links.pop().unwrap();
        let mut data = vec![1.0f32; 10];
        let err = allreduce(
            &mut data,
            0,
            2,
            &mut mine,
            Op::Sum,
            Watch::stall(Duration::from_millis(300)),
        )
        .unwrap_err();
        assert!(matches!(err, RingError::Stalled { .. }), "{err}");
    }

    #[test]
    fn a_silent_neighbour_that_fails_its_probe_ends_the_pass_long_before_the_stall_timeout() {
        let mut links = ring(2);
        let _frozen = links.pop().unwrap(); // open but never runs, as a SIGSTOPped process
        let mut mine = links.pop().unwrap();
        let mut data = vec![1.0f32; 10];
        let asked = std::sync::Mutex::new(Vec::new());
        let probe = |side: Side| {
            asked.lock().unwrap().push(side);
            Err("no answer within 1s".to_string())
        };
        let t0 = Instant::now();
        let err = allreduce(
            &mut data,
            0,
            2,
            &mut mine,
            Op::Sum,
            Watch {
                stall: Duration::from_secs(60),
                probe_every: Duration::from_millis(300),
                probe: Some(&probe),
            },
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                RingError::Unresponsive {
                    side: Side::Left,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("no answer within 1s"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert_eq!(*asked.lock().unwrap(), vec![Side::Left]); // the side it waited on, once
        assert_eq!(data, vec![1.0f32; 10]); // nothing reduced
    }

    #[test]
    fn a_slow_neighbour_that_answers_its_probes_is_waited_for() {
        let mut links = ring(2);
        let mut late = links.pop().unwrap();
        let mut mine = links.pop().unwrap();
        let probes = std::sync::atomic::AtomicUsize::new(0);
        let probe = |_: Side| {
            probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        };
        let watch = Watch {
            stall: Duration::from_secs(30),
            probe_every: Duration::from_millis(200),
            probe: Some(&probe),
        };
        let out = std::thread::scope(|s| {
            let h = s.spawn(move || {
                // Still computing for a while, then joins.
                std::thread::sleep(Duration::from_millis(1500));
                let mut d = vec![2.0f32; 10];
                allreduce(
                    &mut d,
                    1,
                    2,
                    &mut late,
                    Op::Sum,
                    Watch::stall(Duration::from_secs(30)),
                )
                .map(|_| d)
            });
            let mut d = vec![1.0f32; 10];
            let mine = allreduce(&mut d, 0, 2, &mut mine, Op::Sum, watch).map(|_| d);
            (mine, h.join().unwrap())
        });
        assert_eq!(out.0.unwrap(), vec![3.0f32; 10]);
        assert_eq!(out.1.unwrap(), vec![3.0f32; 10]);
        // Probed while it waited (about every 200 ms of the 1.5 s), not on every poll.
        let k = probes.load(std::sync::atomic::Ordering::Relaxed);
        assert!((3..=12).contains(&k), "{k} probes");
    }
}
