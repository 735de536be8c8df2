//! Shared-memory segments reused from transfer to transfer.
//!
//! A one-off file per transfer ([`crate::shm::write`]) pays for the kernel allocating and zeroing every page,
//! the receiver mapping it and both freeing it again: more than the bytes' trip through loopback TCP. A pooled
//! segment is created once and written again for later transfers, so a transfer costs one copy into pages that
//! already exist, and a receiver keeps its mapping of the segment across transfers.
//!
//! A segment starts with a header page holding a magic number and a reader count. The writer sets the count to
//! the number of receivers before sending the segment's name; each receiver decrements it when the last array on
//! its view of the transfer is dropped; the writer reuses a segment only at zero. Receivers see the data through a
//! shared mapping, so it is exposed read-only (a writer never changes bytes that a reader still holds).
//!
//! Segments live as long as their writer: [`Pool::clear`] removes them at exit. A writer killed with SIGKILL
//! cannot, so every writer holds a shared lock on each of its segments from creation on, and any pool about to
//! create a segment first removes the segments nobody holds whose writer is gone ([`sweep_orphans`]).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use memmap2::{MmapMut, MmapOptions};

use crate::shm::{self, Layout, ShmError};

/// Bytes before a segment's data: the header page.
pub const HEADER: u64 = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"ddlfpool");
/// Segment capacities are multiples of this.
const GRANULE: u64 = 1 << 20;
/// A segment whose readers have held it this long may be retired (unlinked; its readers' mappings stay valid)
/// when the pool is full.
const ABANDON_AFTER: Duration = Duration::from_secs(60);

/// The reader count in a mapped header.
fn readers(header: &[u8]) -> &AtomicU64 {
    assert!(header.len() >= 16);
    // SAFETY: mappings are page-aligned, so offset 8 is 8-byte aligned; the header page is shared by every
    // process that maps the segment and only ever accessed atomically at this offset after creation.
    unsafe { &*(header.as_ptr().add(8) as *const AtomicU64) }
}

struct Segment {
    name: String,
    file: File,
    header: MmapMut,
    capacity: u64,
    claimed_at: Instant,
}

impl Segment {
    fn readers(&self) -> &AtomicU64 {
        readers(&self.header)
    }

    fn create(capacity: u64) -> Result<Segment, ShmError> {
        let (name, file, header) = shm::create_with(|file| {
            // Held until the writer exits (the lock goes with the file): a live writer's segments are never
            // swept, whatever pid namespace it runs in. Taken before the magic number marks the file a segment.
            file.lock_shared()?;
            file.set_len(HEADER + capacity)?;
            file.write_all_at(&MAGIC.to_le_bytes(), 0)?;
            // SAFETY: our own file, sized above; the header page is only accessed through `readers`.
            unsafe { MmapOptions::new().len(HEADER as usize).map_mut(file) }
        })?;
        Ok(Segment {
            name,
            file,
            header,
            capacity,
            claimed_at: Instant::now(),
        })
    }
}

/// The segments one process writes.
pub struct Pool {
    segments: Mutex<Vec<Segment>>,
    max_bytes: u64,
}

impl Pool {
    /// A pool holding at most `max_bytes` of segments.
    pub fn new(max_bytes: u64) -> Self {
        Pool {
            segments: Mutex::new(Vec::new()),
            max_bytes,
        }
    }

