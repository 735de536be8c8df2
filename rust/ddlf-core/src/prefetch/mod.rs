//! Batches gathered ahead by a background thread: the dataset's rows for each batch of an index partition, copied
//! into fresh contiguous buffers while the consumer trains on the previous ones (MapRDD's overlap of sampling with
//! computation). A source of encoded images is decoded (and resized, and flipped) on the way, on up to
//! [`EncodedRows`]' `threads` threads. The thread never touches Python; the bindings wrap it as `BatchPipeline`.
//!
//! A small partition of rows already in memory is gathered on the consumer's thread instead, batch by batch as it
//! asks ([`Gather::Auto`], [`INLINE_BYTES`]): starting a thread costs more than such a round's whole gathering.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod sources;

pub use sources::{EncodedRows, Rows, Source};

use crate::advice::{resident, set_access, Access};

/// One gathered batch: a buffer per array, its row count, and the seconds the gather took.
#[derive(Debug)]
pub struct Batch {
    /// One buffer per source, `rows` rows each.
    pub buffers: Vec<Vec<u8>>,
    /// Rows in the batch (the last batch may have fewer than the batch size).
    pub rows: usize,
    /// Seconds spent gathering it (on the prefetch thread, or inline on the consumer's).
    pub gather_seconds: f64,
}

/// Why no batch came.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PrefetchError {
    /// Gathering or decoding the batch failed.
    #[error("{0}")]
    Gather(String),
    /// No batch is left: every batch was served, or the prefetch thread was stopped.
    #[error("the prefetcher has no batch left")]
    Stopped,
    /// No batch was ready within the wait.
    #[error("no batch within {0:?}")]
    Timeout(Duration),
}

/// A partition whose rows hold at most this many bytes (over every source), all of them in memory, is gathered on
/// the consumer's thread under [`Gather::Auto`]. For a partition of two 32-row batches of MNIST as float32 (a 2-core
/// VM, `BatchPipeline` from Python, start to last batch) the thread took 117 µs, inline 40 µs, numpy's `take` alone
/// 24 µs: the thread pays for partitions whose gathering it hides behind the consumer's work (more rows than this,
/// pages still on disk, encoded images to decode), not for the 2-batch chunks of asynchronous training.
pub const INLINE_BYTES: usize = 1 << 20;

/// Where a partition's batches are gathered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gather {
    /// On the consumer's thread for a small partition of rows in memory ([`INLINE_BYTES`]), else ahead on a thread.
    Auto,
    /// Ahead, on a thread of the prefetcher's own.
    Thread,
    /// On the consumer's thread, when it asks for the batch.
    Inline,
}

impl Gather {
    /// Whether a partition of `indices` of `sources` is gathered on the consumer's thread.
    fn inline(self, sources: &[Source], indices: &[u32]) -> bool {
        match self {
            Gather::Thread => false,
            Gather::Inline => true,
            Gather::Auto => {
                let bytes = sources
                    .iter()
                    .map(|s| s.fixed_bytes(indices.len()))
                    .try_fold(0usize, |sum, b| b.map(|b| sum.saturating_add(b)));
                bytes.is_some_and(|b| b <= INLINE_BYTES)
                    && sources.iter().all(|s| s.holds_in_memory(indices))
            }
        }
    }
}

/// How the batches reach the consumer.
enum Feed {
    /// Gathered ahead by a thread. The receiver sits in a mutex only to make it `Sync` (the bindings wait without
    /// the GIL); there is one consumer.
    Thread {
        rx: Option<Mutex<Receiver<Result<Batch, String>>>>,
        thread: Option<JoinHandle<()>>,
    },
    /// Gathered when asked, on the consumer's thread: `next` is the next batch's number.
    Inline {
        sources: Vec<Source>,
        indices: Vec<u32>,
        next: AtomicUsize,
    },
}

/// The batches of `indices`, `batch_size` rows each, gathered up to `ahead` batches in advance (or, for a small
/// partition in memory, when asked: [`Gather`]).
pub struct Prefetcher {
    feed: Feed,
    batch_size: usize,
    n_batches: usize,
}

/// The indices of batch `b`.
fn chunk_of(indices: &[u32], batch_size: usize, b: usize) -> &[u32] {
    &indices[b * batch_size..((b + 1) * batch_size).min(indices.len())]
}

