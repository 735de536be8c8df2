//! Shared-memory files for large buffers between processes on one machine.
//!
//! The sender writes the buffers once into a file under `/dev/shm` (a memory-backed filesystem) and sends its
//! name; the receiver maps it and uses the bytes in place. One memcpy per transfer instead of a trip through
//! the loopback TCP stack, and processes on one node share one copy of a broadcast.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::os::unix::fs::FileExt;

use memmap2::{MmapMut, MmapOptions};

/// The directory shared-memory files live in.
pub const DIR: &str = "/dev/shm";
/// Every ddlf file there starts with this, and nothing else is ever opened or removed.
pub const PREFIX: &str = "ddlf-";
/// Buffers start at multiples of this many bytes (cache lines; good for SIMD loads).
pub const ALIGN: u64 = 64;

/// What can go wrong with a shared-memory file.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A name that is not ddlf's (see [`PREFIX`]) or could leave [`DIR`]: never opened.
    #[error("invalid shared-memory file name {0:?}")]
    BadName(String),
    /// Creating, writing or mapping the file failed.
    #[error("shared-memory file {name}: {source}")]
    Io {
        /// The file's name.
        name: String,
        /// The system's error.
        source: io::Error,
    },
    /// A buffer that does not lie inside the file.
    #[error("buffer {index} (bytes {start}..{end}) lies outside the {len}-byte file {name}")]
    OutOfBounds {
        /// The file's name.
        name: String,
        /// Which buffer.
        index: usize,
        /// Its first byte.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// The end of the part of the file the buffers must lie in (the whole file: its size).
        len: u64,
    },
    /// Offsets and lengths of different counts.
    #[error("{0} offsets for {1} lengths")]
    Mismatch(usize, usize),
    /// The segment pool cannot take a value this large.
    #[error("the shared-memory pool has no room for {0} bytes")]
    PoolFull(u64),
}

/// This kernel's boot id: processes that see the same one share `/dev/shm` (on the same machine).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Whether shared-memory files can be used here.
pub fn available() -> bool {
    std::path::Path::new(DIR).is_dir() && !boot_id().is_empty()
}

pub(crate) fn path_of(name: &str) -> Result<PathBuf, ShmError> {
    let ok = name.starts_with(PREFIX)
        && name.len() < 200
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !name.contains("..");
    if !ok {
        return Err(ShmError::BadName(name.to_string()));
    }
    Ok(PathBuf::from(DIR).join(name))
}

pub(crate) fn unique_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{PREFIX}{}-{}-{nanos:x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Where each buffer went in a written file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The file's name under [`DIR`].
    pub name: String,
    /// Each buffer's first byte in the file.
    pub offsets: Vec<u64>,
    /// Each buffer's length.
    pub lengths: Vec<u64>,
}

/// Offsets of `buffers` laid out from `base`, each aligned to [`ALIGN`], and the end of the last one.
pub(crate) fn place(buffers: &[&[u8]], base: u64) -> (Vec<u64>, u64) {
    let mut offsets = Vec::with_capacity(buffers.len());
    let mut end = base;
    for b in buffers {
        end = end.div_ceil(ALIGN) * ALIGN;
        offsets.push(end);
        end += b.len() as u64;
    }
    (offsets, end)
}

/// Create a shared-memory file under a fresh name and `fill` it; the file is removed again if `fill` fails.
pub(crate) fn create_with<T>(
    fill: impl FnOnce(&File) -> io::Result<T>,
) -> Result<(String, File, T), ShmError> {
    let name = unique_name();
    let path = path_of(&name)?;
    let made = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .and_then(|file| {
            fill(&file)
                .inspect_err(|_| {
                    let _ = std::fs::remove_file(&path);
                })
                .map(|t| (file, t))
        });
    match made {
        Ok((file, t)) => Ok((name, file, t)),
        Err(source) => Err(ShmError::Io { name, source }),
    }
}

/// Write `buffers` into a new shared-memory file. The caller removes it with [`unlink`] once every receiver has
/// mapped it.
pub fn write(buffers: &[&[u8]]) -> Result<Layout, ShmError> {
    let (offsets, total) = place(buffers, 0);
    // pwrite rather than writing through a mapping: the kernel fills the new pages as it allocates them, with no
    // page fault per 4 KiB page (measured: the mapping route made a 100 MB transfer slower than TCP).
    let (name, _, ()) = create_with(|file| {
        file.set_len(total.max(1))?;
        for (b, &off) in buffers.iter().zip(&offsets) {
            file.write_all_at(b, off)?;
        }
        Ok(())
    })?;
    Ok(Layout {
        name,
        lengths: buffers.iter().map(|b| b.len() as u64).collect(),
        offsets,
    })
}

/// A mapped shared-memory file and the buffers in it.
pub struct Mapped {
    /// The mapping (private, copy-on-write).
    pub map: Arc<MmapMut>,
    /// Each buffer's `(start, length)` in the mapping.
    pub ranges: Vec<(usize, usize)>,
}

