//! Paging advice for the memory a prefetcher reads. A dataset larger than memory is a file mapping whose pages
//! come from disk on first touch; read in a shuffled order, the kernel's default read-around (up to 128 KiB per
//! fault) reads mostly rows nobody asked for and, under a memory budget, evicts them before they are used. The
//! prefetcher marks its sources [`Access::Random`] (a fault reads its own page only) and asks for the pages of the
//! next batches' rows ahead of time ([`will_need`]: the reads are queued together and proceed while the current
//! batches are gathered and trained on). Memory that is wholly resident when a pipeline starts (the heap,
//! `/dev/shm`, a small file already cached: [`resident`]) gets no advice, which there would cost a system call per
//! row and change nothing.

/// How a source's pages are going to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The kernel's default: read-around on faults.
    Normal,
    /// In a random order: a fault reads its own page only.
    Random,
}

fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

/// `madvise` over the whole pages that cover `[start, start + len)`. Only advice that never changes what the
/// memory holds is given (see the callers), so a span that reaches into a neighbouring allocation on the same
/// page, or memory that is not a mapping at all (the kernel answers ENOMEM), is harmless: errors are ignored.
fn advise(start: usize, len: usize, page: usize, advice: libc::c_int) {
    if len == 0 {
        return;
    }
    if !matches!(
        advice,
        libc::MADV_NORMAL | libc::MADV_RANDOM | libc::MADV_WILLNEED
    ) {
        return;
    }
    let first = start & !(page - 1);
    let end = (start + len).div_ceil(page) * page;
    // SAFETY: `advice` is MADV_NORMAL, MADV_RANDOM or MADV_WILLNEED (checked above): hints that change neither
    // the contents nor the validity of any mapping, whatever range they are given; the range is page-aligned as
    // madvise requires.
    unsafe {
        libc::madvise(first as *mut libc::c_void, end - first, advice);
    }
}

/// The residency byte of each page in `[first, end)` (page numbers): bit 0 set when the page is in memory now.
/// None when the kernel cannot tell (not a mapping).
fn mincore_pages(first: usize, end: usize, page: usize) -> Option<Vec<u8>> {
    let mut pages = vec![0u8; end - first];
    // SAFETY: `first * page` is page-aligned as mincore requires, and `pages` holds one byte for each page of
    // `[first, end)`, the most mincore writes; mincore only reads the page tables.
    let rc = unsafe {
        libc::mincore(
            (first * page) as *mut libc::c_void,
            (end - first) * page,
            pages.as_mut_ptr().cast(),
        )
    };
    (rc == 0).then_some(pages)
}

/// Whether every page of `region` is in memory now (`mincore`). False when the kernel cannot tell (not a
/// mapping): the caller then advises, which is harmless.
pub fn resident(region: &[u8]) -> bool {
    ranges_resident(region, std::iter::once((0, region.len())))
}

/// Pages that [`ranges_resident`] reads with one `mincore`, from its first range's page to its last's: about a
/// nanosecond a page, where a call costs a microsecond on a VM (a call per row would cost more than the rows'
/// gathering).
const ONE_CALL_PAGES: usize = 1 << 16;

/// At most this many `mincore` calls, one per run of pages, where the ranges spread over more than
/// [`ONE_CALL_PAGES`]: telling would otherwise cost more than what the answer saves.
const MAX_CALLS: usize = 32;

/// Whether every page that the byte ranges `(offset, len)` of `region` cover is in memory now (ranges outside the
/// region are clipped): [`resident`] for the rows a round reads. False when the kernel cannot tell, or when
/// telling would take more than [`MAX_CALLS`] calls (rows scattered over more than [`ONE_CALL_PAGES`]): a caller
/// then takes the way that does not need the pages in memory.
pub fn ranges_resident<I>(region: &[u8], ranges: I) -> bool
where
    I: Iterator<Item = (usize, usize)> + Clone,
{
    let page = page_size();
    let (base, size) = (region.as_ptr() as usize, region.len());
    let clip = move |(offset, len): (usize, usize)| {
        (offset < size).then(|| (offset, len.min(size - offset)))
    };
    let pages_of = move |r: (usize, usize)| {
        clip(r)
            .filter(|&(_, len)| len > 0)
            .map(|(offset, len)| ((base + offset) / page, (base + offset + len).div_ceil(page)))
    };
    let in_memory = |pages: &[u8]| pages.iter().all(|p| p & 1 == 1);
    let (region_lo, region_hi) = (base / page, (base + size).div_ceil(page));
    if region_hi - region_lo <= ONE_CALL_PAGES
        && mincore_pages(region_lo, region_hi, page).is_some_and(|pages| in_memory(&pages))
    {
        return true; // all of a region of at most one call's pages: whatever the rows (a pass over them is slower)
    }
    // One pass for the first and last byte, no sort and no division per row: a round of a million one-byte rows
    // took 33 ms sorting its spans, 25 times the gathering it was to decide on.
    let (first_byte, end_byte) = ranges
        .clone()
        .filter_map(clip)
        .filter(|&(_, len)| len > 0)
        .fold((usize::MAX, 0), |(lo, hi), (offset, len)| {
            (lo.min(offset), hi.max(offset + len))
        });
    if first_byte >= end_byte {
        return true;
    }
    let (lo, hi) = ((base + first_byte) / page, (base + end_byte).div_ceil(page));
    if hi - lo <= ONE_CALL_PAGES {
        return mincore_pages(lo, hi, page).is_some_and(|pages| {
            // Every page between the first and the last in memory (the usual answer) says it for the rows too.
            in_memory(&pages)
                || ranges
                    .filter_map(pages_of)
                    .all(|(first, end)| in_memory(&pages[first - lo..end - lo]))
        });
    }
    let spans = page_spans(base, ranges.filter_map(clip), page);
    spans.len() <= MAX_CALLS
        && spans
            .iter()
            .all(|&(first, end)| mincore_pages(first, end, page).is_some_and(|p| in_memory(&p)))
}

