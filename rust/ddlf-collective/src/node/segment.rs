//! One shared-memory file of a host's group, mapped: its layout (a header page of atomic words and a failure
//! reason, then one slot per member and the result region, each on cache lines), and how it is made and mapped.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};

use crate::ring::Elem;

pub(super) const MAGIC: u64 = 0x4444_4c46_4e4f_4445; // "DDLFNODE"
/// The header page: words, then a failure reason.
pub(super) const HEADER: usize = 4096;
pub(super) const W_MAGIC: usize = 0;
pub(super) const W_MEMBERS: usize = 1;
pub(super) const W_LEN: usize = 2;
pub(super) const W_ELEM: usize = 3;
/// 0, or 1 + the local index of the member that failed the call (its reason follows at [`REASON_AT`]).
pub(super) const W_FAILED: usize = 4;
/// The barrier each member last arrived at, one word per member (control file).
pub(super) const W_ARRIVED: usize = 8;
/// Each member's call shape, two words per member: elements, element size (control file).
pub(super) const W_SHAPE: usize = W_ARRIVED + MAX_MEMBERS;
const REASON_AT: usize = 2048;
/// The most members one host's group may have.
pub const MAX_MEMBERS: usize = 64;
const _: () = assert!((W_SHAPE + 2 * MAX_MEMBERS) * 8 <= REASON_AT);

/// One shared-memory data file (or the control file), mapped.
pub(super) struct Segment {
    /// Shared with the results handed out by [`Segment::shared_region`]: the mapping lives while any does.
    map: Arc<MmapMut>,
    path: PathBuf,
    members: usize,
    /// Elements each region holds: the most a call using the file may have (shorter calls use its start).
    pub(super) len: usize,
    pub(super) elem: usize,
    /// The caller's tag for the calls that use this segment (0 unless a call asks for its own; see
    /// [`super::Io::Shared`]).
    pub(super) tag: u32,
    unlinked: bool,
}

impl Segment {
    pub(super) fn size(members: usize, len: usize, elem: usize) -> usize {
        // Regions start on cache lines.
        HEADER + (members + 1) * (len * elem).next_multiple_of(64)
    }

    pub(super) fn word(&self, i: usize) -> &AtomicU64 {
        assert!((i + 1) * 8 <= REASON_AT && self.map.len() >= HEADER);
        let p = self.map.as_ptr().wrapping_add(i * 8);
        assert!((p as usize).is_multiple_of(std::mem::align_of::<AtomicU64>()));
        // SAFETY: checked above: `p` lies inside the mapping's header page (which lives as long as `self`) and
        // is 8-byte aligned (the mapping is page-aligned, `i * 8` a multiple of 8). Other processes touch these
        // words only atomically, so an `AtomicU64` view is sound.
        unsafe { &*(p as *const AtomicU64) }
    }

    /// Region `r` (a member's slot, or the result at `members`) as a raw pointer to `len` elements of `T` (at
    /// most the file's [`Segment::len`]).
    pub(super) fn region<T: Elem>(&self, r: usize, len: usize) -> *mut T {
        assert!(r <= self.members && std::mem::size_of::<T>() == self.elem && len <= self.len);
        let stride = (self.len * self.elem).next_multiple_of(64);
        let start = HEADER + r * stride;
        assert!(start + self.len * self.elem <= self.map.len());
        let p = self.map.as_ptr().wrapping_add(start) as *mut T;
        assert!((p as usize).is_multiple_of(std::mem::align_of::<T>()));
        p
    }

    pub(super) fn set_failed(&self, index: usize, reason: &str) {
        if self.word(W_FAILED).load(Ordering::Acquire) != 0 {
            return;
        }
        let bytes = reason.as_bytes();
        let n = bytes.len().min(HEADER - REASON_AT - 1);
        let dst = self.map.as_ptr().wrapping_add(REASON_AT) as *mut u8;
        // SAFETY: `REASON_AT + n < HEADER <= map.len()`: the write stays in the header page; members write the
        // reason only before publishing the failed word, and a second writer (two failures at once) at worst
        // mixes two reasons' bytes (plain bytes, no invariant).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, n);
            *dst.add(n) = 0;
        }
        self.word(W_FAILED)
            .store(1 + index as u64, Ordering::Release);
    }

    pub(super) fn failure(&self) -> Option<(usize, String)> {
        let f = self.word(W_FAILED).load(Ordering::Acquire);
        if f == 0 {
            return None;
        }
        let reason = &self.map[REASON_AT..HEADER];
        let end = reason.iter().position(|&b| b == 0).unwrap_or(reason.len());
        Some((
            (f - 1) as usize,
            String::from_utf8_lossy(&reason[..end]).into_owned(),
        ))
    }

    /// The first `len` elements of region `r` as bytes of the mapping: the mapping itself (kept alive by the
    /// `Arc`), the region's first byte and the length in bytes. The region starts on a cache line (64 bytes).
    pub(super) fn shared_region(&self, r: usize, len: usize) -> (Arc<MmapMut>, usize, usize) {
        assert!(r <= self.members && len <= self.len);
        let stride = (self.len * self.elem).next_multiple_of(64);
        let start = HEADER + r * stride;
        assert!(start + len * self.elem <= self.map.len());
        (Arc::clone(&self.map), start, len * self.elem)
    }

    pub(super) fn unlink(&mut self) {
        if !self.unlinked {
            let _ = std::fs::remove_file(&self.path);
            self.unlinked = true;
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
    }
}

pub(super) fn map(
    file: &File,
    path: PathBuf,
    members: usize,
    len: usize,
    elem: usize,
    bytes: usize,
    unlinked: bool,
) -> io::Result<Segment> {
    // SAFETY: the file is ddlf's own under /dev/shm, sized to at least `bytes` before mapping (the leader sets
    // the length first; members map only once the leader published the header, after it reserved every page).
    // Other processes change its bytes only under the barrier protocol of this module.
    let map = unsafe { MmapOptions::new().len(bytes).map_mut(file)? };
    Ok(Segment {
        map: Arc::new(map),
        path,
        members,
        len,
        elem,
        tag: 0,
        unlinked,
    })
}

pub(super) fn allocate(file: &File, size: usize) -> io::Result<()> {
    // SAFETY: `file` is open for writing for the whole call; posix_fallocate only reads its arguments.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as libc::off_t) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}
