//! One pipelined pass of the ring: reduce-scatter then all-gather, the send side of step `t + 1` running as soon
//! as the same elements of step `t` have arrived and been reduced (see the module docs of [`super`]).

use std::ops::Range;

use super::target::Target;
use super::wait::{io_error, retry, wait, Clock, Watch};
use super::{chunk, Codec, Elem, Links, RingError, Side};

/// Bytes read from the left per `read` call at most (the scratch buffer; a few socket buffers' worth).
const SCRATCH_BYTES: usize = 1 << 20;

/// Which steps of the ring a pass runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Both halves: every rank ends with every chunk's sum (the all-reduce).
    Both,
    /// The first `n - 1` steps only: rank `r` ends with chunk `r`'s sum (the reduce-scatter); the other chunks
    /// hold partial sums.
    Scatter,
    /// The last `n - 1` steps only: rank `r` starts with chunk `r` and ends with every rank's chunk (the
    /// all-gather).
    Gather,
}

impl Phase {
    /// The header's code for the phase (ranks that run different phases fail instead of mixing them).
    pub(super) fn code(self) -> u32 {
        match self {
            Phase::Both => 0,
            Phase::Scatter => 1,
            Phase::Gather => 2,
        }
    }
}

/// The progress of one pass.
pub(super) struct Pass {
    len: usize,
    /// Where this rank's chunk rotation starts: its rank for the all-reduce, one before it for the halves (so
    /// that rank `r` owns chunk `r` between them).
    base: usize,
    n: usize,
    /// The first step and the step after the last.
    first: usize,
    steps: usize,
    /// Send side: step, and bytes of that step's chunk written.
    send_step: usize,
    sent: usize,
    /// Receive side: step, and elements of that step's chunk reduced (or copied).
    recv_step: usize,
    done: usize,
    /// What the results are multiplied by (a mean's `1/n`; see [`Pass::scaled`]).
    by: Option<f64>,
}

impl Pass {
    pub(super) fn new(len: usize, rank: usize, n: usize, phase: Phase) -> Self {
        let (base, first, steps) = match phase {
            Phase::Both => (rank, 0, 2 * (n - 1)),
            Phase::Scatter => ((rank + n - 1) % n, 0, n - 1),
            Phase::Gather => ((rank + n - 1) % n, n - 1, 2 * (n - 1)),
        };
        Pass {
            len,
            base,
            n,
            first,
            steps,
            send_step: first,
            sent: 0,
            recv_step: first,
            done: 0,
            by: None,
        }
    }

    /// An all-reduce ([`Phase::Both`]) whose results end multiplied by `by` (a mean's `1/n`). Every rank sends the
    /// finished sums on and scales each chunk once it has no more use for the sum: an all-gather chunk as soon as
    /// it has been sent on, the one received in the last step as it is put. So each result is one sum times
    /// `by`, the same bits on every rank as scaling all of them after the pass, and the scaling is done while the
    /// wire still carries the pass instead of after it.
    pub(super) fn scaled(mut self, by: f64) -> Self {
        self.by = Some(by);
        self
    }

    fn send_chunk(&self, t: usize) -> Range<usize> {
        chunk(self.len, self.n, (self.base + 2 * self.n - t) % self.n)
    }

    fn recv_chunk(&self, t: usize) -> Range<usize> {
        chunk(self.len, self.n, (self.base + 2 * self.n - t - 1) % self.n)
    }

    /// Elements of the current send step's chunk that are ready: all of them in the first step (this rank's own
    /// data) and once the previous step's receive is complete; otherwise those the previous step has received so
    /// far.
    fn ready(&self) -> usize {
        let whole = self.send_chunk(self.send_step).len();
        if self.send_step == self.first || self.recv_step >= self.send_step {
            whole
        } else {
            self.done
        }
    }

    pub(super) fn run<T: Elem, C: Codec<T>, D: Target<T> + ?Sized>(
        mut self,
        data: &mut D,
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
        // Bytes of `scratch` holding received data not yet applied.
        let mut filled = 0usize;
        // Bytes this pass still receives: reads never go past them (into the next call's header, which a fast
        // left neighbour may already have sent).
        let mut expected: usize = (self.first..self.steps)
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
                // This rank's own values go out in the pass's first step; later steps send what it received.
                let own = self.send_step == self.first;
                let mut whole = true; // the write took all it was given: more may go at once
                if self.sent < ready {
                    let at = range.start + self.sent / size;
                    let bytes: &[u8] = if C::PLAIN {
                        bytemuck::cast_slice(data.outgoing(own, at, range.start + ready_elems))
                    } else {
                        while staged < ready_elems {
                            let from = range.start + staged;
                            let piece = data.outgoing(own, from, range.start + ready_elems);
                            let to = staged + piece.len();
                            C::encode(piece, &mut stage[staged..to]);
                            if self.send_step == self.n - 1 {
                                // This rank's finished chunk leaves rounded: keep the rounded value too, so
                                // every rank ends with the same bits.
                                data.put::<C>(from, &stage[staged..to], None);
                            }
                            staged = to;
                        }
                        &bytemuck::cast_slice(&stage[..range.len()])
                            [(at - range.start) * size..ready]
                    };
                    // A partial element already sent: the rest of its bytes first.
                    let bytes = &bytes[self.sent % size..];
                    match links.right.write(bytes) {
                        Ok(k) => {
                            (self.sent, progressed, whole) = (self.sent + k, true, k == bytes.len())
                        }
                        Err(e) if retry(&e) => break,
                        Err(e) => return Err(io_error(Side::Right, e)),
                    }
                }
                if self.sent == range.len() * size {
                    if let (Some(by), true) = (self.by, self.send_step >= self.n - 1) {
                        data.scale(range, by); // an all-gather chunk, sent on as the sum
                    }
                    (self.send_step, self.sent, staged) = (self.send_step + 1, 0, 0);
                    progressed = true;
                } else if !(whole && self.sent < ready) {
                    break;
                }
            }
            // Receive whatever has arrived and apply every whole element of it (empty chunks complete first: a
            // neighbour that finished may already have closed, and nothing is read for them).
            if filled == 0 {
                self.apply::<T, C, D>(data, &[]);
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
                let applied = self.apply::<T, C, D>(data, &scratch[..filled / size]);
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
    fn apply<T: Elem, C: Codec<T>, D: Target<T> + ?Sized>(
        &mut self,
        data: &mut D,
        got: &[C::W],
    ) -> usize {
        let mut used = 0;
        while self.recv_step < self.steps {
            let range = self.recv_chunk(self.recv_step);
            let take = (range.len() - self.done).min(got.len() - used);
            let at = range.start + self.done;
            let src = &got[used..used + take];
            if self.recv_step < self.n - 1 {
                data.reduce::<C>(at, src);
            } else {
                // Scaled as it is put only where it is not sent on (see `scaled`).
                let last = self.recv_step + 1 == self.steps;
                data.put::<C>(at, src, self.by.filter(|_| last));
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