/// Mark `region` as read in the order `access` says.
pub fn set_access(region: &[u8], access: Access) {
    let advice = match access {
        Access::Normal => libc::MADV_NORMAL,
        Access::Random => libc::MADV_RANDOM,
    };
    advise(region.as_ptr() as usize, region.len(), page_size(), advice);
}

/// The page spans that the byte ranges `(offset, len)` of a region starting at `base` cover, sorted, with
/// overlapping and adjacent spans merged: `(first_page, end_page)` in page numbers.
pub fn page_spans(
    base: usize,
    ranges: impl Iterator<Item = (usize, usize)>,
    page: usize,
) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = ranges
        .filter(|&(_, len)| len > 0)
        .map(|(offset, len)| ((base + offset) / page, (base + offset + len).div_ceil(page)))
        .collect();
    spans.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    for (first, end) in spans {
        match merged.last_mut() {
            Some(last) if first <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((first, end)),
        }
    }
    merged
}

/// Ask the kernel to start reading the pages of the byte ranges `(offset, len)` of `region` now (ranges outside
/// the region are clipped). Returns at once; the reads complete in the background.
pub fn will_need(region: &[u8], ranges: impl Iterator<Item = (usize, usize)>) {
    let page = page_size();
    let size = region.len();
    let clipped = ranges
        .filter(|&(offset, _)| offset < size)
        .map(|(offset, len)| (offset, len.min(size - offset)));
    for (first, end) in page_spans(region.as_ptr() as usize, clipped, page) {
        advise(
            first * page,
            (end - first) * page,
            page,
            libc::MADV_WILLNEED,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_every_range_merge_neighbours_and_sort() {
        let page = 4096;
        // Two rows on page 0, one crossing pages 2-3, one on page 3 (merged), one alone on page 9.
        let ranges = [
            (9 * page + 5, 10),
            (100, 50),
            (2 * page + 4000, 200),
            (3 * page + 10, 5),
            (0, 10),
        ];
        assert_eq!(
            page_spans(0, ranges.into_iter(), page),
            vec![(0, 1), (2, 4), (9, 10)]
        );
        // A base that is not page-aligned shifts the pages.
        assert_eq!(
            page_spans(page - 1, [(0, 2)].into_iter(), page),
            vec![(0, 2)]
        );
        // Empty ranges are dropped; adjacent spans merge.
        assert_eq!(
            page_spans(0, [(0, 0), (0, page), (page, page)].into_iter(), page),
            vec![(0, 2)]
        );
    }

    #[test]
    fn touched_heap_memory_is_resident_and_an_untouched_file_page_is_not() {
        let page = page_size();
        let data = vec![7u8; 3 * page + 5];
        assert!(resident(&data));
        assert!(resident(&[]));
        assert!(ranges_resident(
            &data,
            [(0, 10), (2 * page, page + 5), (1 << 30, 5)].into_iter()
        ));
        assert!(ranges_resident(&[], [(0, 10)].into_iter()));
        let path = std::env::temp_dir().join(format!("ddlf-advice-{}", std::process::id()));
        std::fs::write(&path, vec![1u8; 64 * page]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        file.sync_all().unwrap();
        // SAFETY: the file is private to this test and not modified while mapped.
        let map = unsafe { memmap2::Mmap::map(&file).unwrap() };
        // Drop the file's pages from the cache, then fault one in: the mapping is partly resident.
        // SAFETY: fadvise on an open descriptor; no memory is passed.
        unsafe {
            libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
                0,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        set_access(&map, Access::Random);
        let _ = std::hint::black_box(map[0]);
        let cached = resident(&map);
        std::fs::remove_file(&path).unwrap();
        // tmpfs keeps its pages whatever the advice: only a drop that took is checked further.
        if !cached {
            assert!(resident(&map[..page]));
            assert!(ranges_resident(&map, [(10, 20)].into_iter()));
            assert!(!ranges_resident(
                &map,
                [(10, 20), (9 * page, page)].into_iter()
            ));
        }
    }

    #[test]
    fn rows_scattered_over_a_large_region_are_not_told_at_any_cost() {
        let page = page_size();
        let span = (ONE_CALL_PAGES + 1) * page; // past one call's reach: a call per run of pages
        let mut data = vec![0u8; span + page]; // reserved, not touched: only the rows written below are in memory
        let rows = |n: usize| (0..n).map(move |i| (i * (span / (n - 1)).max(1), 8));
        for (offset, len) in rows(MAX_CALLS).chain(rows(MAX_CALLS + 1)) {
            data[offset..offset + len].fill(1);
        }
        assert!(ranges_resident(&data, rows(MAX_CALLS))); // spread, but few: told
        assert!(!ranges_resident(&data, rows(MAX_CALLS + 1))); // too many calls: not known, so not resident
        data[..page].fill(1);
        data[span..].fill(1);
        // Many rows in two runs of pages, far apart: two calls.
        let ends = (0..100)
            .map(|i| (i * 8, 8))
            .chain((0..100).map(|i| (span + i * 8, 8)));
        assert!(ranges_resident(&data, ends));
    }

    #[test]
    fn advice_on_mapped_heap_and_unmapped_memory_changes_nothing() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        set_access(&data, Access::Random);
        will_need(
            &data,
            [(0, 10), (50_000, 4000), (99_990, 1000), (200_000, 5)].into_iter(),
        );
        set_access(&data, Access::Normal);
        assert!(data.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        will_need(&[], [(0, 10)].into_iter());
    }
}
