//! Batches gathered ahead by a background thread: the dataset's rows for each batch of an index partition, copied
//! into fresh contiguous buffers while the consumer trains on the previous ones (MapRDD's overlap of sampling with
//! computation). A source of encoded images is decoded (and resized, and flipped) on the way, on up to
//! [`EncodedRows`]' `threads` threads. The thread never touches Python; the bindings wrap it as `BatchPipeline`.

use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::advice::{resident, set_access, will_need, Access};
use crate::gather::gather_rows_to_vec;
use crate::images::{check_offsets, decode_rows, ImageError, ImageSpec};

/// Rows of one array, as raw memory the prefetcher reads.
pub struct Rows {
    ptr: *const u8,
    bytes: usize,
    row_bytes: usize,
}

// SAFETY: `Rows` is only read, and the contract of `Rows::new` keeps the memory valid and unchanged for as long
// as the prefetcher that reads it lives (its `Drop` joins the thread).
unsafe impl Send for Rows {}
// SAFETY: as above; reads only.
unsafe impl Sync for Rows {}

impl Rows {
    /// # Safety
    /// `ptr` must point to `bytes` readable bytes that stay valid and unmodified until every [`Prefetcher`] given
    /// these rows is dropped.
    pub unsafe fn new(ptr: *const u8, bytes: usize, row_bytes: usize) -> Self {
        Rows {
            ptr,
            bytes,
            row_bytes,
        }
    }

    fn slice(&self) -> &[u8] {
        if self.bytes == 0 {
            return &[];
        }
        // SAFETY: the contract of `Rows::new`: `bytes` readable bytes, alive while the prefetcher lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
}

/// A dataset of encoded images: every file back to back in one buffer, cut by `n + 1` offsets.
pub struct EncodedRows {
    data: Rows,
    offsets: *const u64,
    n: usize,
    spec: ImageSpec,
    threads: usize,
    seed: u64,
}

// SAFETY: read only, and the contract of `EncodedRows::new` keeps both buffers valid and unchanged while the
// prefetcher lives (as for `Rows`).
unsafe impl Send for EncodedRows {}
// SAFETY: as above; reads only.
unsafe impl Sync for EncodedRows {}

impl EncodedRows {
    /// Checks the offsets (n + 1 of them, from 0, never decreasing, within the data) before anything reads them.
    ///
    /// # Safety
    /// `data` as for [`Rows::new`]; `offsets` must point to `n_offsets` aligned, readable `u64` that stay valid
    /// and unmodified until every [`Prefetcher`] given these rows is dropped.
    pub unsafe fn new(
        data: Rows,
        offsets: *const u64,
        n_offsets: usize,
        spec: ImageSpec,
        threads: usize,
        seed: u64,
    ) -> Result<Self, ImageError> {
        if n_offsets == 0 || offsets.is_null() || !offsets.is_aligned() {
            return Err(ImageError::Offsets(
                "there must be n + 1 aligned offsets for n images".into(),
            ));
        }
        // SAFETY: the caller's contract: `n_offsets` readable u64 (non-null and aligned: checked above).
        let offs = unsafe { std::slice::from_raw_parts(offsets, n_offsets) };
        let n = check_offsets(offs, data.bytes)?;
        Ok(EncodedRows {
            data,
            offsets,
            n,
            spec,
            threads: threads.max(1),
            seed,
        })
    }

    /// How many images there are.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether there is no image.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn offsets(&self) -> &[u64] {
        // SAFETY: checked non-null and aligned in `new`, `n + 1` of them readable by its contract.
        unsafe { std::slice::from_raw_parts(self.offsets, self.n + 1) }
    }

    /// The images `rows` decoded into one buffer; `first_position` is where `rows[0]` is in the stream.
    pub fn decode(&self, rows: &[u32], first_position: u64) -> Result<Vec<u8>, ImageError> {
        decode_rows(
            self.data.slice(),
            self.offsets(),
            rows,
            &self.spec,
            self.threads,
            self.seed,
            first_position,
        )
    }
}

/// What a batch is made from: rows of an array copied as they are, or encoded images decoded.
pub enum Source {
    /// Fixed-size rows, copied as they are.
    Rows(Rows),
    /// Encoded images, decoded (and resized, maybe flipped) into fixed-size rows.
    Images(EncodedRows),
}

impl Source {
    /// The memory the source reads: the rows, or the encoded bytes.
    fn region(&self) -> &[u8] {
        match self {
            Source::Rows(r) => r.slice(),
            Source::Images(im) => im.data.slice(),
        }
    }