    /// This process's pool: `DDLF_SHM_POOL_MB` megabytes at most (default 512).
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let mb = std::env::var("DDLF_SHM_POOL_MB")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(512);
            Pool::new(mb << 20)
        })
    }

    /// Write `buffers` into a free segment (or a new one) for `n_readers` receivers. `Err(PoolFull)` when no
    /// segment fits within the pool's limit: the caller then uses a one-off file or the socket.
    pub fn write(&self, buffers: &[&[u8]], n_readers: u64) -> Result<Layout, ShmError> {
        let (offsets, end) = shm::place(buffers, HEADER);
        let total = end - HEADER;
        let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        let free = segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.capacity >= total && s.readers().load(Ordering::Acquire) == 0)
            .min_by_key(|(_, s)| s.capacity)
            .map(|(i, _)| i);
        let index = match free {
            Some(i) => i,
            None => {
                let capacity = total.max(1).div_ceil(GRANULE) * GRANULE;
                self.make_room(&mut segments, capacity)?;
                // Before taking more of /dev/shm: give back what killed writers left there (rare: segments
                // are reused, so this runs a handful of times in a process's life).
                sweep_orphans();
                segments.push(Segment::create(capacity)?);
                segments.len() - 1
            }
        };
        let segment = &mut segments[index];
        segment.readers().store(n_readers, Ordering::Release);
        segment.claimed_at = Instant::now();
        let written = buffers
            .iter()
            .zip(&offsets)
            .try_for_each(|(b, &off)| segment.file.write_all_at(b, off));
        if let Err(source) = written {
            // A full /dev/shm, typically: this segment may be half-backed; drop it.
            let name = segment.name.clone();
            shm::unlink(&name);
            segments.remove(index);
            return Err(ShmError::Io { name, source });
        }
        Ok(Layout {
            name: segments[index].name.clone(),
            lengths: buffers.iter().map(|b| b.len() as u64).collect(),
            offsets,
        })
    }

    /// Free `needed` bytes under the limit: remove idle segments, then ones abandoned by their readers.
    fn make_room(&self, segments: &mut Vec<Segment>, needed: u64) -> Result<(), ShmError> {
        if needed > self.max_bytes {
            return Err(ShmError::PoolFull(needed));
        }
        let used = |s: &Vec<Segment>| s.iter().map(|x| x.capacity).sum::<u64>();
        for abandoned_only in [false, true] {
            while used(segments) + needed > self.max_bytes {
                let victim = segments.iter().position(|s| {
                    let n = s.readers().load(Ordering::Acquire);
                    if abandoned_only {
                        n > 0 && s.claimed_at.elapsed() > ABANDON_AFTER
                    } else {
                        n == 0
                    }
                });
                match victim {
                    Some(i) => shm::unlink(&segments.remove(i).name),
                    None => break,
                }
            }
        }
        if used(segments) + needed > self.max_bytes {
            return Err(ShmError::PoolFull(needed));
        }
        Ok(())
    }

    /// Take a segment out of the pool (a transfer failed: whether its readers attached is unknown). Readers
    /// that mapped it keep their mappings.
    pub fn retire(&self, name: &str) {
        let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = segments.iter().position(|s| s.name == name) {
            shm::unlink(&segments.remove(i).name);
        }
    }

    /// Whether `name` is one of this pool's segments.
    #[cfg(test)]
    fn owns(&self, name: &str) -> bool {
        let segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        segments.iter().any(|s| s.name == name)
    }

    /// Segments held now and their total capacity.
    pub fn usage(&self) -> (usize, u64) {
        let segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        (segments.len(), segments.iter().map(|s| s.capacity).sum())
    }

    /// Remove every segment (at exit).
    pub fn clear(&self) {
        let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        for s in segments.drain(..) {
            shm::unlink(&s.name);
        }
    }
}

/// Remove the pool segments in /dev/shm whose writer is gone (killed: its exit never ran [`Pool::clear`]): a
/// file is one when it carries the pool's magic number, nobody holds its lock (every live writer holds its own
/// segments' locks) and the process its name names does not exist here. Receivers' mappings stay valid.
/// Returns the names removed.
pub fn sweep_orphans() -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(shm::DIR) else {
        return removed;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // Names are `ddlf-<pid>-<counter>-<nanos>` ([`shm::unique_name`]).
        let parts: Vec<&str> = name.split('-').collect();
        let pid = match parts.as_slice() {
            ["ddlf", pid, n, _] if n.parse::<u64>().is_ok() => match pid.parse::<u32>() {
                Ok(pid) => pid,
                Err(_) => continue,
            },
            _ => continue,
        };
        let Ok(path) = shm::path_of(&name) else {
            continue;
        };
        let Ok(file) = File::open(&path) else {
            continue;
        };
        if file.try_lock().is_err() {
            continue; // a writer holds it
        }
        let mut magic = [0u8; 8];
        let is_segment =
            file.read_exact_at(&mut magic, 0).is_ok() && u64::from_le_bytes(magic) == MAGIC;
        let writer_alive = std::path::Path::new(&format!("/proc/{pid}")).exists();
        if is_segment && !writer_alive {
            shm::unlink(&name);
            removed.push(name);
        }
    }
    removed
}

