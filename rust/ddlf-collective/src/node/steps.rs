//! A call's steps (see the module docs): 0-3 ([`Node::run`]: the shapes agreed, the data into the slots, each
//! member's chunk summed, the leaders' ring), 4 ([`Node::finish`]: the result copied out), and the all-gather's
//! own steps; with the arithmetic they share (a range of a list of parts, one term of a sum).

use std::ops::Range;
use std::sync::atomic::Ordering;

use super::segment::W_SHAPE;
use super::{total, Mode, Node, Ready};
use crate::ring::{Elem, Op};
use crate::CollectiveError;

impl Node {
    /// Steps 0-3 of a call (or the all-gather's), reading `parts`; [`Node::finish`] is step 4.
    pub(super) fn run<T: Elem>(
        &mut self,
        parts: &[&[T]],
        op: Op,
        mode: &Mode,
        tag: u32,
        prepare: impl FnOnce() -> Result<(), CollectiveError>,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<Ready, CollectiveError> {
        let (k, j, len, elem) = (
            self.members(),
            self.spec.index,
            parts.iter().map(|p| p.len()).sum::<usize>(),
            std::mem::size_of::<T>(),
        );
        if self.control.is_none() {
            let control = self.attach(&self.path("control"), 0, 1)?;
            self.control = Some(control);
        }
        if self.is_leader() {
            prepare()?;
        }
        // 0. Agree on the call's shape (members that disagree fail together, instead of waiting apart).
        let control = self.control()?;
        control
            .word(W_SHAPE + 2 * j)
            .store(len as u64, Ordering::Relaxed);
        let code = match mode {
            Mode::Both => 0u64,
            Mode::Scatter(_) => 1,
            Mode::Gather(_) => 2,
        };
        if let Mode::Scatter(r) | Mode::Gather(r) = mode {
            if r.end > len || r.start > r.end {
                return Err(CollectiveError::Invalid(format!(
                    "a shard {r:?} of {len} elements"
                )));
            }
        }
        control.word(W_SHAPE + 2 * j + 1).store(
            elem as u64 | code << 32 | (tag as u64) << 40,
            Ordering::Relaxed,
        );
        self.wait_all()?;
        if let Some(control) = self.control.as_mut() {
            // Every member has mapped the control file: nobody needs its name any more.
            control.unlink();
        }
        let control = self.control()?;
        for i in 0..k {
            let theirs = (
                control.word(W_SHAPE + 2 * i).load(Ordering::Relaxed) as usize,
                control.word(W_SHAPE + 2 * i + 1).load(Ordering::Relaxed) as usize,
            );
            let ours = elem | (code as usize) << 32 | (tag as usize) << 40;
            if theirs != (len, ours) {
                let call = |c: usize| {
                    ["an all-reduce", "a reduce-scatter", "an all-gather"]
                        [((c >> 32) & 0xff).min(2)]
                };
                return Err(self.fail(
                    i,
                    format!(
                        "members disagree: member {i} makes {} of {} elements of {} bytes (tag {}), member {j} {} \
                         of {len} of {elem} (tag {tag})",
                        call(theirs.1),
                        theirs.0,
                        theirs.1 & 0xffff_ffff,
                        theirs.1 >> 40,
                        call(ours),
                    ),
                ));
            }
        }
        let current = self.segment_for(len, elem, tag)?;
        if let Mode::Gather(shard) = mode {
            return self.gather(current, parts, shard.clone(), inter);
        }
        // One host holding every rank: no ring between hosts, so the mean is taken as the sums are made.
        let single = self.spec.total == k;
        let by = match op {
            Op::Sum => None,
            Op::Mean => Some(1.0 / self.spec.total as f64),
        };
        // 1. Into this member's slot, every chunk of its data but its own (which it sums from `parts` itself).
        let mine = crate::ring::chunk(len, k, j);
        let seg = &self.segments[current];
        // SAFETY: `region` checked that `len` elements of `T` at slot `j` lie inside the mapping, aligned. Slot `j`
        // is written by this member only, and read by others only after the barrier below.
        let slot = unsafe { std::slice::from_raw_parts_mut(seg.region::<T>(j, len), len) };
        for (piece, at) in pieces(parts, 0..len) {
            for r in [
                at.start..at.end.min(mine.start),
                at.start.max(mine.end)..at.end,
            ] {
                if r.start < r.end {
                    slot[r.clone()].copy_from_slice(&piece[r.start - at.start..r.end - at.start]);
                }
            }
        }
        self.wait_all()?;
        // Every member has mapped the data file: nobody needs its name any more.
        self.segments[current].unlink();
        // 2. This member's chunk of the sum, the members' terms in member order (scaled for a mean on one host).
        let seg = &self.segments[current];
        // SAFETY: the result region holds `len` elements (checked by `region`); this member writes only its own
        // chunk of it (chunks of different members are disjoint), and nobody reads it before the next barrier.
        let out = unsafe {
            std::slice::from_raw_parts_mut(seg.region::<T>(k, len).add(mine.start), mine.len())
        };
        for i in 0..k {
            let last = if single && i + 1 == k { by } else { None };
            if i == j {
                for (piece, at) in pieces(parts, mine.clone()) {
                    combine(
                        &mut out[at.start - mine.start..at.end - mine.start],
                        piece,
                        i == 0,
                        last,
                    );
                }
            } else {
                // SAFETY: slot `i` holds `len` elements, all written before the barrier passed and not written
                // again before the next call's barriers, which this member has not reached.
                let src = unsafe {
                    std::slice::from_raw_parts(seg.region::<T>(i, len).add(mine.start), mine.len())
                };
                combine(out, src, i == 0, last);
            }
        }
        self.wait_all()?;
        // 3. The hosts' sums (or, for a reduce-scatter, each host's chunk of them), on the leaders' ring.
        if !single {
            self.leaders(current, len, inter)?;
        }
        // On one host the sums are scaled already.
        Ok(Ready {
            current,
            len,
            scale: if single { None } else { by },
        })
    }

    /// Step 4, the result (or this member's shard of it) to every member: `dst` is written only now, after the
    /// last step that can fail.
    pub(super) fn finish<T: Elem>(&self, ready: Ready, dst: &mut [&mut [T]], mode: &Mode) {
        let len = total(dst);
        let seg = &self.segments[ready.current];
        // SAFETY: the last barrier passed (every chunk summed, the leader's ring done); the next call writes the
        // result region only after a barrier of its own, which every member reaches only after this copy. The
        // region holds `len` elements: `run` checked the call's shape, and `dst` holds as many as the sources.
        let all = unsafe { std::slice::from_raw_parts(seg.region::<T>(self.members(), len), len) };
        if let Mode::Scatter(shard) = mode {
            if let [data] = dst {
                combine(
                    &mut data[shard.clone()],
                    &all[shard.clone()],
                    true,
                    ready.scale,
                );
            }
            return;
        }
        let mut at = 0;
        for part in dst.iter_mut() {
            combine(part, &all[at..at + part.len()], true, ready.scale);
            at += part.len();
        }
    }

    /// The leaders' stage (step 3, or the all-gather's): the leader runs `inter` on the result region of segment
    /// `current`, then every member waits for it at a barrier. Called once every member has written its part of
    /// the region (a barrier passed).
    fn leaders<T: Elem>(
        &mut self,
        current: usize,
        len: usize,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        if self.is_leader() {
            let seg = &self.segments[current];
            // SAFETY: every member finished its part of the region (the caller's barrier passed); until the next
            // barrier only the leader touches it, and `region` checked that `len` elements fit.
            let all = unsafe {
                std::slice::from_raw_parts_mut(seg.region::<T>(self.members(), len), len)
            };
            inter(all)?;
        }
        self.wait_all()
    }

    /// The all-gather's steps after the shapes agreed (see the module docs).
    fn gather<T: Elem>(
        &mut self,
        current: usize,
        parts: &[&[T]],
        shard: Range<usize>,
        inter: impl FnOnce(&mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<Ready, CollectiveError> {
        let [data] = parts else {
            return Err(CollectiveError::Invalid(
                "an all-gather takes one array".into(),
            ));
        };
        let (k, len) = (self.members(), data.len());
        let seg = &self.segments[current];
        // SAFETY: the result region holds `len` elements (checked by `region`). Every member passed this call's
        // first barrier, so none still reads the region for an earlier call; each writes only its own shard
        // (the members' shards are disjoint), and nobody reads the region before the next barrier.
        let out = unsafe {
            std::slice::from_raw_parts_mut(seg.region::<T>(k, len).add(shard.start), shard.len())
        };
        out.copy_from_slice(&data[shard]);
        self.wait_all()?;
        self.segments[current].unlink();
        self.leaders(current, len, inter)?;
        Ok(Ready {
            current,
            len,
            scale: None,
        })
    }
}

/// The pieces of `parts` (one sequence of elements, their concatenation) that fall in `range`: each as the slice
/// and the range of the sequence it covers.
fn pieces<'a, T>(
    parts: &'a [&[T]],
    range: Range<usize>,
) -> impl Iterator<Item = (&'a [T], Range<usize>)> {
    let mut at = 0;
    parts.iter().filter_map(move |part| {
        let whole = at..at + part.len();
        at = whole.end;
        let (start, end) = (whole.start.max(range.start), whole.end.min(range.end));
        (start < end).then(|| (&part[start - whole.start..end - whole.start], start..end))
    })
}

/// One member's term of a sum: `dst = src` (the first term) or `dst += src`, then, for the last term of a mean,
/// times `by`; with `first`, also a copy out, scaled or not (a scaled sum has the same bits either way).
fn combine<T: Elem>(dst: &mut [T], src: &[T], first: bool, by: Option<f64>) {
    match (first, by) {
        (true, None) => dst.copy_from_slice(src),
        (true, Some(by)) => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.scale(by)),
        (false, None) => dst.iter_mut().zip(src).for_each(|(d, s)| *d = d.add(*s)),
        (false, Some(by)) => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = d.add(*s).scale(by)),
    }
}

