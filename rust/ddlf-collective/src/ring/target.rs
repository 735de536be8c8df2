//! Where a pass reads what it sends and writes what it receives ([`Target`]): one buffer reduced in place (`[T]`),
//! or the caller's arrays only read and the results written into other arrays ([`OutOfPlace`]), both sides cut
//! however the caller likes. Out of place, a list of gradients goes to the wire from the arrays its framework made
//! and the results land in the arrays it reads next: no gather into a buffer before the pass, no copy out after it.

use std::ops::Range;

use super::{Codec, Elem};

/// What a pass does with a call's elements, addressed as one sequence `0..len` however they are stored.
pub(super) trait Target<T: Elem> {
    /// Elements in the sequence.
    fn elements(&self) -> usize;
    /// The results as the input, unreduced (a ring of one: its sum and its mean are its values).
    fn unreduced(&mut self);
    /// The elements from `at` that one send can read without a gap, up to `end` at most (`at < end`): the
    /// caller's own values (`own`: the pass's first send step, whose chunk nothing has touched), else what the
    /// pass has made of them so far.
    fn outgoing(&self, own: bool, at: usize, end: usize) -> &[T];
    /// The caller's values from `at` plus the received `src` (a reduce-scatter step), as results.
    fn reduce<C: Codec<T>>(&mut self, at: usize, src: &[C::W]);
    /// The received `src` from `at` as results (an all-gather step, or an owner keeping its rounded values),
    /// times `by` where given.
    fn put<C: Codec<T>>(&mut self, at: usize, src: &[C::W], by: Option<f64>);
    /// The results in `range` times `by`.
    fn scale(&mut self, range: Range<usize>, by: f64);
}

impl<T: Elem> Target<T> for [T] {
    fn elements(&self) -> usize {
        self.len()
    }

    fn unreduced(&mut self) {} // they are the input

    fn outgoing(&self, _own: bool, at: usize, end: usize) -> &[T] {
        &self[at..end]
    }

    fn reduce<C: Codec<T>>(&mut self, at: usize, src: &[C::W]) {
        C::add(&mut self[at..at + src.len()], src);
    }

    fn put<C: Codec<T>>(&mut self, at: usize, src: &[C::W], by: Option<f64>) {
        let dst = &mut self[at..at + src.len()];
        C::copy(dst, src);
        if let Some(by) = by {
            scale(dst, by);
        }
    }

    fn scale(&mut self, range: Range<usize>, by: f64) {
        scale(&mut self[range], by);
    }
}

pub(super) fn scale<T: Elem>(data: &mut [T], by: f64) {
    for x in data.iter_mut() {
        *x = x.scale(by);
    }
}

/// The caller's arrays (`input`, only read) and where the results go (`out`, as many elements), each a sequence
/// of slices cut anywhere (empty ones are dropped).
pub struct OutOfPlace<'a, T> {
    input: Vec<&'a [T]>,
    /// Where each slice of `input` starts in the sequence.
    input_at: Vec<usize>,
    out: Vec<&'a mut [T]>,
    out_at: Vec<usize>,
}

impl<'a, T: Elem> OutOfPlace<'a, T> {
    /// `None` where `input` and `out` hold different numbers of elements.
    pub fn new(input: Vec<&'a [T]>, out: Vec<&'a mut [T]>) -> Option<Self> {
        let input: Vec<&[T]> = input.into_iter().filter(|s| !s.is_empty()).collect();
        let out: Vec<&mut [T]> = out.into_iter().filter(|s| !s.is_empty()).collect();
        let input_at = starts(input.iter().map(|s| s.len()));
        let out_at = starts(out.iter().map(|s| s.len()));
        let same = input.iter().map(|s| s.len()).sum::<usize>()
            == out.iter().map(|s| s.len()).sum::<usize>();
        same.then_some(OutOfPlace {
            input,
            input_at,
            out,
            out_at,
        })
    }

    /// Elements in the sequence.
    pub fn len(&self) -> usize {
        self.input.iter().map(|s| s.len()).sum()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.input.is_empty()
    }

    /// The results as the input (a ring of one: the sum and the mean of one value are the value).
    pub fn copy(&mut self) {
        let len = self.len();
        self.runs(0, len, |input, out, _| out.copy_from_slice(input));
    }

    /// Consecutive parts of the sequence, `lens` elements each (`lens` adds up to its length: one part per
    /// length, empty ones too): each stream of a ring reduces its own.
    pub fn split(self, lens: &[usize]) -> Vec<OutOfPlace<'a, T>> {
        let inputs = cut(self.input, lens, |s, n| s.split_at(n));
        let outs = cut(self.out, lens, |s, n| s.split_at_mut(n));
        inputs
            .into_iter()
            .zip(outs)
            .filter_map(|(i, o)| OutOfPlace::new(i, o))
            .collect()
    }

    /// Walk `at..at + len` in runs that lie within one input slice and one output slice: `(input run, output
    /// run, offset of the run from at)`.
    fn runs(&mut self, at: usize, len: usize, mut each: impl FnMut(&[T], &mut [T], usize)) {
        let mut done = 0;
        while done < len {
            let p = at + done;
            let (i, o) = (piece(&self.input_at, p), piece(&self.out_at, p));
            let (a, b) = (p - self.input_at[i], p - self.out_at[o]);
            let n = (len - done)
                .min(self.input[i].len() - a)
                .min(self.out[o].len() - b);
            each(&self.input[i][a..a + n], &mut self.out[o][b..b + n], done);
            done += n;
        }
    }

    /// Walk `at..at + len` of the results in runs within one output slice: `(run, offset of the run from at)`.
    fn out_runs(&mut self, at: usize, len: usize, mut each: impl FnMut(&mut [T], usize)) {
        let mut done = 0;
        while done < len {
            let p = at + done;
            let o = piece(&self.out_at, p);
            let b = p - self.out_at[o];
            let n = (len - done).min(self.out[o].len() - b);
            each(&mut self.out[o][b..b + n], done);
            done += n;
        }
    }
}

