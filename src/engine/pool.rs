//! Large engine buffers (allgather / alltoall / reducescatter results, fusion buffers, scratch
//! copies): pages mapped for the engine alone and recycled, instead of the C heap.
//!
//! Why not `Vec<u8>`: the engine thread allocates from glibc's per-thread arena, and results are
//! freed later on the caller's thread. Freed memory coalesces into that arena's top chunk, which
//! glibc keeps resident (`malloc_trim` trims only the main arena's top, and the trim threshold
//! rises with the largest mmapped block ever freed). The arena's resident size therefore
//! ratchets up to the largest set of results ever alive at once: with random sizes, resident
//! memory crept for as long as a job ran. Mapping and unmapping every buffer instead costs a
//! page fault per page on every op (several µs each on a VM).
//!
//! So free buffers are kept and reused (by size class, within a quarter octave), but only while
//! what is mapped (live and free) stays within twice the peak of live pooled bytes over the
//! last one or two [`WINDOW`]s: a job whose sizes repeat (training) reuses its buffers forever,
//! and a job whose sizes wander keeps what it recently needed, not the most it ever needed.
//! Twice, not once: a step often alternates between classes that are never live together (a
//! reduce-scatter's share, then an allgather's whole), and a bound of one peak would unmap the
//! larger each time the smaller is taken, so every op would map, and fault in, fresh pages.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::sys::Pages;

/// Smallest size class; smaller results stay on the C heap (see [`super::TensorBuf::engine`]).
pub const MIN_CLASS: usize = 64 << 10;

/// How long a peak of live bytes keeps justifying free buffers of that size.
pub const WINDOW: Duration = Duration::from_secs(30);

/// The pool behind every [`PageBuf`].
static POOL: Mutex<Pool> = Mutex::new(Pool::new());

/// A page-mapped byte buffer of `len` bytes from the engine's pool; back to the pool on drop.
///
/// Its bytes are initialized but unspecified (zeros or an earlier buffer's data): callers
/// overwrite what they read.
pub struct PageBuf {
    /// A size class's mapping, `len` bytes or more; `None` only once it is back in the pool.
    pages: Option<Pages>,
    len: usize,
    pool: &'static Mutex<Pool>,
}

impl PageBuf {
    /// A buffer of `len` bytes from the process-wide pool.
    pub fn new(len: usize) -> Result<PageBuf> {
        PageBuf::from_pool(&POOL, len)
    }

    fn from_pool(pool: &'static Mutex<Pool>, len: usize) -> Result<PageBuf> {
        let pages = pool.lock().take(size_class(len), Instant::now())?;
        Ok(PageBuf {
            pages: Some(pages),
            len,
            pool,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Read access.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        match &self.pages {
            Some(p) => &p.as_slice()[..self.len],
            None => &[],
        }
    }

    /// Write access.
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.pages {
            Some(p) => &mut p.as_mut_slice()[..self.len],
            None => &mut [],
        }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if let Some(pages) = self.pages.take() {
            self.pool.lock().give(pages, Instant::now());
        }
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cap = self.pages.as_ref().map_or(0, Pages::len);
        write!(f, "PageBuf({} of {cap} bytes)", self.len)
    }
}

/// The mapping size for a buffer of `len` bytes: at least [`MIN_CLASS`], rounded up to a
/// quarter of its power of two (at most 25 % unused).
pub fn size_class(len: usize) -> usize {
    let len = len.max(MIN_CLASS);
    let step = 1usize << (len.ilog2() - 2);
    len.next_multiple_of(step)
}

/// Free mappings and the bookkeeping that bounds them.
pub struct Pool {
    /// Free mappings, least recently freed first; one dropped from the list is unmapped.
    free: Vec<Pages>,
    free_bytes: usize,
    live_bytes: usize,
    /// Peak of `live_bytes` in the current window and in the one before.
    peak: usize,
    prev_peak: usize,
    window_start: Option<Instant>,
}

impl Pool {
    const fn new() -> Pool {
        Pool {
            free: Vec::new(),
            free_bytes: 0,
            live_bytes: 0,
            peak: 0,
            prev_peak: 0,
            window_start: None,
        }
    }

    /// Starts a new window when the current one is over (two when it has been idle longer).
    fn roll(&mut self, now: Instant) {
        let start = *self.window_start.get_or_insert(now);
        let age = now.saturating_duration_since(start);
        if age >= WINDOW {
            self.prev_peak = if age >= 2 * WINDOW { 0 } else { self.peak };
            self.peak = self.live_bytes;
            self.window_start = Some(now);
        }
    }

    /// Mapped bytes (live and free) the pool may hold now (see the module's notes).
    fn limit(&self) -> usize {
        2 * self.peak.max(self.prev_peak)
    }

    /// Unmaps the oldest free mappings until live and free bytes fit the limit.
    fn evict(&mut self) {
        let limit = self.limit();
        let mut n = 0;
        while n < self.free.len() && self.live_bytes + self.free_bytes > limit {
            self.free_bytes -= self.free[n].len();
            n += 1;
        }
        self.free.drain(..n);
    }

