//! How long this process's threads have waited for a CPU: ready to run,
//! not running. The kernel counts it per thread as `run_delay`, the second
//! field of `/proc/self/task/<tid>/schedstat`, and it takes in the time a
//! CPU limit's quota held the threads back. The adaptive limit takes it
//! off the latency it holds against the upstream (`policy::limit`).

use std::io::Read as _;
use std::time::Duration;

/// The wait of the process's threads alive now, added up; `None` where the
/// kernel does not say (no `/proc`, or a kernel without schedstat).
pub fn waited() -> Option<Duration> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let mut total: Option<u64> = None;
    let mut line = [0u8; 128];
    for task in tasks.flatten() {
        // A thread that ended since the listing is passed over.
        let Ok(mut file) = std::fs::File::open(task.path().join("schedstat")) else {
            continue;
        };
        let Ok(n) = file.read(&mut line) else {
            continue;
        };
        if let Some(ns) = line.get(..n).and_then(run_delay) {
            total = Some(total.unwrap_or(0).saturating_add(ns));
        }
    }
    total.map(Duration::from_nanos)
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
        let Some(first) = waited() else {
            // Only where the kernel keeps schedstat, as Linux does.
            assert!(!std::path::Path::new("/proc/self/schedstat").exists());
            return;
        };
        let spin = |ms| {
            let until = std::time::Instant::now() + Duration::from_millis(ms);
            while std::time::Instant::now() < until {
                std::hint::spin_loop();
            }
        };
        // More spinning threads than CPUs: some wait.
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        std::thread::scope(|s| {
            for _ in 0..cpus * 2 + 1 {
                s.spawn(|| spin(200));
            }
            spin(200);
            let during = waited().expect("read while they spin");
            assert!(during > first, "{during:?} after {first:?}");
        });
    }
}