    /// Ask for the pages of `chunk`'s rows ahead of time (see [`crate::advice`]). Indices out of range are
    /// skipped here; the gather reports them.
    fn read_ahead(&self, chunk: &[u32]) {
        match self {
            Source::Rows(r) => will_need(
                r.slice(),
                chunk
                    .iter()
                    .map(|&i| (i as usize * r.row_bytes, r.row_bytes)),
            ),
            Source::Images(im) => {
                let offsets = im.offsets();
                will_need(
                    im.data.slice(),
                    chunk.iter().filter(|&&i| (i as usize) < im.n).map(|&i| {
                        let (a, b) = (offsets[i as usize], offsets[i as usize + 1]);
                        (a as usize, b.saturating_sub(a) as usize)
                    }),
                )
            }
        }
    }

    fn batch(&self, chunk: &[u32], first_position: u64) -> Result<Vec<u8>, String> {
        match self {
            Source::Rows(r) => {
                gather_rows_to_vec(r.slice(), r.row_bytes, chunk, 1).map_err(|e| e.to_string())
            }
            Source::Images(im) => im.decode(chunk, first_position).map_err(|e| e.to_string()),
        }
    }
}

/// One gathered batch: a buffer per array, its row count, and the seconds the gather took.
#[derive(Debug)]
pub struct Batch {
    /// One buffer per source, `rows` rows each.
    pub buffers: Vec<Vec<u8>>,
    /// Rows in the batch (the last batch may have fewer than the batch size).
    pub rows: usize,
    /// Seconds the prefetch thread spent gathering it.
    pub gather_seconds: f64,
}

/// Why no batch came.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PrefetchError {
    /// Gathering or decoding the batch failed.
    #[error("{0}")]
    Gather(String),
    /// The prefetch thread is gone: every batch was served, or it was stopped.
    #[error("the prefetch thread stopped")]
    Stopped,
    /// No batch was ready within the wait.
    #[error("no batch within {0:?}")]
    Timeout(Duration),
}

/// The batches of `indices`, `batch_size` rows each, gathered up to `ahead` batches in advance.
pub struct Prefetcher {
    // A mutex only to make the receiver `Sync` (the bindings wait without the GIL); there is one consumer.
    rx: Option<Mutex<Receiver<Result<Batch, String>>>>,
    thread: Option<JoinHandle<()>>,
    n_batches: usize,
}

impl Prefetcher {
    /// Start the thread. `drop_last` skips a short last batch. Indices are not checked here: a bad one ends the
    /// stream with [`PrefetchError::Gather`] (the bindings check them against the row count first).
    pub fn start(
        sources: Vec<Source>,
        indices: Vec<u32>,
        batch_size: usize,
        ahead: usize,
        drop_last: bool,
    ) -> std::io::Result<Self> {
        let batch_size = batch_size.max(1);
        let n_batches = if drop_last {
            indices.len() / batch_size
        } else {
            indices.len().div_ceil(batch_size)
        };
        let sources = Arc::new(sources);
        let (tx, rx) = sync_channel(ahead.max(1));
        let thread = std::thread::Builder::new()
            .name("ddlf-prefetch".into())
            .spawn(move || {
                let chunk_of =
                    |b: usize| &indices[b * batch_size..((b + 1) * batch_size).min(indices.len())];
                // Pages of the next `read_ahead` batches are requested before they are gathered: a mapped file
                // larger than memory is read by queued requests, not one fault at a time. Memory already
                // resident gets no advice (see `crate::advice`).
                let read_ahead = ahead.max(1) + 2;
                let advised: Vec<&Source> =
                    sources.iter().filter(|s| !resident(s.region())).collect();
                for s in &advised {
                    set_access(s.region(), Access::Random);
                }
                for b in 0..read_ahead.min(n_batches) {
                    advised.iter().for_each(|s| s.read_ahead(chunk_of(b)));
                }
                for b in 0..n_batches {
                    if b + read_ahead < n_batches {
                        let next = chunk_of(b + read_ahead);
                        advised.iter().for_each(|s| s.read_ahead(next));
                    }
                    let chunk = chunk_of(b);
                    let t0 = Instant::now();
                    let first = (b * batch_size) as u64;
                    let gathered: Result<Vec<Vec<u8>>, String> =
                        sources.iter().map(|s| s.batch(chunk, first)).collect();
                    let msg = gathered.map(|buffers| Batch {
                        buffers,
                        rows: chunk.len(),
                        gather_seconds: t0.elapsed().as_secs_f64(),
                    });
                    if tx.send(msg).is_err() {
                        break; // the prefetcher was dropped
                    }
                }
                for s in &advised {
                    set_access(s.region(), Access::Normal);
                }
            })?;
        Ok(Prefetcher {
            rx: Some(Mutex::new(rx)),
            thread: Some(thread),
            n_batches,
        })
    }

    /// How many batches the partition makes.
    pub fn len(&self) -> usize {
        self.n_batches
    }

    /// Whether the partition makes no batch.
    pub fn is_empty(&self) -> bool {
        self.n_batches == 0
    }