    /// A mapping of `cap` bytes (a size class): a free one when there is one, else a new one.
    fn take(&mut self, cap: usize, now: Instant) -> Result<Pages> {
        self.roll(now);
        self.live_bytes += cap;
        self.peak = self.peak.max(self.live_bytes);
        if let Some(i) = self.free.iter().rposition(|p| p.len() == cap) {
            let pages = self.free.remove(i);
            self.free_bytes -= cap;
            return Ok(pages);
        }
        // A new mapping: make room first, so that what is mapped stays within the limit.
        self.evict();
        map(cap).inspect_err(|_| self.live_bytes -= cap)
    }

    /// Takes back a mapping that [`Pool::take`] handed out.
    fn give(&mut self, pages: Pages, now: Instant) {
        self.roll(now);
        let cap = pages.len();
        self.live_bytes -= cap;
        self.free.push(pages);
        self.free_bytes += cap;
        self.evict();
    }
}

fn map(cap: usize) -> Result<Pages> {
    Pages::map(cap).map_err(|e| {
        Error::Io(format!(
            "could not map {cap} bytes for an engine buffer: {e}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> &'static Mutex<Pool> {
        Box::leak(Box::new(Mutex::new(Pool::new())))
    }

    #[test]
    fn size_classes_round_up_to_a_quarter_octave() {
        assert_eq!(size_class(0), MIN_CLASS);
        assert_eq!(size_class(MIN_CLASS), MIN_CLASS);
        assert_eq!(size_class(MIN_CLASS + 1), MIN_CLASS + MIN_CLASS / 4);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 18));
        assert_eq!(size_class(7 << 20), 7 << 20);
        assert_eq!(size_class((7 << 20) + 5), 8 << 20);
        for len in [1usize, 70_000, 999_999, 6_291_456, 12_345_678] {
            let c = size_class(len);
            assert!(
                c >= len && (c <= MIN_CLASS || c < len + len / 4 + 1),
                "{len} -> {c}"
            );
        }
    }

    #[test]
    fn freed_buffers_are_reused_and_keep_their_bytes_writable() {
        let pool = pool();
        let mut a = PageBuf::from_pool(pool, 300_000).unwrap();
        a.as_mut_slice().fill(7);
        let addr = a.as_slice().as_ptr();
        drop(a);
        // Same class: the same mapping comes back.
        let mut b = PageBuf::from_pool(pool, 290_000).unwrap();
        assert_eq!(b.as_slice().as_ptr(), addr);
        assert_eq!(b.len(), 290_000);
        b.as_mut_slice().fill(1);
        assert!(b.as_slice().iter().all(|&x| x == 1));
        let p = pool.lock();
        assert_eq!((p.live_bytes, p.free_bytes), (size_class(300_000), 0));
    }

    fn addr(p: &Pages) -> usize {
        p.as_slice().as_ptr() as usize
    }

    /// (address, size) of the pool's free mappings, least recently freed first.
    fn free(p: &Pool) -> Vec<(usize, usize)> {
        p.free.iter().map(|f| (addr(f), f.len())).collect()
    }

    #[test]
    fn free_memory_is_bounded_by_the_recent_peak_of_live_memory() {
        const MB: usize = 1 << 20;
        let pool = pool();
        let mut p = pool.lock();
        let t0 = Instant::now();
        let pages = p.take(8 * MB, t0).unwrap();
        let big = addr(&pages);
        p.give(pages, t0);
        assert_eq!((p.free_bytes, p.live_bytes), (8 * MB, 0));
        // A class never live together with it (a reduce-scatter's share, an allgather's
        // whole): both stay mapped, so alternating between them maps nothing new.
        let pages = p.take(4 * MB, t0).unwrap();
        let mid = addr(&pages);
        assert_eq!((p.free_bytes, p.live_bytes), (8 * MB, 4 * MB));
        p.give(pages, t0);
        let pages = p.take(8 * MB, t0).unwrap();
        assert_eq!(addr(&pages), big);
        p.give(pages, t0);
        let pages = p.take(4 * MB, t0).unwrap();
        assert_eq!(addr(&pages), mid);
        p.give(pages, t0);
        assert_eq!(free(&p), vec![(big, 8 * MB), (mid, 4 * MB)]);
        // A third class would take the mapped bytes past twice the peak: the least recently
        // freed mapping goes first.
        let pages = p.take(6 * MB, t0).unwrap();
        let six = addr(&pages);
        assert_eq!((free(&p), p.live_bytes), (vec![(mid, 4 * MB)], 6 * MB));
        p.give(pages, t0);
        // A window later they are still reused.
        let t1 = t0 + WINDOW + Duration::from_millis(1);
        let pages = p.take(6 * MB, t1).unwrap();
        assert_eq!(addr(&pages), six);
        p.give(pages, t1);
        // Once the 8 MB peak is two windows old, only the 6 MB one counts.
        let t2 = t1 + WINDOW + Duration::from_millis(1);
        let pages = p.take(MB, t2).unwrap();
        let small = addr(&pages);
        p.give(pages, t2);
        assert_eq!(p.limit(), 12 * MB);
        let expect = vec![(mid, 4 * MB), (six, 6 * MB), (small, MB)];
        assert_eq!((free(&p), p.live_bytes), (expect, 0));
        // After two idle windows only the current window's peak counts.
        let t3 = t2 + 3 * WINDOW;
        let pages = p.take(MB, t3).unwrap();
        assert_eq!(addr(&pages), small);
        p.give(pages, t3);
        assert_eq!((p.free_bytes, p.limit()), (MB, 2 * MB));
        p.free.clear();
    }
}