/// Batch `b`'s rows gathered from every source.
fn gather_batch(
    sources: &[Source],
    indices: &[u32],
    batch_size: usize,
    b: usize,
) -> Result<Batch, String> {
    let chunk = chunk_of(indices, batch_size, b);
    let t0 = Instant::now();
    let first = (b * batch_size) as u64;
    let buffers = sources
        .iter()
        .map(|s| s.batch(chunk, first))
        .collect::<Result<Vec<Vec<u8>>, String>>()?;
    Ok(Batch {
        buffers,
        rows: chunk.len(),
        gather_seconds: t0.elapsed().as_secs_f64(),
    })
}

impl Prefetcher {
    /// Start gathering (a thread, unless `gather` says the consumer's). `drop_last` skips a short last batch.
    /// Indices are not checked here: a bad one ends the stream with [`PrefetchError::Gather`] (the bindings check
    /// them against the row count first).
    pub fn start(
        sources: Vec<Source>,
        indices: Vec<u32>,
        batch_size: usize,
        ahead: usize,
        drop_last: bool,
        gather: Gather,
    ) -> std::io::Result<Self> {
        let batch_size = batch_size.max(1);
        let n_batches = if drop_last {
            indices.len() / batch_size
        } else {
            indices.len().div_ceil(batch_size)
        };
        let served = &indices[..(n_batches * batch_size).min(indices.len())];
        let feed = if gather.inline(&sources, served) {
            Feed::Inline {
                sources,
                indices,
                next: AtomicUsize::new(0),
            }
        } else {
            Self::spawn(sources, indices, batch_size, n_batches, ahead)?
        };
        Ok(Prefetcher {
            feed,
            batch_size,
            n_batches,
        })
    }

