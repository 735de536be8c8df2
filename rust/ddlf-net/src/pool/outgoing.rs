//! Values on their way out of a process, and the shared-memory policy for large ones.

use bytes::Bytes;
use ddlf_core::shm::ShmError;
use ddlf_core::shm_pool::Pool as ShmPool;
use ddlf_proto::{ShmRef, Value};

/// Values with at least this many buffer bytes go through a pooled shared-memory segment between processes on
/// one machine (one copy into pages that already exist, instead of the socket's copies).
pub const POOL_THRESHOLD: usize = 1 << 20;

/// Without room in the pool, values at least this large still go through a one-off shared-memory file. Below
/// it, creating and freeing a file costs more than the socket (measured: 4 MB took 5.8 ms vs 3.7 ms over TCP).
pub const SHM_THRESHOLD: usize = 32 << 20;

/// Put buffers in shared memory for `readers` receivers (one copy): a segment of this process's pool, or,
/// without room there, a one-off file for values of [`SHM_THRESHOLD`] or more. `Ok(None)`: use the socket.
/// Blocking: call it with the GIL released.
pub fn write_shm(bufs: &[impl AsRef<[u8]>], readers: u64) -> Result<Option<ShmRef>, ShmError> {
    let slices: Vec<&[u8]> = bufs.iter().map(|b| b.as_ref()).collect();
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let (layout, pooled) = match ShmPool::global().write(&slices, readers) {
        Ok(layout) => (layout, true),
        Err(e) if total < SHM_THRESHOLD => {
            tracing::debug!(error = %e, "no pooled shared memory: sending over the socket");
            return Ok(None);
        }
        Err(e) => {
            tracing::debug!(error = %e, "no pooled shared memory: a one-off file");
            (ddlf_core::shm::write(&slices)?, false)
        }
    };
    Ok(Some(ShmRef {
        name: layout.name,
        offsets: layout.offsets,
        lengths: layout.lengths,
        pooled,
    }))
}

/// One value on its way to one or more workers: its pickle and its buffers, shared (not copied) by every request
/// that carries it, and written to shared memory at most once.
pub struct Outgoing {
    pickle: Bytes,
    buffers: Vec<Bytes>,
    total: usize,
    shm: Option<ShmRef>,
    shm_failed: bool,
}

impl Outgoing {
    /// A value from its pickle and out-of-band buffers (`Bytes` that may borrow the caller's memory).
    pub fn new(pickle: Bytes, buffers: Vec<Bytes>) -> Self {
        Outgoing {
            total: buffers.iter().map(Bytes::len).sum(),
            pickle,
            buffers,
            shm: None,
            shm_failed: false,
        }
    }

    /// Whether it goes through shared memory to a worker that can map ours.
    pub(crate) fn wants_shm(&self) -> bool {
        self.total >= POOL_THRESHOLD
    }

    /// The shared memory holding the buffers for `readers` workers, written on first use. None if there is no
    /// room or it cannot be written (a full or missing /dev/shm): the buffers then go over the socket.
    fn shared_memory(&mut self, readers: u64) -> Option<ShmRef> {
        if self.shm.is_none() && !self.shm_failed {
            match write_shm(&self.buffers, readers) {
                Ok(Some(r)) => self.shm = Some(r),
                Ok(None) => self.shm_failed = true,
                Err(e) => {
                    tracing::warn!(error = %e, "shared memory unavailable: sending over the socket");
                    self.shm_failed = true;
                }
            }
        }
        self.shm.clone()
    }

    /// The wire value for one worker: its buffers inline, or a reference to shared memory written for `readers`.
    pub(crate) fn value(&mut self, shm_readers: Option<u64>) -> Value {
        let shm = shm_readers.and_then(|n| self.shared_memory(n));
        Value {
            pickle: self.pickle.clone(),
            buffers: if shm.is_some() {
                vec![]
            } else {
                self.buffers.clone()
            },
            shm,
        }
    }

    /// After the call: a one-off file is removed; a pooled segment stays in the pool unless a worker may not have
    /// taken it (`failed`), in which case it is retired rather than left waiting for that worker.
    pub(crate) fn finish(&self, failed: bool) {
        match &self.shm {
            Some(r) if !r.pooled => ddlf_core::shm::unlink(&r.name),
            Some(r) if failed => ShmPool::global().retire(&r.name),
            _ => {}
        }
    }
}
