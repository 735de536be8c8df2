//! Splitting a value (a pickle stream plus its out-of-band buffers) into chunks for streaming, and assembling
//! it back on the receiving side.
//!
//! The first chunk of a stream declares the length of every part. The receiver checks those lengths against its
//! limits *before* allocating anything, allocates each part once at its final size, and copies each arriving
//! chunk into place: one copy, peak memory about 1x the value. A stream that delivers more or fewer bytes than
//! declared is an error, never a crash or an unbounded allocation.

use bytes::Bytes;

/// Limits a receiver enforces on a declared value.
#[derive(Clone, Copy, Debug)]
pub struct FrameLimits {
    /// Largest total of all parts.
    pub max_total: u64,
    /// Most parts (pickle + buffers).
    pub max_parts: usize,
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits {
            max_total: 1 << 40,
            max_parts: 1 << 20,
        }
    }
}

/// What can be wrong with a stream.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// No part declared, not even the pickle.
    #[error("a value needs at least the pickle part")]
    NoParts,
    /// More parts declared (first) than the limit allows (second).
    #[error("{0} parts declared, at most {1} allowed")]
    TooManyParts(usize, usize),
    /// The declared part sizes do not add up in 64 bits.
    #[error("declared size overflows")]
    Overflow,
    /// The declared size is over the limit.
    #[error("declared size {declared} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Bytes declared.
        declared: u64,
        /// Bytes allowed.
        limit: u64,
    },
    /// More bytes arrived than were declared.
    #[error("stream carries more bytes than the {declared} declared")]
    Excess {
        /// Bytes declared.
        declared: u64,
    },
    /// The stream ended before the declared bytes arrived.
    #[error("stream ended after {received} of {declared} declared bytes")]
    Truncated {
        /// Bytes that arrived.
        received: u64,
        /// Bytes declared.
        declared: u64,
    },
}

/// Builds a value from the chunks of a stream.
#[derive(Debug)]
pub struct Assembler {
    parts: Vec<Vec<u8>>,
    lengths: Vec<usize>,
    part: usize,
    received: u64,
    declared: u64,
}

impl Assembler {
    /// Check the declared `lengths` (pickle first, then each buffer) against `limits`, then allocate.
    pub fn new(lengths: &[u64], limits: FrameLimits) -> Result<Self, FrameError> {
        let (lengths, declared) = check_lengths(lengths, limits)?;
        let mut assembler = Assembler {
            parts: lengths.iter().map(|&l| Vec::with_capacity(l)).collect(),
            lengths,
            part: 0,
            received: 0,
            declared,
        };
        assembler.skip_full();
        Ok(assembler)
    }

    fn skip_full(&mut self) {
        while self.part < self.parts.len() && self.parts[self.part].len() == self.lengths[self.part]
        {
            self.part += 1;
        }
    }

    /// Append the next chunk of data.
    pub fn push(&mut self, mut data: &[u8]) -> Result<(), FrameError> {
        if self.received + data.len() as u64 > self.declared {
            return Err(FrameError::Excess {
                declared: self.declared,
            });
        }
        self.received += data.len() as u64;
        while !data.is_empty() {
            let part = &mut self.parts[self.part];
            let room = self.lengths[self.part] - part.len();
            let n = room.min(data.len());
            part.extend_from_slice(&data[..n]);
            data = &data[n..];
            self.skip_full();
        }
        Ok(())
    }

    /// Whether every declared byte arrived.
    pub fn is_complete(&self) -> bool {
        self.received == self.declared
    }

    /// The pickle and the buffers, once complete.
    pub fn finish(self) -> Result<(Vec<u8>, Vec<Vec<u8>>), FrameError> {
        if !self.is_complete() {
            return Err(FrameError::Truncated {
                received: self.received,
                declared: self.declared,
            });
        }
        let mut parts = self.parts.into_iter();
        let pickle = parts.next().unwrap_or_default();
        Ok((pickle, parts.collect()))
    }
}

/// Check declared part lengths (pickle first, then each buffer) against `limits`: the lengths as `usize` and
/// their total, or why they cannot be accepted. Nothing is allocated for the parts before this passes.
pub fn check_lengths(
    lengths: &[u64],
    limits: FrameLimits,
) -> Result<(Vec<usize>, u64), FrameError> {
    if lengths.is_empty() {
        return Err(FrameError::NoParts);
    }
    if lengths.len() > limits.max_parts {
        return Err(FrameError::TooManyParts(lengths.len(), limits.max_parts));
    }
    let mut declared: u64 = 0;
    for &l in lengths {
        declared = declared.checked_add(l).ok_or(FrameError::Overflow)?;
    }
    if declared > limits.max_total {
        return Err(FrameError::TooLarge {
            declared,
            limit: limits.max_total,
        });
    }
    let lengths = lengths
        .iter()
        .map(|&l| usize::try_from(l).map_err(|_| FrameError::Overflow))
        .collect::<Result<_, _>>()?;
    Ok((lengths, declared))
}

