//! glibc's malloc, made to give back what a burst freed, through its public
//! interface (`mallopt`, `mallinfo2`, `malloc_trim`). Part of the binary,
//! not of the library, which has no `unsafe`. Measured in docs/memory.md.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

/// The system's malloc, with the bytes it has given out counted: what the
/// memory bound (`listen.max_memory`) reads, at every new connection and
/// request. `mallinfo2` walks every free block with the arena locked (20 ms
/// for 100,000 of them), too slow to read that often.
pub struct Counted;

/// Bytes allocated and not yet freed, all threads together, up to what
/// each thread has not yet added ([`UNCOUNTED`]).
static ALLOCATED: AtomicIsize = AtomicIsize::new(0);

/// A thread's allocations add to [`ALLOCATED`] once they reach this either
/// way: the count is off by at most this per thread, and a request's
/// allocations cost no atomic operation.
const UNCOUNTED: isize = 32 * 1024;

thread_local! {
    static PENDING: Pending = const { Pending(Cell::new(0)) };
}

/// What a thread has allocated (or freed, below zero) and not yet added
/// to [`ALLOCATED`]; added when the thread ends. Left out, the last frees
/// of each short-lived thread (the admin listener renders each page on one
/// of its own) were lost: 11 KB a `/metrics` scrape, 115 MiB "in use"
/// after 10,500 of them, and every request refused.
struct Pending(Cell<isize>);

impl Drop for Pending {
    fn drop(&mut self) {
        ALLOCATED.fetch_add(self.0.replace(0), Ordering::Relaxed);
    }
}

fn count(bytes: isize) {
    let added = PENDING.try_with(|Pending(pending)| {
        let sum = pending.get().wrapping_add(bytes);
        match sum.unsigned_abs() < UNCOUNTED.unsigned_abs() {
            true => pending.set(sum),
            false => {
                pending.set(0);
                ALLOCATED.fetch_add(sum, Ordering::Relaxed);
            }
        }
    });
    // A thread past its thread-locals (exiting) counts directly.
    if added.is_err() {
        ALLOCATED.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// A layout's size as a count; sizes never pass `isize::MAX`.
fn signed(size: usize) -> isize {
    isize::try_from(size).unwrap_or(isize::MAX)
}

/// What malloc takes for a block besides its size, on average: its
/// 8-byte header and the rounding to 16. Counted with each block, as
/// `mallinfo2` counts them: a config's thousands of small blocks (metric
/// series' labels) take half again their size.
const PER_BLOCK: isize = 16;

// SAFETY: every call goes to the system allocator unchanged; the count is
// only arithmetic on thread-local and atomic integers, which allocate
// nothing.
unsafe impl GlobalAlloc for Counted {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, passed on.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            count(signed(layout.size()).saturating_add(PER_BLOCK));
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            count(signed(layout.size()).saturating_add(PER_BLOCK));
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's block and layout, passed on.
        unsafe { System.dealloc(ptr, layout) };
        count(-(signed(layout.size()).saturating_add(PER_BLOCK)));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's block, layout and size, passed on.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            count(signed(new_size).wrapping_sub(signed(layout.size())));
        }
        new
    }
}

/// Bytes the program has allocated and not freed (its own allocations;
/// not malloc's overhead, nor C libraries' own): what the memory bound
/// reads. O(1): one atomic load.
pub fn counted() -> usize {
    usize::try_from(ALLOCATED.load(Ordering::Relaxed)).unwrap_or(0)
}

/// Bytes malloc has in use, mmapped blocks included, its overhead counted:
/// what the trim compares with the resident memory, once a second.
fn in_use() -> usize {
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let info = unsafe { libc::mallinfo2() };
    info.uordblks.saturating_add(info.hblkhd)
}

