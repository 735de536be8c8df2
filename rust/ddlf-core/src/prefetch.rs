//! Batches gathered ahead by a background thread: the dataset's rows for each batch of an index partition, copied
//! into fresh contiguous buffers while the consumer trains on the previous ones (MapRDD's overlap of sampling with
//! computation). The thread never touches Python; the bindings wrap it as `BatchPipeline`.

use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::gather::gather_rows_to_vec;

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

/// One gathered batch: a buffer per array, its row count, and the seconds the gather took.
#[derive(Debug)]
pub struct Batch {
    pub buffers: Vec<Vec<u8>>,
    pub rows: usize,
    pub gather_seconds: f64,
}

/// Why no batch came.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PrefetchError {
    #[error("{0}")]
    Gather(String),
    #[error("the prefetch thread stopped")]
    Stopped,
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
        sources: Vec<Rows>,
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
                for b in 0..n_batches {
                    let chunk = &indices[b * batch_size..((b + 1) * batch_size).min(indices.len())];
                    let t0 = Instant::now();
                    let gathered: Result<Vec<Vec<u8>>, String> = sources
                        .iter()
                        .map(|r| {
                            gather_rows_to_vec(r.slice(), r.row_bytes, chunk, 1)
                                .map_err(|e| e.to_string())
                        })
                        .collect();
                    let msg = gathered.map(|buffers| Batch {
                        buffers,
                        rows: chunk.len(),
                        gather_seconds: t0.elapsed().as_secs_f64(),
                    });
                    if tx.send(msg).is_err() {
                        return; // the prefetcher was dropped
                    }
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

    fn rows(data: &[u8], row_bytes: usize) -> Rows {
        // SAFETY: `data` outlives every prefetcher in these tests.
        unsafe { Rows::new(data.as_ptr(), data.len(), row_bytes) }
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
    fn dropping_midway_stops_the_thread() {
        let x = vec![1u8; 1 << 16];
        let p = Prefetcher::start(vec![rows(&x, 16)], (0..4096).collect(), 1, 1, false).unwrap();
        p.next(Duration::from_secs(5)).unwrap();
        drop(p); // joins: no thread reads `x` after this
    }
}