/// The lengths to declare for a value.
pub fn lengths(pickle: &Bytes, buffers: &[Bytes]) -> Vec<u64> {
    std::iter::once(pickle.len() as u64)
        .chain(buffers.iter().map(|b| b.len() as u64))
        .collect()
}

/// Cut a value into data chunks of at most `chunk` bytes, without copying (each chunk is a slice of a part;
/// a chunk never spans two parts).
pub fn split(pickle: &Bytes, buffers: &[Bytes], chunk: usize) -> Vec<Bytes> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    for part in std::iter::once(pickle).chain(buffers.iter()) {
        let mut start = 0;
        while start < part.len() {
            let end = (start + chunk).min(part.len());
            out.push(part.slice(start..end));
            start = end;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip(pickle: &[u8], buffers: &[Vec<u8>], chunk: usize) -> (Vec<u8>, Vec<Vec<u8>>) {
        let p = Bytes::copy_from_slice(pickle);
        let bufs: Vec<Bytes> = buffers.iter().map(|b| Bytes::copy_from_slice(b)).collect();
        let mut a = Assembler::new(&lengths(&p, &bufs), FrameLimits::default()).unwrap();
        for c in split(&p, &bufs, chunk) {
            a.push(&c).unwrap();
        }
        a.finish().unwrap()
    }

    #[test]
    fn empty_parts_round_trip() {
        let (p, b) = round_trip(b"", &[vec![], vec![1, 2], vec![]], 1);
        assert!(p.is_empty());
        assert_eq!(b, vec![vec![], vec![1, 2], vec![]]);
    }

    #[test]
    fn limits_are_checked_before_allocation() {
        let limits = FrameLimits {
            max_total: 100,
            max_parts: 3,
        };
        assert_eq!(
            Assembler::new(&[50, 51], limits).unwrap_err(),
            FrameError::TooLarge {
                declared: 101,
                limit: 100
            }
        );
        assert!(matches!(
            Assembler::new(&[1, 1, 1, 1], limits),
            Err(FrameError::TooManyParts(4, 3))
        ));
        assert_eq!(
            Assembler::new(&[u64::MAX, 2], FrameLimits::default()).unwrap_err(),
            FrameError::Overflow
        );
        // A huge declared size within an explicit u64 limit is refused by the limit, not by an allocation.
        assert!(Assembler::new(&[u64::MAX / 2], FrameLimits::default()).is_err());
        assert_eq!(
            Assembler::new(&[], limits).unwrap_err(),
            FrameError::NoParts
        );
    }

    #[test]
    fn excess_and_truncation_are_errors() {
        let mut a = Assembler::new(&[2, 2], FrameLimits::default()).unwrap();
        a.push(&[1, 2, 3]).unwrap();
        assert_eq!(
            a.push(&[4, 5]).unwrap_err(),
            FrameError::Excess { declared: 4 }
        );
        assert_eq!(
            a.finish().unwrap_err(),
            FrameError::Truncated {
                received: 3,
                declared: 4
            }
        );
    }

    proptest! {
        #[test]
        fn any_value_round_trips_at_any_chunk_size(
            pickle in proptest::collection::vec(any::<u8>(), 0..300),
            buffers in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..6),
            chunk in 1usize..400,
        ) {
            let (p, b) = round_trip(&pickle, &buffers, chunk);
            prop_assert_eq!(p, pickle);
            prop_assert_eq!(b, buffers);
        }

        #[test]
        fn arbitrary_streams_never_panic(
            lengths in proptest::collection::vec(0u64..1000, 0..8),
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 0..20),
        ) {
            let limits = FrameLimits { max_total: 4000, max_parts: 6 };
            if let Ok(mut a) = Assembler::new(&lengths, limits) {
                let declared: u64 = lengths.iter().sum();
                let mut sent = 0u64;
                let mut failed = false;
                for c in &chunks {
                    match a.push(c) {
                        Ok(()) => sent += c.len() as u64,
                        Err(FrameError::Excess { .. }) => { failed = true; break; }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                let complete = a.is_complete();
                let finished = a.finish();
                if !failed && sent == declared {
                    prop_assert!(complete);
                    prop_assert!(finished.is_ok());
                } else if !failed {
                    prop_assert!(finished.is_err());
                }
            }
        }
    }
}