/// One receiver's view of one transfer: releases its claim on the segment when dropped.
pub struct Lease {
    map: Arc<MmapMut>,
}

impl Lease {
    /// The whole mapped segment (header included); buffers are the ranges [`attach`] returned.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = readers(&self.map)
            .fetch_update(Ordering::Release, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}

/// Mappings of other processes' segments, kept across transfers (a segment's pages are mapped once).
fn attached() -> &'static Mutex<HashMap<String, Arc<MmapMut>>> {
    static ATTACHED: OnceLock<Mutex<HashMap<String, Arc<MmapMut>>>> = OnceLock::new();
    ATTACHED.get_or_init(Default::default)
}

/// Map (or reuse the mapping of) the pooled segment `name` and check every buffer lies in its data area.
pub fn attach(
    name: &str,
    offsets: &[u64],
    lengths: &[u64],
) -> Result<(Lease, Vec<(usize, usize)>), ShmError> {
    if offsets.len() != lengths.len() {
        return Err(ShmError::Mismatch(offsets.len(), lengths.len()));
    }
    let path = shm::path_of(name)?;
    let io_err = |source| ShmError::Io {
        name: name.to_string(),
        source,
    };
    let map = {
        let mut cache = attached().lock().unwrap_or_else(|e| e.into_inner());
        match cache.get(name) {
            // A segment its writer removed is never sent again; one check per transfer keeps it that way.
            Some(m) if path.exists() => m.clone(),
            _ => {
                cache.remove(name);
                // Forget mappings no transfer uses whose segment its writer removed.
                cache.retain(|n, m| {
                    Arc::strong_count(m) > 1 || shm::path_of(n).is_ok_and(|p| p.exists())
                });
                let file = File::options()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(io_err)?;
                // SAFETY: a shared mapping of a ddlf segment; its data is only read through it (exposed
                // read-only), and its header only through atomics.
                let map =
                    unsafe { MmapOptions::new().populate().map_mut(&file) }.map_err(io_err)?;
                if map.len() < HEADER as usize || map[..8] != MAGIC.to_le_bytes() {
                    return Err(ShmError::BadName(format!("{name} (not a ddlf segment)")));
                }
                let map = Arc::new(map);
                cache.insert(name.to_string(), map.clone());
                map
            }
        }
    };
    let ranges = shm::ranges(name, offsets, lengths, HEADER..map.len() as u64)?;
    Ok((Lease { map }, ranges))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::ALIGN;

    /// A receiver that takes a transfer and drops it at once.
    fn release_unattached(name: &str) {
        if let Ok((lease, _)) = attach(name, &[], &[]) {
            drop(lease);
        }
    }

    #[test]
    fn segments_of_killed_writers_are_swept_and_no_others() {
        if !shm::available() {
            return;
        }
        // A process that existed and is gone: its pid names no process now.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let fake = |pid: u32, tag: &str, magic: bool| {
            let name = format!("ddlf-{pid}-0-{tag}{:x}", std::process::id());
            let mut bytes = vec![0u8; 4096];
            if magic {
                bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
            }
            std::fs::write(shm::path_of(&name).unwrap(), bytes).unwrap();
            name
        };
        let orphan = fake(dead, "a", true);
        let not_a_segment = fake(dead, "b", false); // a one-off transfer file: not the pool's to remove
        let live_writer = fake(std::process::id(), "c", true); // no lock, but its process runs
        let exists = |n: &str| shm::path_of(n).unwrap().exists();
        let pool = Pool::new(8 << 20);
        // Creating a segment sweeps first (so may a test running beside this one): the orphan goes.
        let held = pool.write(&[&[7u8; 10]], 0).unwrap().name; // a live pool's segment, locked
        assert!(!exists(&orphan));
        let removed = sweep_orphans();
        for kept in [&not_a_segment, &live_writer, &held] {
            assert!(exists(kept), "{kept} was removed");
            assert!(!removed.contains(kept));
        }
        shm::unlink(&not_a_segment);
        shm::unlink(&live_writer);
        pool.clear();
    }

    #[test]
    fn segments_are_reused_once_every_reader_released_them() {
        if !shm::available() {
            return;
        }
        let pool = Pool::new(64 << 20);
        let a = vec![1u8; 3000];
        let b = vec![2u8; 5];
        let first = pool.write(&[&a, &b], 2).unwrap();
        assert!(first.offsets.iter().all(|o| *o >= HEADER && o % ALIGN == 0));
        let (l1, r1) = attach(&first.name, &first.offsets, &first.lengths).unwrap();
        let (l2, r2) = attach(&first.name, &first.offsets, &first.lengths).unwrap();
        let (s, n) = r1[0];
        assert_eq!(&l1.bytes()[s..s + n], &a[..]);
        let (s, n) = r2[1];
        assert_eq!(&l2.bytes()[s..s + n], &b[..]);
        // Still held by two readers: the next write takes a new segment.
        let second = pool.write(&[&b], 1).unwrap();
        assert_ne!(second.name, first.name);
        drop(l1);
        let third = pool.write(&[&b], 1).unwrap();
        assert_ne!(third.name, first.name); // one reader left
        drop(l2);
        release_unattached(&second.name);
        release_unattached(&third.name);
        let fourth = pool.write(&[&a], 1).unwrap();
        assert!([&first.name, &second.name, &third.name].contains(&&fourth.name));
        assert_eq!(pool.usage().0, 3);
        pool.retire(&fourth.name);
        assert!(!pool.owns(&fourth.name));
        pool.clear();
        assert_eq!(pool.usage(), (0, 0));
        assert!(attach(&first.name, &[], &[]).is_err()); // removed
    }

    #[test]
    fn the_limit_is_kept_and_idle_segments_make_room() {
        if !shm::available() {
            return;
        }
        let pool = Pool::new(2 * GRANULE);
        let big = vec![0u8; GRANULE as usize + 1];
        assert!(matches!(
            pool.write(&[&big, &big], 1),
            Err(ShmError::PoolFull(_))
        ));
        let one = pool.write(&[&big[..10]], 1).unwrap();
        let two = pool.write(&[&big[..10]], 1).unwrap();
        assert!(matches!(
            pool.write(&[&big[..10]], 1),
            Err(ShmError::PoolFull(_))
        )); // both held
        release_unattached(&one.name);
        assert_eq!(pool.write(&[&big[..10]], 1).unwrap().name, one.name); // reused
        release_unattached(&one.name);
        release_unattached(&two.name);
        let three = pool.write(&[&big], 1).unwrap(); // needs the whole limit: both idle segments go
        assert!(!pool.owns(&one.name) && !pool.owns(&two.name) && pool.owns(&three.name));
        assert_eq!(pool.usage(), (1, 2 * GRANULE));
        pool.clear();
    }

    #[test]
    fn references_outside_the_data_area_or_to_other_files_are_refused() {
        if !shm::available() {
            return;
        }
        let pool = Pool::new(8 << 20);
        let l = pool.write(&[&[9u8; 10]], 1).unwrap();
        assert!(matches!(
            attach(&l.name, &[0], &[8]),
            Err(ShmError::OutOfBounds { .. })
        )); // the header
        assert!(matches!(
            attach(&l.name, &[HEADER], &[u64::MAX]),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            attach("../x", &[], &[]),
            Err(ShmError::BadName(_))
        ));
        let plain = shm::write(&[&[1u8; 16]]).unwrap();
        assert!(matches!(
            attach(&plain.name, &[], &[]),
            Err(ShmError::BadName(_))
        ));
        shm::unlink(&plain.name);
        pool.clear();
    }
}
