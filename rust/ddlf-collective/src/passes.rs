//! A ring's passes over its streams, for [`Ring::run`]: a whole all-reduce cut across the streams (in place, or out
//! of place: [`ring::OutOfPlace`]), a flat ring's in-place call through the buffer it keeps (so that a failure
//! leaves the caller's data as it was), and either half of the ring on its first stream.

use crate::ring::{self, Codec, Elem, Op, Phase};
use crate::{CollectiveError, Ring};

impl Ring {
    /// A flat ring's all-reduce of `parts` in place: one part reduced where it lies (its passes write it as they
    /// go), unless `atomic` asks for it to be unchanged after a failure; several parts, or one atomic part,
    /// through the kept buffer ([`Ring::through_buffer`]).
    pub(crate) fn flat_in_place<T: Elem, C: Codec<T>>(
        &mut self,
        parts: &mut [&mut [T]],
        op: Op,
        atomic: bool,
    ) -> Result<(), CollectiveError> {
        match parts {
            [one] if !atomic => self.reduce::<T, C>(one, op),
            _ => {
                let len = parts.iter().map(|p| p.len()).sum();
                self.through_buffer::<T, C>(parts, len, op)
            }
        }
    }

    /// A flat ring's reduction of `parts` (`len` elements together) through its kept buffer: the pass reads the
    /// parts where they lie and writes the results into the buffer, which is copied back only if the reduction
    /// succeeded.
    fn through_buffer<T: Elem, C: Codec<T>>(
        &mut self,
        parts: &mut [&mut [T]],
        len: usize,
        op: Op,
    ) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let flat = flat_buffer::<T>(&mut scratch, len);
        let input: Vec<&[T]> = parts.iter().map(|p| &**p).collect();
        let r = out_of_place(input, vec![&mut *flat])
            .and_then(|data| self.reduce_into::<T, C>(data, op));
        if r.is_ok() {
            copy_concatenation(&[&*flat], parts);
        }
        self.scratch = scratch;
        r
    }

    /// One half of the ring's pass over `data`, on the first stream.
    pub(crate) fn phase<T: Elem, C: Codec<T>>(
        &mut self,
        data: &mut [T],
        op: Op,
        phase: Phase,
    ) -> Result<(), CollectiveError> {
        let (rank, n) = (self.spec.rank, self.n());
        self.on_links(|streams, watch| {
            let links = &mut streams[0].links;
            match phase {
                Phase::Gather => ring::allgather_over::<T, C>(data, rank, n, links, watch),
                _ => ring::reduce_scatter_over::<T, C>(data, rank, n, links, op, watch).map(|_| ()),
            }
        })
    }

    /// An all-reduce of `data` in place, cut across the ring's streams ([`Ring::on_streams`]).
    pub(crate) fn reduce<T: Elem, C: Codec<T>>(
        &mut self,
        data: &mut [T],
        op: Op,
    ) -> Result<(), CollectiveError> {
        let (rank, n, len) = (self.spec.rank, self.n(), data.len());
        let split = |lens: &[usize]| {
            let mut parts: Vec<&mut [T]> = Vec::with_capacity(lens.len());
            let mut rest = data;
            for &len in lens {
                let (head, tail) = rest.split_at_mut(len);
                parts.push(head);
                rest = tail;
            }
            parts
        };
        self.on_streams(len, split, |part, links, watch| {
            ring::allreduce_over::<T, C>(part, rank, n, links, op, watch)
        })
    }

    /// [`Ring::reduce`] out of place: `data`'s input only read, its results written.
    pub(crate) fn reduce_into<T: Elem, C: Codec<T>>(
        &mut self,
        data: ring::OutOfPlace<'_, T>,
        op: Op,
    ) -> Result<(), CollectiveError> {
        let (rank, n) = (self.spec.rank, self.n());
        self.on_streams(
            data.len(),
            |lens| data.split(lens),
            |mut part, links, watch| {
                ring::allreduce_into_over::<T, C>(&mut part, rank, n, links, op, watch)
            },
        )
    }
}

/// The first `len` elements of `scratch` as `T`s, grown (never shrunk) to hold them: `u64` storage is aligned for
/// every element type a ring reduces (4 or 8 bytes).
fn flat_buffer<T: Elem>(scratch: &mut Vec<u64>, len: usize) -> &mut [T] {
    let words = (len * std::mem::size_of::<T>()).div_ceil(8);
    if scratch.len() < words {
        scratch.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, T>(&mut scratch[..words])[..len]
}

/// The refusal of an out-of-place call whose output does not hold as many elements as its input.
pub(crate) fn into_mismatch(len: usize, out: usize) -> CollectiveError {
    CollectiveError::Invalid(format!("an all-reduce of {len} elements into {out}"))
}

/// `input` and `out` as one out-of-place call's target, or [`into_mismatch`].
pub(crate) fn out_of_place<'a, T: Elem>(
    input: Vec<&'a [T]>,
    out: Vec<&'a mut [T]>,
) -> Result<ring::OutOfPlace<'a, T>, CollectiveError> {
    let len = input.iter().map(|i| i.len()).sum();
    let held = out.iter().map(|o| o.len()).sum();
    ring::OutOfPlace::new(input, out).ok_or_else(|| into_mismatch(len, held))
}

/// `dst`'s parts filled, in order, with the concatenation of `src`'s (the two hold as many elements).
fn copy_concatenation<T: Copy>(src: &[&[T]], dst: &mut [&mut [T]]) {
    let mut from = src.iter().copied().filter(|s| !s.is_empty());
    let mut current: &[T] = &[];
    for part in dst.iter_mut() {
        let mut rest: &mut [T] = part;
        while !rest.is_empty() {
            if current.is_empty() {
                match from.next() {
                    Some(next) => current = next,
                    None => return,
                }
            }
            let n = current.len().min(rest.len());
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
            head.copy_from_slice(&current[..n]);
            rest = tail;
            current = &current[n..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{copy_concatenation, flat_buffer};

    #[test]
    fn a_concatenation_is_copied_however_both_sides_are_cut() {
        let src: [&[i32]; 4] = [&[1, 2, 3], &[], &[4], &[5, 6, 7, 8]];
        let (mut a, mut b, mut c) = ([0; 2], [0; 0], [0; 6]);
        copy_concatenation(&src, &mut [&mut a, &mut b, &mut c]);
        assert_eq!((a, c), ([1, 2], [3, 4, 5, 6, 7, 8]));
    }

    #[test]
    fn the_flat_buffer_grows_to_the_call_and_keeps_its_memory() {
        let mut scratch = Vec::new();
        assert_eq!(flat_buffer::<f32>(&mut scratch, 5).len(), 5);
        assert_eq!(scratch.len(), 3); // 20 bytes in 8-byte words
        let first = scratch.as_ptr();
        assert_eq!(flat_buffer::<f64>(&mut scratch, 2).len(), 2);
        assert_eq!(flat_buffer::<f32>(&mut scratch, 0).len(), 0);
        assert_eq!((scratch.len(), scratch.as_ptr()), (3, first)); // smaller calls reuse it
    }
}
