//! A node's shared-memory files: named by the ring and its host ([`Node::path`]), made by the leader and mapped by
//! the others ([`Node::attach`]), and chosen for a call among those kept ([`Node::segment_for`]).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::segment::{allocate, map, Segment, HEADER, MAGIC, W_ELEM, W_LEN, W_MAGIC, W_MEMBERS};
use super::Node;
use crate::CollectiveError;

/// Data files a node keeps mapped.
const KEEP_SEGMENTS: usize = 4;

impl Node {
    pub(super) fn path(&self, what: &str) -> PathBuf {
        // The group and the first member's whole address: hosts that are network namespaces of one machine
        // share /dev/shm, and their members may listen on the same ports.
        let first: String = self.peers[0]
            .to_string()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let name = format!(
            "{}node-{:032x}-{first}-{what}",
            ddlf_core::shm::PREFIX,
            self.group,
        );
        PathBuf::from(ddlf_core::shm::DIR).join(name)
    }

    /// The index of the data file for a call of `len` elements of `elem` bytes with `tag`: the smallest kept file
    /// of that element size and tag whose regions hold at least `len` elements, or a new one of exactly `len`
    /// (the oldest dropped once [`KEEP_SEGMENTS`] are kept). A file serves every shorter call too, so the buckets of
    /// a model (lengths that differ, and often more of them than the files kept) reuse one file instead of making
    /// and faulting in a new one per call. Every member makes the same calls in the same order, so all choose the
    /// same file.
    pub(super) fn segment_for(
        &mut self,
        len: usize,
        elem: usize,
        tag: u32,
    ) -> Result<usize, CollectiveError> {
        let fits = self
            .segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.elem == elem && s.tag == tag && s.len >= len)
            .min_by_key(|(_, s)| s.len)
            .map(|(i, _)| i);
        if let Some(i) = fits {
            return Ok(i);
        }
        self.serial += 1;
        let mut seg = self.attach(&self.path(&self.serial.to_string()), len, elem)?;
        seg.tag = tag;
        if self.segments.len() == KEEP_SEGMENTS {
            self.segments.remove(0);
        }
        self.segments.push(seg);
        Ok(self.segments.len() - 1)
    }

    /// The file at `path` for `len` elements of `elem` bytes (0 elements: the control file): the leader makes
    /// it, the others wait for it (watching the control file, if any, for a failure) and map it.
    pub(super) fn attach(
        &self,
        path: &std::path::Path,
        len: usize,
        elem: usize,
    ) -> Result<Segment, CollectiveError> {
        let k = self.members();
        let size = Segment::size(k, len, elem);
        let io = |what: &str, e: io::Error| {
            CollectiveError::Invalid(format!("shared memory {}: {what}: {e}", path.display()))
        };
        if self.is_leader() {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(|e| io("create", e))?;
            // Reserve every page now: a full /dev/shm is an error here, not a SIGBUS later.
            let grown = file
                .set_len(size as u64)
                .and_then(|_| allocate(&file, size));
            let seg = map(
                &file,
                path.to_path_buf(),
                k,
                len,
                elem,
                HEADER.max(size),
                false,
            );
            if let Err(e) = grown {
                drop(seg);
                let _ = std::fs::remove_file(path);
                return Err(self.fail(
                    0,
                    format!(
                        "cannot reserve {size} bytes in {} ({e}): too little shared memory for a hierarchical \
                         all-reduce of this size (use a flat ring, or a larger /dev/shm)",
                        ddlf_core::shm::DIR
                    ),
                ));
            }
            let seg = seg.map_err(|e| io("map", e))?;
            for (w, v) in [(W_MEMBERS, k), (W_LEN, len), (W_ELEM, elem)] {
                seg.word(w).store(v as u64, Ordering::Relaxed);
            }
            seg.word(W_MAGIC).store(MAGIC, Ordering::Release);
            return Ok(seg);
        }
        // A member: wait for the leader's file (the leader may still be computing), probing it meanwhile.
        let t0 = Instant::now();
        let mut alive = t0;
        loop {
            self.failed()?;
            if let Ok(file) = File::options().read(true).write(true).open(path) {
                let mut word = [0u8; 8];
                let ready =
                    file.read_exact_at(&mut word, 0).is_ok() && u64::from_le_bytes(word) == MAGIC;
                if ready {
                    // Members never remove the file (the leader does, once all have mapped it).
                    let seg = map(&file, path.to_path_buf(), k, len, elem, size, true)
                        .map_err(|e| io("map", e))?;
                    let theirs = (
                        seg.word(W_MEMBERS).load(Ordering::Relaxed) as usize,
                        seg.word(W_LEN).load(Ordering::Relaxed) as usize,
                        seg.word(W_ELEM).load(Ordering::Relaxed) as usize,
                    );
                    if theirs != (k, len, elem) {
                        return Err(self.fail(
                            0,
                            format!(
                                "the leader's file is for {theirs:?} (members, elements, bytes)"
                            ),
                        ));
                    }
                    return Ok(seg);
                }
            }
            if t0.elapsed() >= self.timeout {
                return Err(self.fail(
                    0,
                    format!(
                        "made no shared memory for the call within {:?}",
                        self.timeout
                    ),
                ));
            }
            if alive.elapsed() >= self.liveness / 4 {
                if let Err(why) = self.probe(0) {
                    return Err(self.fail(0, why));
                }
                alive = Instant::now();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