    /// The next batch, waiting up to `timeout` (blocking: call it without the GIL).
    pub fn next(&self, timeout: Duration) -> Result<Batch, PrefetchError> {
        let rx = self.rx.as_ref().ok_or(PrefetchError::Stopped)?;
        match rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recv_timeout(timeout)
        {
            Ok(Ok(b)) => Ok(b),
            Ok(Err(e)) => Err(PrefetchError::Gather(e)),
            Err(RecvTimeoutError::Timeout) => Err(PrefetchError::Timeout(timeout)),
            Err(RecvTimeoutError::Disconnected) => Err(PrefetchError::Stopped),
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Unblock the thread (its send fails once the receiver is gone), then wait for it to let go of the rows'
        // memory before their owner may release it.
        self.rx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(data: &[u8], row_bytes: usize) -> Source {
        // SAFETY: `data` outlives every prefetcher in these tests.
        Source::Rows(unsafe { Rows::new(data.as_ptr(), data.len(), row_bytes) })
    }

    #[test]
    fn batches_hold_the_indexed_rows_in_order() {
        let x: Vec<u8> = (0..40).collect(); // 10 rows of 4 bytes
        let y: Vec<u8> = (100..110).collect(); // 10 rows of 1 byte
        let p = Prefetcher::start(
            vec![rows(&x, 4), rows(&y, 1)],
            vec![9, 0, 5, 2, 7],
            2,
            2,
            false,
        )
        .unwrap();
        assert_eq!(p.len(), 3);
        let b = p.next(Duration::from_secs(5)).unwrap();
        assert_eq!(b.rows, 2);
        assert_eq!(b.buffers[0], vec![36, 37, 38, 39, 0, 1, 2, 3]);
        assert_eq!(b.buffers[1], vec![109, 100]);
        p.next(Duration::from_secs(5)).unwrap();
        let last = p.next(Duration::from_secs(5)).unwrap();
        assert_eq!((last.rows, &last.buffers[1]), (1, &vec![107]));
        assert_eq!(
            p.next(Duration::from_millis(50)).unwrap_err(),
            PrefetchError::Stopped
        );
    }

    #[test]
    fn drop_last_and_bad_indices() {
        let x = vec![0u8; 8];
        let p = Prefetcher::start(vec![rows(&x, 1)], vec![0, 1, 2], 2, 1, true).unwrap();
        assert_eq!(p.len(), 1);
        let bad = Prefetcher::start(vec![rows(&x, 1)], vec![0, 99], 2, 1, false).unwrap();
        assert!(matches!(
            bad.next(Duration::from_secs(5)),
            Err(PrefetchError::Gather(_))
        ));
    }

    #[test]
    fn image_sources_decode_each_batch_beside_plain_rows() {
        use image::{ImageFormat, RgbImage};
        let mut data = Vec::new();
        let mut offsets = vec![0u64];
        for k in 0..5u8 {
            let img = RgbImage::from_fn(6, 4, |_, _| image::Rgb([k * 40, 1, 2]));
            let mut file = Vec::new();
            img.write_to(&mut std::io::Cursor::new(&mut file), ImageFormat::Png)
                .unwrap();
            data.extend_from_slice(&file);
            offsets.push(data.len() as u64);
        }
        let labels: Vec<u8> = (10..15).collect();
        let spec = ImageSpec::new(2, 3, 3, false).unwrap();
        // SAFETY: `data` and `offsets` outlive the prefetcher.
        let images = unsafe {
            EncodedRows::new(
                Rows::new(data.as_ptr(), data.len(), 1),
                offsets.as_ptr(),
                offsets.len(),
                spec,
                2,
                0,
            )
        }
        .unwrap();
        assert_eq!(images.len(), 5);
        let p = Prefetcher::start(
            vec![Source::Images(images), rows(&labels, 1)],
            vec![4, 1, 2],
            2,
            2,
            false,
        )
        .unwrap();
        let b = p.next(Duration::from_secs(5)).unwrap();
        assert_eq!(b.buffers[0].len(), 2 * 2 * 3 * 3);
        assert_eq!((b.buffers[0][0], b.buffers[0][18]), (160, 40)); // resized from 6x4, still flat
        assert_eq!(b.buffers[1], vec![14, 11]);
        let b = p.next(Duration::from_secs(5)).unwrap();
        assert_eq!((b.rows, b.buffers[0][0]), (1, 80));
        // Offsets that do not cut the data are refused before any read.
        let bad = [0u64, 10, 5];
        // SAFETY: as above.
        let r = unsafe {
            EncodedRows::new(
                Rows::new(data.as_ptr(), data.len(), 1),
                bad.as_ptr(),
                3,
                spec,
                1,
                0,
            )
        };
        assert!(r.is_err());
    }

    #[test]
    fn dropping_midway_stops_the_thread() {
        let x = vec![1u8; 1 << 16];
        let p = Prefetcher::start(vec![rows(&x, 16)], (0..4096).collect(), 1, 1, false).unwrap();
        p.next(Duration::from_secs(5)).unwrap();
        drop(p); // joins: no thread reads `x` after this
    }
}
