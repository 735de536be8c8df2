//! Gathering rows of a dataset into a contiguous batch.

/// Errors of a gather request.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GatherError {
    #[error("index {index} out of range for {rows} rows")]
    OutOfRange { index: u64, rows: usize },
    #[error("source of {src} bytes is not a whole number of {row_bytes}-byte rows")]
    Ragged { src: usize, row_bytes: usize },
    #[error("output of {out} bytes cannot hold {rows} rows of {row_bytes} bytes")]
    OutputSize {
        out: usize,
        rows: usize,
        row_bytes: usize,
    },
}

/// Copy rows `indices` of `src` (rows of `row_bytes` bytes) into `out`, in order. Every index is checked before
/// anything is copied, so a bad index leaves `out` untouched.
pub fn gather_rows(
    src: &[u8],
    row_bytes: usize,
    indices: &[u32],
    out: &mut [u8],
) -> Result<(), GatherError> {
    if row_bytes == 0 {
        return Ok(());
    }
    if !src.len().is_multiple_of(row_bytes) {
        return Err(GatherError::Ragged {
            src: src.len(),
            row_bytes,
        });
    }
    let rows = src.len() / row_bytes;
    if out.len() != indices.len() * row_bytes {
        return Err(GatherError::OutputSize {
            out: out.len(),
            rows: indices.len(),
            row_bytes,
        });
    }
    if let Some(&bad) = indices.iter().find(|&&i| i as usize >= rows) {
        return Err(GatherError::OutOfRange {
            index: bad as u64,
            rows,
        });
    }
    for (dst, &i) in out.chunks_exact_mut(row_bytes).zip(indices) {
        let start = i as usize * row_bytes;
        dst.copy_from_slice(&src[start..start + row_bytes]);
    }
    Ok(())
}

/// Like [`gather_rows`], into a new vector that is never zero-filled first (every byte is written by the
/// gather), split across `threads` threads when the output is large.
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

    #[test]
    fn gathers_in_order() {
        let src: Vec<u8> = (0..12).collect();
        let mut out = vec![0u8; 9];
        gather_rows(&src, 3, &[3, 0, 2], &mut out).unwrap();
        assert_eq!(out, vec![9, 10, 11, 0, 1, 2, 6, 7, 8]);
    }

    #[test]
    fn gather_to_vec_matches_in_place_gather_serial_and_parallel() {
        let src: Vec<u8> = (0..(1u32 << 22)).map(|i| (i % 253) as u8).collect();
        let idx: Vec<u32> = (0..(1u32 << 15))
            .rev()
            .map(|i| (i * 7) % (1 << 15))
            .collect();
        let mut want = vec![0u8; idx.len() * 128];
        gather_rows(&src, 128, &idx, &mut want).unwrap();
        assert_eq!(gather_rows_to_vec(&src, 128, &idx, 1).unwrap(), want);
        assert_eq!(gather_rows_to_vec(&src, 128, &idx, 3).unwrap(), want);
        assert!(gather_rows_to_vec(&src, 128, &[1 << 15], 1).is_err());
        assert!(gather_rows_to_vec(&src, 3, &[0], 1).is_err());
    }

    #[test]
    fn bad_inputs_are_errors_and_leave_output_untouched() {
        let src: Vec<u8> = (0..12).collect();
        let mut out = vec![0u8; 6];
        assert_eq!(
            gather_rows(&src, 3, &[0, 4], &mut out),
            Err(GatherError::OutOfRange { index: 4, rows: 4 })
        );
        assert_eq!(out, vec![0; 6]);
        assert!(gather_rows(&src, 5, &[0], &mut out).is_err());
        assert!(gather_rows(&src, 3, &[0], &mut out).is_err());
    }
}
