//! How long this process's threads have waited for a CPU: ready to run,
//! not running. The kernel counts it per thread as `run_delay`, the second
//! field of `/proc/self/task/<tid>/schedstat`, and it takes in the time a
//! CPU limit's quota held the threads back. The adaptive limit takes it
//! off the latency it holds against the upstream (`policy::limit`).

use std::io::Read as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::policy::limit::Waits;

/// A reading younger than this is shared: one reading a window for the
/// whole process, however many upstreams' windows close.
const FRESH: Duration = Duration::from_millis(20);

/// Each thread's wait so far, read at most once per [`FRESH`] for the
/// whole process; `None` where the kernel does not say (no `/proc`, or a
/// kernel without schedstat).
pub fn waits() -> Option<Arc<Waits>> {
    static LAST: Mutex<Option<(Instant, Arc<Waits>)>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, waits)) = &*last {
        if at.elapsed() < FRESH {
            return Some(Arc::clone(waits));
        }
    }
    let waits = Arc::new(read()?);
    *last = Some((Instant::now(), Arc::clone(&waits)));
    Some(waits)
}

/// Each thread's wait so far, read now.
fn read() -> Option<Waits> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let mut threads = Vec::new();
    let mut line = [0u8; 128];
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        // A thread that ended since the listing is passed over.
        let Ok(mut file) = std::fs::File::open(task.path().join("schedstat")) else {
            continue;
        };
        let Ok(n) = file.read(&mut line) else {
            continue;
        };
        if let Some(ns) = line.get(..n).and_then(run_delay) {
            threads.push((tid, ns));
        }
    }
    (!threads.is_empty()).then(|| Waits::new(threads))
}

/// The wait in a `schedstat` line: `<on CPU ns> <waited ns> <timeslices>`.
fn run_delay(line: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(line).ok()?;
    let mut fields = text.split_ascii_whitespace();
    fields.next()?;
    fields.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_second_field_is_the_wait() {
        assert_eq!(run_delay(b"959493 1234 7\n"), Some(1234));
        assert_eq!(run_delay(b"959493"), None);
        assert_eq!(run_delay(b""), None);
        assert_eq!(run_delay(b"1 x 2"), None);
        assert_eq!(run_delay(&[0xff, b' ', b'1']), None);
        assert_eq!(run_delay(b"1 18446744073709551616 2"), None);
    }

    /// More threads spinning than there are CPUs: some wait, and the
    /// reading, taken while they are alive, has grown.
    #[test]
    fn the_wait_is_read_from_this_processs_threads() {
        let Some(first) = read() else {
            // Only where the kernel keeps schedstat, as Linux does.
            assert!(!std::path::Path::new("/proc/self/schedstat").exists());
            return;
        };
        let spin = |ms| {
            let until = Instant::now() + Duration::from_millis(ms);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        };
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        std::thread::scope(|s| {
            for _ in 0..cpus * 2 + 1 {
                s.spawn(|| spin(200));
            }
            spin(200);
            let during = read().expect("read while they spin");
            let most = during.most_since(&first);
            assert!(most > Duration::ZERO, "{during:?} after {first:?}");
        });
        // Shared while fresh (twice in a row within 20 ms, at least once
        // in a hundred tries however busy the machine).
        let shared = (0..100).any(|_| match (waits(), waits()) {
            (Some(a), Some(b)) => Arc::ptr_eq(&a, &b),
            _ => false,
        });
        assert!(shared);
    }
}
