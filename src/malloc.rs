//! glibc's malloc, made to give back what a burst freed (the default
//! allocator; the `mimalloc` feature replaces it). Part of the binary, not
//! of the library, which has no `unsafe`. Measured in the README
//! ("Memory follows the config", "Memory comes back").

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
/// costs microseconds, a trim of a large heap milliseconds. Before each
/// trim, the runtime's threads empty their caches
/// ([`flush_cache_when_asked`]).
pub fn trim_freed_memory() {
    /// glibc's `struct mallinfo2` (2.33 and later).
    #[repr(C)]
    struct MallInfo2 {
        arena: usize,
        ordblks: usize,
        smblks: usize,
        hblks: usize,
        hblkhd: usize,
        usmblks: usize,
        fsmblks: usize,
        uordblks: usize,
        fordblks: usize,
        keepcost: usize,
    }
    extern "C" {
        fn mallinfo2() -> MallInfo2;
        fn malloc_trim(pad: usize) -> std::ffi::c_int;
        fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    }
    // What a thread's arena frees must reach the system without waiting
    // for a `malloc_trim`, which never shrinks a thread arena's top:
    // - fixed thresholds instead of glibc's sliding ones (once a large
    //   block is freed glibc raises them, up to 32 MiB for mmap and 64 MiB
    //   for trimming: 10-19 MiB stayed resident per arena after a reload
    //   back from 10,000 routes), and a top trimmed from 256 KiB with no
    //   pad kept above it (128 KiB by default, per arena);
    // - no fastbins: small blocks freed last were merged into the top
    //   only by a later consolidation, which trims nothing, and the top
    //   then stayed resident (55 MB of a 10,000-route config, one reload
    //   in three). The per-thread cache (tcache) still serves the small
    //   blocks a busy proxy reuses.
    // Measured in the README ("Memory follows the config").
    const M_MXFAST: std::ffi::c_int = 1;
    const M_TRIM_THRESHOLD: std::ffi::c_int = -1;
    const M_TOP_PAD: std::ffi::c_int = -2;
    const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
    // SAFETY: mallopt sets allocator parameters; called before the runtime.
    unsafe {
        mallopt(M_MXFAST, 0);
        mallopt(M_TRIM_THRESHOLD, 256 * 1024);
        mallopt(M_TOP_PAD, 0);
        mallopt(M_MMAP_THRESHOLD, 1024 * 1024);
    }
    /// Bytes malloc has in use, mmapped blocks included.
    fn in_use() -> usize {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let info = unsafe { mallinfo2() };
        info.uordblks.saturating_add(info.hblkhd)
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
            let mut asked = false;
            loop {
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
                    asked = false;
                    continue;
                }
                if last.elapsed() < wait && used.saturating_mul(4) > high.saturating_mul(3) {
                    continue;
                }
                // The runtime's threads first hand back what their caches
                // hold ([`flush_cache_when_asked`], as each next goes idle:
                // within a second, with the upkeep's tick); the trim comes
                // on the next tick.
                if !asked {
                    ASKED.fetch_add(1, Ordering::Relaxed);
                    asked = true;
                    continue;
                }
                asked = false;
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

/// How many times [`trim_freed_memory`] has asked the runtime's threads to
/// empty their caches before a trim.
static ASKED: AtomicU64 = AtomicU64::new(0);

/// For the runtime's threads, as each goes idle (`on_thread_park`): empties
/// this thread's malloc cache when a trim has asked since it last did. One
/// relaxed load otherwise.
///
/// A thread of a multi-threaded runtime that stays asleep after a burst
/// keeps its cache until it next wakes (at most 7 blocks of each of 64
/// sizes); the thread that drives the timers wakes every second.
pub fn flush_cache_when_asked() {
    thread_local! {
        static SEEN: Cell<u64> = const { Cell::new(0) };
    }
    let asked = ASKED.load(Ordering::Relaxed);
    if SEEN.with(|seen| seen.replace(asked)) != asked {
        flush_thread_cache();
    }
}

/// glibc keeps up to 7 freed blocks of each size up to 1,032 bytes per
/// thread (its tcache), outside the arena: as far as the arena knows they
/// are in use. After a burst, those of a runtime thread are scattered over
/// the pages the burst used, and each keeps its page resident through any
/// `malloc_trim` (at 10,000 closed connections, +43% of the starting RSS
/// stayed where +19% did with the cache off, README). glibc offers no call
/// to empty the cache but the thread's exit; this takes the cached blocks
/// (the first 7 allocations of each of the 64 sizes) and has a thread of
/// its own free them: they fill that thread's cache exactly, and go back
/// to the arena, to merge with their free neighbours and be trimmed, when
/// it ends. This thread's cache is left empty, as it was when it started.
/// (Refilling it with 7 new blocks of each size instead, to make room for
/// the cached ones, kept 236 KB in use and their pages: after 10,000
/// closed connections, +10-12% of the starting RSS where +4% with no
/// cache.) About 450 calls and a thread, once per thread per trim.
fn flush_thread_cache() {
    extern "C" {
        fn malloc(size: usize) -> *mut std::ffi::c_void;
        fn free(ptr: *mut std::ffi::c_void);
    }
    /// glibc's default `glibc.malloc.tcache_count`.
    const CACHED: usize = 7;
    /// Chunks of 32 to 1,040 bytes, by 16: requests of 24 to 1,032.
    const SIZES: usize = 64;
    let size = |class: usize| 24 + 16 * class;
    let free_all = |blocks: &[[usize; CACHED]]| {
        for &block in blocks.iter().flatten() {
            // SAFETY: each block came from malloc below and is freed once
            // (free takes null too).
            unsafe { free(block as *mut std::ffi::c_void) };
        }
    };
    let mut cached = [[0usize; CACHED]; SIZES];
    for (class, blocks) in cached.iter_mut().enumerate() {
        for block in blocks {
            // SAFETY: malloc returns a block of `size` bytes or null, freed
            // below and not otherwise used.
            *block = unsafe { malloc(size(class)) } as usize;
        }
    }
    let freeing = std::thread::Builder::new()
        .name("herdguard-flush".into())
        .spawn(move || free_all(&cached));
    match freeing {
        Ok(thread) => drop(thread.join()),
        Err(_) => {
            // No thread to be had: 7 new blocks of each size fill this
            // thread's cache, and the cached ones, freed after them, go
            // back to the arena.
            let mut fill = [[0usize; CACHED]; SIZES];
            for (class, blocks) in fill.iter_mut().enumerate() {
                for block in blocks {
                    // SAFETY: as above.
                    *block = unsafe { malloc(size(class)) } as usize;
                }
            }
            free_all(&fill);
            free_all(&cached);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" {
        fn malloc(size: usize) -> *mut std::ffi::c_void;
        fn free(ptr: *mut std::ffi::c_void);
    }

    /// Blocks of `size` bytes, taken and freed at once: with glibc's cache on
    /// (the default), they stay in this thread's cache.
    fn cycle(size: usize) -> Vec<usize> {
        // SAFETY: each block is freed once, right after.
        let blocks: Vec<_> = (0..7).map(|_| unsafe { malloc(size) }).collect();
        for &b in blocks.iter().rev() {
            // SAFETY: from malloc above, freed once.
            unsafe { free(b) };
        }
        blocks.into_iter().map(|b| b as usize).collect()
    }

    /// `n` blocks of `size` bytes, taken and not freed.
    fn take(size: usize, n: usize) -> Vec<usize> {
        // SAFETY: malloc returns a block or null; each is freed by `give`.
        (0..n).map(|_| unsafe { malloc(size) } as usize).collect()
    }

    fn give(blocks: &[usize]) {
        for &b in blocks.iter().rev() {
            // SAFETY: from malloc in `take`, freed once.
            unsafe { free(b as *mut std::ffi::c_void) };
        }
    }

    /// Whether this thread's cache of `size` was empty: 7 blocks freed into
    /// it are the 7 handed out next (a cache still full would keep what it
    /// held and send these to the arena).
    fn was_empty(held: &[usize], size: usize) -> bool {
        give(held);
        let next = take(size, held.len());
        give(&next);
        let mut next = next;
        let mut held = held.to_vec();
        next.sort_unstable();
        held.sort_unstable();
        next == held
    }

    #[test]
    fn a_flush_empties_this_threads_cache() {
        let size = 200;
        let held = take(size, 7);
        let first = cycle(size);
        // Without a flush the cache hands the same blocks out again.
        assert_eq!(cycle(size), first, "glibc's cache (tcache) is on");
        flush_thread_cache();
        assert!(
            was_empty(&held, size),
            "cached before the flush: {first:x?}"
        );
    }

    #[test]
    fn a_thread_flushes_once_per_ask() {
        let size = 456;
        let held = take(size, 7);
        cycle(size);
        ASKED.fetch_add(1, Ordering::Relaxed);
        flush_cache_when_asked();
        assert!(was_empty(&held, size));
        // Not asked again: the cache keeps what it holds (the blocks just
        // handed out and freed), and 7 more freed go to the arena.
        let more = take(size, 7);
        let cached = cycle(size);
        flush_cache_when_asked();
        assert_eq!(cycle(size), cached);
        give(&more);
        assert_eq!(cycle(size), cached);
    }
}