/// Map a file written by [`write()`], checking every buffer lies inside it. The mapping is private
/// (copy-on-write): the receiver may write to its arrays, the file and the other receivers never see it, and
/// only the pages actually written are copied.
pub fn map(name: &str, offsets: &[u64], lengths: &[u64]) -> Result<Mapped, ShmError> {
    if offsets.len() != lengths.len() {
        return Err(ShmError::Mismatch(offsets.len(), lengths.len()));
    }
    let path = path_of(name)?;
    let io_err = |source| ShmError::Io {
        name: name.to_string(),
        source,
    };
    let file = std::fs::File::open(&path).map_err(io_err)?;
    // SAFETY: ddlf files are written once before their name is sent and never modified afterwards.
    // `populate` maps every page up front in one call instead of one fault per page.
    let map = unsafe { MmapOptions::new().populate().map_copy(&file) }.map_err(io_err)?;
    let ranges = ranges(name, offsets, lengths, 0..map.len() as u64)?;
    Ok(Mapped {
        map: Arc::new(map),
        ranges,
    })
}

/// The buffers `(start, len)` of a reference, each checked to lie inside `area` of the file.
pub(crate) fn ranges(
    name: &str,
    offsets: &[u64],
    lengths: &[u64],
    area: std::ops::Range<u64>,
) -> Result<Vec<(usize, usize)>, ShmError> {
    offsets
        .iter()
        .zip(lengths)
        .enumerate()
        .map(|(index, (&start, &n))| {
            let end = start.saturating_add(n);
            if start < area.start || end > area.end {
                return Err(ShmError::OutOfBounds {
                    name: name.to_string(),
                    index,
                    start,
                    end,
                    len: area.end,
                });
            }
            Ok((start as usize, n as usize))
        })
        .collect()
}

/// Remove a shared-memory file (mappings stay valid until dropped).
pub fn unlink(name: &str) {
    if let Ok(path) = path_of(name) {
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_map_unlink_round_trip() {
        if !available() {
            return;
        }
        let a: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let b = vec![7u8; 3];
        let layout = write(&[&a, &[], &b]).unwrap();
        assert!(layout.offsets.iter().all(|o| o % ALIGN == 0));
        let mut mapped = map(&layout.name, &layout.offsets, &layout.lengths).unwrap();
        let other = map(&layout.name, &layout.offsets, &layout.lengths).unwrap();
        unlink(&layout.name);
        // Private mappings: a write through one is invisible to the other.
        let (s0, _) = mapped.ranges[0];
        std::sync::Arc::get_mut(&mut mapped.map).expect("the only handle")[s0] = 99;
        assert_eq!(mapped.map[s0], 99);
        assert_eq!(other.map[s0], a[0]);
        let get = |i: usize| {
            let (s, n) = other.ranges[i];
            &other.map[s..s + n]
        };
        assert_eq!(get(0), &a[..]);
        assert!(get(1).is_empty());
        assert_eq!(get(2), &b[..]);
        assert!(map(&layout.name, &[0], &[1]).is_err()); // gone
    }

    #[test]
    fn names_outside_the_ddlf_namespace_are_refused() {
        for bad in ["../etc/passwd", "passwd", "ddlf-../../x", "ddlf-a/b", ""] {
            assert!(
                matches!(map(bad, &[], &[]), Err(ShmError::BadName(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn out_of_bounds_buffers_are_refused() {
        if !available() {
            return;
        }
        let layout = write(&[&[1u8, 2, 3]]).unwrap();
        assert!(matches!(
            map(&layout.name, &[0], &[100]),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            map(&layout.name, &[u64::MAX], &[2]),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            map(&layout.name, &[0, 1], &[1]),
            Err(ShmError::Mismatch(2, 1))
        ));
        unlink(&layout.name);
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        /// A shared-memory reference from the wire (names, offsets, lengths) is validated: every range that is
        /// accepted lies inside the file, and nothing panics.
        #[test]
        fn arbitrary_references_are_checked(
            offsets in proptest::collection::vec(prop_oneof![0u64..32, any::<u64>()], 0..4),
            lengths in proptest::collection::vec(prop_oneof![0u64..32, any::<u64>()], 0..4),
            name in "[a-zA-Z0-9./_-]{0,16}",
        ) {
            if !available() {
                return Ok(());
            }
            let _ = map(&name, &offsets, &lengths); // bad names are refused, never opened
            let written = write(&[&[7u8; 24]]).unwrap();
            let result = map(&written.name, &offsets, &lengths);
            unlink(&written.name);
            if let Ok(mapped) = result {
                prop_assert_eq!(offsets.len(), lengths.len());
                for (&o, &n) in offsets.iter().zip(&lengths) {
                    prop_assert!(o.saturating_add(n) <= 24);
                }
                drop(mapped);
            }
        }
    }
}