impl<T: Elem> Target<T> for OutOfPlace<'_, T> {
    fn elements(&self) -> usize {
        self.len()
    }

    fn unreduced(&mut self) {
        self.copy();
    }

    fn outgoing(&self, own: bool, at: usize, end: usize) -> &[T] {
        let (s, from): (&[T], usize) = if own {
            let p = piece(&self.input_at, at);
            (self.input[p], at - self.input_at[p])
        } else {
            let p = piece(&self.out_at, at);
            (&self.out[p][..], at - self.out_at[p])
        };
        &s[from..s.len().min(from + end - at)]
    }

    fn reduce<C: Codec<T>>(&mut self, at: usize, src: &[C::W]) {
        self.runs(at, src.len(), |a, dst, k| {
            C::sum(dst, a, &src[k..k + dst.len()])
        });
    }

    fn put<C: Codec<T>>(&mut self, at: usize, src: &[C::W], by: Option<f64>) {
        self.out_runs(at, src.len(), |dst, k| {
            C::copy(dst, &src[k..k + dst.len()]);
            if let Some(by) = by {
                scale(dst, by);
            }
        });
    }

    fn scale(&mut self, range: Range<usize>, by: f64) {
        self.out_runs(range.start, range.len(), |dst, _| scale(dst, by));
    }
}

/// Where each of slices of `lens` starts in their sequence.
fn starts(lens: impl Iterator<Item = usize>) -> Vec<usize> {
    lens.scan(0, |at, n| {
        let start = *at;
        *at += n;
        Some(start)
    })
    .collect()
}

/// The slice that holds element `at` (`starts` of non-empty slices, `at` inside the sequence).
fn piece(starts: &[usize], at: usize) -> usize {
    starts.partition_point(|&s| s <= at) - 1
}

/// `slices` recut into consecutive groups of `lens` elements each.
fn cut<S>(slices: Vec<S>, lens: &[usize], split: impl Fn(S, usize) -> (S, S)) -> Vec<Vec<S>>
where
    S: Len,
{
    let mut groups = Vec::with_capacity(lens.len());
    let mut rest = slices.into_iter();
    let mut carry: Option<S> = None;
    for &want in lens {
        let mut group = Vec::new();
        let mut need = want;
        while need > 0 {
            let Some(s) = carry.take().or_else(|| rest.next()) else {
                break;
            };
            if s.size() <= need {
                need -= s.size();
                group.push(s);
            } else {
                let (head, tail) = split(s, need);
                group.push(head);
                carry = Some(tail);
                need = 0;
            }
        }
        groups.push(group);
    }
    groups
}

/// A slice's length, shared or not (for [`cut`]).
trait Len {
    fn size(&self) -> usize;
}

impl<T> Len for &[T] {
    fn size(&self) -> usize {
        self.len()
    }
}

impl<T> Len for &mut [T] {
    fn size(&self) -> usize {
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Plain;
    use super::{OutOfPlace, Target};

    #[test]
    fn runs_cross_both_sides_cuts() {
        let (a, b, c): (Vec<f32>, Vec<f32>, Vec<f32>) = (
            (0..3).map(|x| x as f32).collect(),
            vec![],
            (3..8).map(|x| x as f32).collect(),
        );
        let (mut x, mut y) = ([0f32; 5], [0f32; 3]);
        let mut t = OutOfPlace::new(vec![&a, &b, &c], vec![&mut x, &mut y]).expect("same lengths");
        assert_eq!(t.len(), 8);
        assert_eq!(t.outgoing(true, 1, 8), &[1.0, 2.0]);
        assert_eq!(t.outgoing(true, 3, 5), &[3.0, 4.0]);
        let src: Vec<f32> = vec![10.0; 6];
        t.reduce::<Plain>(1, &src);
        assert_eq!(t.outgoing(false, 1, 8), &[11.0, 12.0, 13.0, 14.0]);
        t.put::<Plain>(0, &[4.0], Some(0.5));
        t.scale(6..8, 2.0);
        drop(t);
        assert_eq!(x, [2.0, 11.0, 12.0, 13.0, 14.0]);
        assert_eq!(y, [15.0, 32.0, 0.0]);
    }

    #[test]
    fn a_split_keeps_every_element_in_order() {
        let a: Vec<f32> = (0..7).map(|x| x as f32).collect();
        let (b, c) = a.split_at(4);
        let mut out = [0f32; 7];
        let (x, y) = out.split_at_mut(2);
        let t = OutOfPlace::new(vec![b, c], vec![x, y]).expect("same lengths");
        let mut parts = t.split(&[3, 0, 4]);
        assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [3, 0, 4]);
        for p in parts.iter_mut() {
            p.copy();
        }
        drop(parts);
        assert_eq!(out, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let mut short = [0f32; 6];
        assert!(OutOfPlace::new(vec![&a[..]], vec![&mut short[..]]).is_none());
    }
}