#[cfg(test)]
mod tests {
    use super::{combine, pieces};

    #[test]
    fn pieces_cover_a_range_of_the_parts_concatenation_in_order() {
        let (a, b, c, e) = (
            vec![0, 1, 2],
            vec![3, 4],
            vec![5, 6, 7, 8],
            Vec::<i32>::new(),
        );
        let parts: Vec<&[i32]> = vec![&a, &e, &b, &c];
        let got = |r| {
            pieces(&parts, r)
                .map(|(p, at)| (p.to_vec(), at))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            got(2..6),
            vec![(vec![2], 2..3), (vec![3, 4], 3..5), (vec![5], 5..6)]
        );
        assert_eq!(got(0..9).len(), 3); // the empty part yields nothing
        assert_eq!(got(3..5), vec![(vec![3, 4], 3..5)]);
        assert!(got(4..4).is_empty());
    }

    #[test]
    fn combined_terms_are_the_sum_in_order_then_the_scale() {
        let terms = [[1.5f32, -2.0], [0.25, 4.0], [3.0, 1.0]];
        let mut out = [0f32; 2];
        for (i, t) in terms.iter().enumerate() {
            combine(&mut out, t, i == 0, (i == 2).then_some(1.0 / 3.0));
        }
        let want = |i: usize| ((terms[0][i] + terms[1][i] + terms[2][i]) as f64 / 3.0) as f32;
        assert_eq!(out, [want(0), want(1)]);
        let mut one = [0f32; 2];
        combine(&mut one, &terms[0], true, Some(0.5));
        assert_eq!(one, [0.75, -1.0]);
    }
}