    fn spawn(
        sources: Vec<Source>,
        indices: Vec<u32>,
        batch_size: usize,
        n_batches: usize,
        ahead: usize,
    ) -> std::io::Result<Feed> {
        let sources = Arc::new(sources);
        // No more slots than batches: the channel allocates every slot up front (a `prefetch` of 10**9 asked for
        // 48 GB and aborted the process).
        let ahead = ahead.clamp(1, n_batches.max(1));
        let (tx, rx) = sync_channel(ahead);
        let thread = std::thread::Builder::new()
            .name("ddlf-prefetch".into())
            .spawn(move || {
                // Pages of the next `read_ahead` batches are requested before they are gathered: a mapped file
                // larger than memory is read by queued requests, not one fault at a time. Memory already
                // resident gets no advice (see `crate::advice`).
                let read_ahead = ahead + 2;
                let advised: Vec<&Source> =
                    sources.iter().filter(|s| !resident(s.region())).collect();
                for s in &advised {
                    set_access(s.region(), Access::Random);
                }
                for b in 0..read_ahead.min(n_batches) {
                    let chunk = chunk_of(&indices, batch_size, b);
                    advised.iter().for_each(|s| s.read_ahead(chunk));
                }
                for b in 0..n_batches {
                    if b + read_ahead < n_batches {
                        let next = chunk_of(&indices, batch_size, b + read_ahead);
                        advised.iter().for_each(|s| s.read_ahead(next));
                    }
                    if tx
                        .send(gather_batch(&sources, &indices, batch_size, b))
                        .is_err()
                    {
                        break; // the prefetcher was dropped
                    }
                }
                for s in &advised {
                    set_access(s.region(), Access::Normal);
                }
            })?;
        Ok(Feed::Thread {
            rx: Some(Mutex::new(rx)),
            thread: Some(thread),
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

    /// Whether the batches are gathered on the consumer's thread (no prefetch thread runs).
    pub fn is_inline(&self) -> bool {
        matches!(self.feed, Feed::Inline { .. })
    }

    /// The next batch, waiting up to `timeout` for the thread's, or gathering it now when inline (blocking either
    /// way: call it without the GIL).
    pub fn next(&self, timeout: Duration) -> Result<Batch, PrefetchError> {
        match &self.feed {
            Feed::Inline {
                sources,
                indices,
                next,
            } => {
                let b = next.fetch_add(1, Ordering::Relaxed);
                if b >= self.n_batches {
                    next.store(self.n_batches, Ordering::Relaxed);
                    return Err(PrefetchError::Stopped);
                }
                gather_batch(sources, indices, self.batch_size, b).map_err(PrefetchError::Gather)
            }
            Feed::Thread { rx, .. } => {
                let rx = rx.as_ref().ok_or(PrefetchError::Stopped)?;
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
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Unblock the thread (its send fails once the receiver is gone), then wait for it to let go of the rows'
        // memory before their owner may release it. Inline, nothing reads the rows after `next` returns.
        if let Feed::Thread { rx, thread } = &mut self.feed {
            rx.take();
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::ImageSpec;

    fn rows(data: &[u8], row_bytes: usize) -> Source {
        // SAFETY: `data` outlives every prefetcher in these tests.
        Source::Rows(unsafe { Rows::new(data.as_ptr(), data.len(), row_bytes) })
    }

    #[test]
    fn batches_hold_the_indexed_rows_in_order_inline_or_not() {
        for gather in [Gather::Thread, Gather::Inline, Gather::Auto] {
            indexed_rows_in_order(gather);
        }
    }

    fn indexed_rows_in_order(gather: Gather) {
        let x: Vec<u8> = (0..40).collect(); // 10 rows of 4 bytes
        let y: Vec<u8> = (100..110).collect(); // 10 rows of 1 byte
        let p = Prefetcher::start(
            vec![rows(&x, 4), rows(&y, 1)],
            vec![9, 0, 5, 2, 7],
            2,
            2,
            false,
            gather,
        )
        .unwrap();
        assert_eq!(p.is_inline(), gather != Gather::Thread); // 25 bytes of heap memory: inline under Auto
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
    fn any_number_ahead_is_at_most_every_batch() {
        let x: Vec<u8> = (0..10).collect();
        let p = Prefetcher::start(
            vec![rows(&x, 1)],
            (0..10).rev().collect(),
            4,
            usize::MAX,
            false,
            Gather::Thread,
        )
        .unwrap();
        let got: Vec<Vec<u8>> = (0..3)
            .map(|_| p.next(Duration::from_secs(5)).unwrap().buffers.remove(0))
            .collect();
        assert_eq!(got, vec![vec![9, 8, 7, 6], vec![5, 4, 3, 2], vec![1, 0]]);
    }

    #[test]
    fn drop_last_and_bad_indices() {
        let x = vec![0u8; 8];
        for gather in [Gather::Thread, Gather::Inline, Gather::Auto] {
            let p =
                Prefetcher::start(vec![rows(&x, 1)], vec![0, 1, 2], 2, 1, true, gather).unwrap();
            assert_eq!(p.len(), 1);
            assert_eq!(p.next(Duration::from_secs(5)).unwrap().rows, 2);
            assert_eq!(
                p.next(Duration::from_millis(50)).unwrap_err(),
                PrefetchError::Stopped
            );
            let bad =
                Prefetcher::start(vec![rows(&x, 1)], vec![0, 99], 2, 1, false, gather).unwrap();
            assert!(matches!(
                bad.next(Duration::from_secs(5)),
                Err(PrefetchError::Gather(_))
            ));
        }
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
            Gather::Auto,
        )
        .unwrap();
        assert!(!p.is_inline()); // images are decoded on the thread
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
        let p = Prefetcher::start(
            vec![rows(&x, 16)],
            (0..4096).collect(),
            1,
            1,
            false,
            Gather::Thread,
        )
        .unwrap();
        p.next(Duration::from_secs(5)).unwrap();
        drop(p); // joins: no thread reads `x` after this
    }

    #[test]
    fn auto_gathers_inline_up_to_the_limit_of_bytes() {
        let row = 1024;
        let x = vec![3u8; row * 2048]; // 2 MiB of heap memory, all of it written: resident
        let y = vec![1u8; 2048];
        let limit = INLINE_BYTES / (row + 1);
        let start = |n: usize| {
            Prefetcher::start(
                vec![rows(&x, row), rows(&y, 1)],
                (0..n as u32).collect(),
                32,
                2,
                false,
                Gather::Auto,
            )
            .unwrap()
        };
        assert!(start(limit).is_inline());
        let over = start(limit + 1);
        assert!(!over.is_inline());
        assert_eq!(
            over.next(Duration::from_secs(5)).unwrap().buffers[0].len(),
            32 * row
        );
        // drop_last: only the rows served count.
        let p = Prefetcher::start(
            vec![rows(&x, row), rows(&y, 1)],
            (0..(limit + 10) as u32).collect(),
            limit,
            2,
            true,
            Gather::Auto,
        )
        .unwrap();
        assert!(p.is_inline());
    }
}
