//! Gathering rows of a dataset into a contiguous batch.

/// Errors of a gather request.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GatherError {
    /// An index past the last row.
    #[error("index {index} out of range for {rows} rows")]
    OutOfRange {
        /// The index asked for.
        index: u64,
        /// Rows in the source.
        rows: usize,
    },
    /// The source is not a whole number of rows.
    #[error("source of {src} bytes is not a whole number of {row_bytes}-byte rows")]
    Ragged {
        /// Bytes in the source.
        src: usize,
        /// Bytes per row.
        row_bytes: usize,
    },
}

/// Rows `indices` of `src` (rows of `row_bytes` bytes), in order, in a new vector that is never zero-filled
/// first (every byte is written by the gather); split across `threads` threads when the output is large. Every
/// index is checked before anything is allocated or copied.
pub fn gather_rows_to_vec(
    src: &[u8],
    row_bytes: usize,
    indices: &[u32],
    threads: usize,
) -> Result<Vec<u8>, GatherError> {
    if row_bytes == 0 {
        return Ok(Vec::new());
    }
    if !src.len().is_multiple_of(row_bytes) {
        return Err(GatherError::Ragged {
            src: src.len(),
            row_bytes,
        });
    }
    let rows = src.len() / row_bytes;
    if let Some(&bad) = indices.iter().find(|&&i| i as usize >= rows) {
        return Err(GatherError::OutOfRange {
            index: bad as u64,
            rows,
        });
    }
    let total = indices.len() * row_bytes;
    let mut out: Vec<u8> = Vec::with_capacity(total);
    let dst = out.spare_capacity_mut();
    let copy = |dst: &mut [std::mem::MaybeUninit<u8>], idx: &[u32]| {
        for (d, &i) in dst.chunks_exact_mut(row_bytes).zip(idx) {
            let start = i as usize * row_bytes;
            let row = &src[start..start + row_bytes];
            // SAFETY: `d` and `row` are both `row_bytes` long and do not overlap (distinct allocations).
            unsafe {
                std::ptr::copy_nonoverlapping(row.as_ptr(), d.as_mut_ptr() as *mut u8, row_bytes);
            }
        }
    };
    const PARALLEL_BYTES: usize = 8 << 20;
    if threads > 1 && total >= PARALLEL_BYTES {
        let per = indices.len().div_ceil(threads);
        std::thread::scope(|s| {
            for (d, idx) in dst[..total]
                .chunks_mut(per * row_bytes)
                .zip(indices.chunks(per))
            {
                s.spawn(move || copy(d, idx));
            }
        });
    } else {
        copy(&mut dst[..total], indices);
    }
    // SAFETY: every one of the `total` bytes was written above.
    unsafe { out.set_len(total) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(src: &[u8], row_bytes: usize, idx: &[u32]) -> Vec<u8> {
        idx.iter()
            .flat_map(|&i| src[i as usize * row_bytes..(i as usize + 1) * row_bytes].to_vec())
            .collect()
    }

    #[test]
    fn gathers_in_order() {
        let src: Vec<u8> = (0..12).collect();
        let out = gather_rows_to_vec(&src, 3, &[3, 0, 2], 1).unwrap();
        assert_eq!(out, vec![9, 10, 11, 0, 1, 2, 6, 7, 8]);
    }

    #[test]
    fn serial_and_parallel_gathers_agree() {
        let src: Vec<u8> = (0..(1u32 << 22)).map(|i| (i % 253) as u8).collect();
        let idx: Vec<u32> = (0..(1u32 << 15))
            .rev()
            .map(|i| (i * 7) % (1 << 15))
            .collect();
        let want = naive(&src, 128, &idx);
        assert_eq!(gather_rows_to_vec(&src, 128, &idx, 1).unwrap(), want);
        assert_eq!(gather_rows_to_vec(&src, 128, &idx, 3).unwrap(), want);
        assert!(gather_rows_to_vec(&src, 128, &[1 << 15], 1).is_err());
        assert!(gather_rows_to_vec(&src, 3, &[0], 1).is_err());
    }

    #[test]
    fn bad_inputs_are_errors() {
        let src: Vec<u8> = (0..12).collect();
        assert_eq!(
            gather_rows_to_vec(&src, 3, &[0, 4], 1),
            Err(GatherError::OutOfRange { index: 4, rows: 4 })
        );
        assert_eq!(
            gather_rows_to_vec(&src, 5, &[0], 1),
            Err(GatherError::Ragged {
                src: 12,
                row_bytes: 5
            })
        );
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Index partitions from the wire: any index list either gathers exactly the rows named or is refused
        /// with an error; it never reads out of bounds or panics.
        #[test]
        fn arbitrary_partitions_are_checked(
            rows in 0usize..40,
            row_bytes in 0usize..9,
            extra in 0usize..3,
            indices in proptest::collection::vec(prop_oneof![0u32..48, any::<u32>()], 0..64),
            threads in 1usize..4,
        ) {
            let src: Vec<u8> = (0..rows * row_bytes + extra).map(|i| i as u8).collect();
            let (ragged, n_rows) = if row_bytes == 0 {
                (false, 0)
            } else {
                (!src.len().is_multiple_of(row_bytes), src.len() / row_bytes)
            };
            match gather_rows_to_vec(&src, row_bytes, &indices, threads) {
                Ok(out) => {
                    prop_assert_eq!(out.len(), if row_bytes == 0 { 0 } else { indices.len() * row_bytes });
                    if row_bytes > 0 {
                        prop_assert!(!ragged);
                        for (k, &i) in indices.iter().enumerate() {
                            let i = i as usize;
                            prop_assert!(i < n_rows);
                            prop_assert_eq!(&out[k * row_bytes..(k + 1) * row_bytes], &src[i * row_bytes..(i + 1) * row_bytes]);
                        }
                    }
                }
                Err(_) => prop_assert!(ragged || indices.iter().any(|&i| i as usize >= n_rows)),
            }
        }
    }
}
