//! What a prefetcher reads: fixed-size rows of an array ([`Rows`]), or encoded images ([`EncodedRows`]) that it
//! decodes; both as raw memory that their owner keeps alive and unchanged while any prefetcher reads it.

use crate::advice::{ranges_resident, will_need};
use crate::gather::gather_rows_to_vec;
use crate::images::{check_offsets, decode_rows, ImageError, ImageSpec};

/// Rows of one array, as raw memory the prefetcher reads.
pub struct Rows {
    ptr: *const u8,
    bytes: usize,
    row_bytes: usize,
    from_disk: bool,
}

// SAFETY: `Rows` is only read, and the contract of `Rows::new` keeps the memory valid and unchanged for as long
// as the prefetcher that reads it lives (its `Drop` joins the thread; inline, nothing reads after `next`).
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
            from_disk: false,
        }
    }

    /// These rows are a mapping of a file that may be on disk (not under `/dev/shm`): never taken to be in memory
    /// for gathering inline. `mincore` cannot always tell: for a file this process may neither write nor owns,
    /// Linux (since 5.2) answers that every page is resident.
    pub fn from_disk(mut self) -> Self {
        self.from_disk = true;
        self
    }

    /// The byte ranges `(offset, len)` of rows `chunk` in [`Self::slice`].
    fn ranges<'a>(&'a self, chunk: &'a [u32]) -> impl Iterator<Item = (usize, usize)> + Clone + 'a {
        chunk
            .iter()
            .map(|&i| (i as usize * self.row_bytes, self.row_bytes))
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
    pub(super) fn region(&self) -> &[u8] {
        match self {
            Source::Rows(r) => r.slice(),
            Source::Images(im) => im.data.slice(),
        }
    }

    /// Ask for the pages of `chunk`'s rows ahead of time (see [`crate::advice`]). Indices out of range are
    /// skipped here; the gather reports them.
    pub(super) fn read_ahead(&self, chunk: &[u32]) {
        match self {
            Source::Rows(r) => will_need(r.slice(), r.ranges(chunk)),
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

    /// The bytes a batch of `rows` rows takes from this source (None for encoded images: decoded, their size is
    /// not the rows' but the decoder's, and decoding is what the thread is for).
    pub(super) fn fixed_bytes(&self, rows: usize) -> Option<usize> {
        match self {
            Source::Rows(r) => Some(r.row_bytes.saturating_mul(rows)),
            Source::Images(_) => None,
        }
    }

    /// Whether the pages of `chunk`'s rows are in memory now (always false for encoded images).
    pub(super) fn holds_in_memory(&self, chunk: &[u32]) -> bool {
        match self {
            Source::Rows(r) => !r.from_disk && ranges_resident(r.slice(), r.ranges(chunk)),
            Source::Images(_) => false,
        }
    }

    pub(super) fn batch(&self, chunk: &[u32], first_position: u64) -> Result<Vec<u8>, String> {
        match self {
            Source::Rows(r) => {
                gather_rows_to_vec(r.slice(), r.row_bytes, chunk, 1).map_err(|e| e.to_string())
            }
            Source::Images(im) => im.decode(chunk, first_position).map_err(|e| e.to_string()),
        }
    }
}