/// glibc's malloc keeps what is freed in its arenas: after 3,000 idle
/// connections closed, or a reload from 10,000 routes back to 2, the RSS
/// stayed at its peak. Every second this compares the anonymous resident
/// memory with the bytes malloc has in use (`mallinfo2`); when the gap
/// (freed memory still held, beyond the smallest gap seen, from the start:
/// stacks) is
/// over 1 MiB and a quarter of what is in use, it hands the free pages back
/// (`malloc_trim`). A trim that gave little back (live objects on the same
/// pages) doubles the wait before the next, up to a minute, unless a
/// quarter of what was in use is freed meanwhile: the check
/// costs microseconds, a trim of a large heap milliseconds.
pub fn trim_freed_memory() {
    use libc::M_TRIM_THRESHOLD;
    use libc::{malloc_trim, mallopt, M_MMAP_THRESHOLD, M_MXFAST, M_TOP_PAD};
    // What a thread's arena frees must reach the system without waiting
    // for a `malloc_trim`, which never shrinks a thread arena's top:
    // - fixed thresholds instead of glibc's sliding ones (once a large
    //   block is freed glibc raises them, up to 32 MiB for mmap and 64 MiB
    //   for trimming, and a big config's memory stayed resident after a
    //   reload to a small one), and a top trimmed from 256 KiB with no pad
    //   kept above it (128 KiB by default, per arena);
    // - no fastbins: small blocks freed last were merged into the top
    //   only by a later consolidation, which trims nothing, and the top
    //   then stayed resident. The per-thread cache (tcache) still serves
    //   the small blocks a busy proxy reuses.
    // Measured in docs/memory.md ("Memory follows the config").
    // SAFETY: mallopt sets allocator parameters; called before the runtime.
    unsafe {
        mallopt(M_MXFAST, 0);
        mallopt(M_TRIM_THRESHOLD, 256 * 1024);
        mallopt(M_TOP_PAD, 0);
        mallopt(M_MMAP_THRESHOLD, 1024 * 1024);
    }
    /// Anonymous resident bytes, from /proc/self/status: the heap and
    /// arenas, stacks; not the code, whose pages come in as paths first run.
    fn resident() -> Option<usize> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let kib = status.lines().find_map(|l| l.strip_prefix("RssAnon:"))?;
        let kib: usize = kib.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib.saturating_mul(1024))
    }
    // What is resident besides the heap (stacks) is the smallest gap
    // between resident and in-use bytes seen: a trim is worth it once the
    // gap exceeds that by MIN_EXCESS and a quarter of what is in use.
    const MIN_EXCESS: usize = 1024 * 1024;
    const TICK: Duration = Duration::from_secs(1);
    std::thread::Builder::new()
        .name("herdguard-trim".into())
        .spawn(|| {
            let mut wait = TICK;
            let mut last = Instant::now();
            // Measured before the first request: a burst that came and went
            // within the first tick was taken for stacks, and its freed
            // pages stayed (the memory test, one run in three).
            let mut floor = resident().map_or(usize::MAX, |rss| rss.saturating_sub(in_use()));
            // The most in use since the last trim: once a quarter of it is
            // freed, the next trim need not wait out the backoff (a big
            // config loaded and dropped between two trims).
            let mut high = 0usize;
            loop {
                #[allow(clippy::disallowed_methods)] // the trim thread's own
                std::thread::sleep(TICK);
                let (Some(rss), used) = (resident(), in_use()) else {
                    continue;
                };
                high = high.max(used);
                let gap = rss.saturating_sub(used);
                floor = floor.min(gap);
                let excess = gap - floor;
                if excess < MIN_EXCESS || excess < used / 4 {
                    wait = TICK;
                    continue;
                }
                if last.elapsed() < wait && used.saturating_mul(4) > high.saturating_mul(3) {
                    continue;
                }
                // SAFETY: malloc_trim only returns free pages to the system.
                unsafe { malloc_trim(0) };
                last = Instant::now();
                high = used;
                let after = resident().unwrap_or(rss).saturating_sub(in_use());
                floor = floor.min(after);
                // Little came back (the free memory is in pages still partly
                // used): try less often.
                wait = match (after - floor).saturating_mul(4) > excess.saturating_mul(3) {
                    true => (wait * 2).min(Duration::from_secs(64)),
                    false => TICK,
                };
            }
        })
        .ok();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block given out and freed is counted back (a sign slip once
    /// counted each free 32 bytes short: 40 MiB "in use" after a reload
    /// from 1,000 routes back to 3, and more with every request).
    #[test]
    fn what_is_freed_is_counted_back() {
        let before = counted();
        for i in 0..100_000usize {
            let small = std::hint::black_box(vec![0u8; 1 + i % 200]);
            let mut grown = Vec::with_capacity(4);
            grown.extend_from_slice(&small);
            drop(std::hint::black_box(grown));
            drop(small);
        }
        let after = counted();
        // Other tests allocate meanwhile; a slip of a byte a block would
        // be 200,000 bytes.
        assert!(after.abs_diff(before) < 100_000, "{before} -> {after}");
    }

    /// What a thread has not yet added is added when it ends: threads that
    /// allocate a little and give it to another to free (the admin
    /// listener's page threads) leave the count where it was.
    #[test]
    fn a_thread_that_ends_leaves_its_count() {
        let counted = || ALLOCATED.load(Ordering::Relaxed);
        let before = counted();
        for _ in 0..2_000 {
            let made = std::thread::spawn(|| std::hint::black_box(vec![0u8; 8 * 1024]))
                .join()
                .unwrap();
            drop(std::hint::black_box(made));
        }
        let after = counted();
        // Lost at each end, 2,000 threads' 8 KiB would be 16 MB; other
        // tests allocate meanwhile.
        assert!(after.abs_diff(before) < 1 << 20, "{before} -> {after}");
    }
}
