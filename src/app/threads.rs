//! How many threads serve requests when `--threads` is not given.
//!
//! Cores given to the process (a CPU limit, which is a cgroup quota, or a
//! CPU set narrower than the machine) get a thread each. Without either,
//! the process shares the machine's cores with whatever sends it requests
//! and answers them (a sidecar's app, a dev machine's client and server),
//! and takes one thread per two cores: on two shared cores, with wrk and
//! the upstream on the same two, one thread served 44,900-47,000 requests
//! a second and two 41,000-43,200 (p99 2.3-2.7 ms against 3.0-4.2 ms, 21-24
//! µs of CPU a request against 23-24; docs/benchmarks.md): a second thread
//! mostly woke to find less work than the first would have done.

/// The threads for a process that may use `given` cores (its affinity and
/// quota, as `std::thread::available_parallelism` counts them), whose
/// affinity allows `affinity` of the machine's `online` cores.
pub fn default_threads(given: usize, affinity: usize, online: usize) -> usize {
    let limited = given < affinity || affinity < online;
    match limited {
        true => given.max(1),
        false => (given / 2).max(1),
    }
}

/// [`default_threads`] for this process. Where the machine's cores cannot
/// be counted, a thread per core it may use.
pub fn for_this_process() -> usize {
    let given = std::thread::available_parallelism().map_or(1, |n| n.get());
    let affinity = rustix::thread::sched_getaffinity(None)
        .ok()
        .map(|set| set.count() as usize);
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|list| count_cpu_list(&list));
    match (affinity, online) {
        (Some(affinity), Some(online)) => default_threads(given, affinity, online),
        _ => given,
    }
}

/// The CPUs in a kernel CPU list (`0-3,6,8-9`); `None` if it does not parse.
fn count_cpu_list(list: &str) -> Option<usize> {
    let mut count = 0usize;
    for part in list.trim().split(',') {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let one = part.parse::<usize>().ok()?;
                (one, one)
            }
        };
        count = count.checked_add(last.checked_sub(first)?.checked_add(1)?)?;
    }
    (count > 0).then_some(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_cores_get_a_thread_each_and_shared_ones_one_per_two() {
        // The whole machine, shared: one per two cores.
        assert_eq!(default_threads(2, 2, 2), 1);
        assert_eq!(default_threads(8, 8, 8), 4);
        assert_eq!(default_threads(1, 1, 1), 1);
        // A CPU limit of 3 on an 8-core machine: 3.
        assert_eq!(default_threads(3, 8, 8), 3);
        // Pinned to two of eight cores: 2.
        assert_eq!(default_threads(2, 2, 8), 2);
        // Pinned to one: 1.
        assert_eq!(default_threads(1, 1, 2), 1);
    }

    #[test]
    fn cpu_lists_are_counted_as_the_kernel_writes_them() {
        assert_eq!(count_cpu_list("0-1\n"), Some(2));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0-3,6,8-9"), Some(7));
        for bad in ["", "x", "3-1", "0-", "1,,2"] {
            assert_eq!(count_cpu_list(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn this_process_gets_at_least_one_and_no_more_than_it_may_use() {
        let given = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = for_this_process();
        assert!((1..=given).contains(&threads), "{threads} of {given}");
    }
}
