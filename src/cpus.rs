//! How much CPU this rank has to itself: the CPUs it may run on (its affinity), the ranks of
//! its host that may run on the same ones, and the host's CPU quota (a Kubernetes CPU limit is
//! a cgroup `cpu.max`). Below one core per rank the ranks are oversubscribed, and a waiting rank
//! that spins takes the core from the very rank it waits for ([`crate::spin`] then yields at
//! once instead).
//!
//! Read from `/proc` and `/sys` only: nothing here needs a system call of its own.

use std::fs;

/// The CPUs this process may run on, from `/proc/self/status` (its `Cpus_allowed_list`,
/// `0-3,8-11`), or every online CPU where that cannot be read.
pub fn allowed() -> Vec<usize> {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(|l| parse_list(l.trim()))
        })
        .unwrap_or_else(|| {
            (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
        })
}

/// `cpus` as Linux lists them (`0-3,8-11`).
pub fn format_list(cpus: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &c in cpus {
        match runs.last_mut() {
            Some((_, hi)) if *hi + 1 == c => *hi = c,
            _ => runs.push((c, c)),
        }
    }
    runs.iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Parses a Linux CPU list (`0-3,8-11`); `None` when it is not one. Sorted, without repeats.
pub fn parse_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
            None => {
                let c: usize = part.parse().ok()?;
                (c, c)
            }
        };
        if b < a || b - a > 1 << 16 {
            return None;
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    (!out.is_empty()).then_some(out)
}

/// The CPU quota of this process's cgroup and its ancestors, in CPUs (`cpu.max` of cgroup v2,
/// `cpu.cfs_quota_us / cpu.cfs_period_us` of v1); `None` when there is none.
pub fn quota() -> Option<f64> {
    let cgroups = fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<f64> = None;
    let mut take = |q: Option<f64>| {
        if let Some(q) = q {
            best = Some(best.map_or(q, |b| b.min(q)));
        }
    };
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next(), parts.next());
        let (Some(controllers), Some(path)) = (controllers, path) else {
            continue;
        };
        if controllers.is_empty() {
            for dir in ancestors("/sys/fs/cgroup", path) {
                take(
                    fs::read_to_string(format!("{dir}/cpu.max"))
                        .ok()
                        .and_then(|s| parse_v2(&s)),
                );
            }
        } else if controllers.split(',').any(|c| c == "cpu") {
            for mount in ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"] {
                for dir in ancestors(mount, path) {
                    let q = fs::read_to_string(format!("{dir}/cpu.cfs_quota_us")).ok();
                    let p = fs::read_to_string(format!("{dir}/cpu.cfs_period_us")).ok();
                    take(q.zip(p).and_then(|(q, p)| parse_v1(&q, &p)));
                }
            }
        }
    }
    best
}

/// `mount` joined with `path` and each of its parents, down to `mount` itself (inside a
/// container the process's cgroup is usually the mount's root).
fn ancestors(mount: &str, path: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut p = path.trim_end_matches('/').to_string();
    loop {
        out.push(format!("{mount}{p}"));
        match p.rfind('/') {
            Some(i) => p.truncate(i),
            None => break,
        }
    }
    out
}

/// `cpu.max`: `"max 100000"` (none) or `"150000 100000"` (1.5 CPUs).
fn parse_v2(s: &str) -> Option<f64> {
    let mut it = s.split_whitespace();
    let quota: f64 = it.next()?.parse().ok()?;
    let period: f64 = it.next()?.parse().ok()?;
    (quota > 0.0 && period > 0.0).then(|| quota / period)
}

/// v1: a quota of -1 is none.
fn parse_v1(quota: &str, period: &str) -> Option<f64> {
    let quota: f64 = quota.trim().parse().ok()?;
    let period: f64 = period.trim().parse().ok()?;
    (quota > 0.0 && period > 0.0).then(|| quota / period)
}

/// The CPUs rank `me` has to itself: each CPU it may run on counts for 1 over the number of
/// its host's ranks that may run on it (`host_cpus[i]`: each rank's CPUs on this host, `me`'s
/// among them), and the host's `quota` is split evenly between those ranks.
pub fn share(me: usize, host_cpus: &[Vec<usize>], quota: Option<f64>) -> f64 {
    let mut ranks_on: std::collections::HashMap<usize, usize> = Default::default();
    for &c in host_cpus.iter().flatten() {
        *ranks_on.entry(c).or_default() += 1;
    }
    let by_cpus: f64 = host_cpus[me].iter().map(|c| 1.0 / ranks_on[c] as f64).sum();
    match quota {
        Some(q) => by_cpus.min(q / host_cpus.len() as f64),
        None => by_cpus,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_print() {
        assert_eq!(parse_list("0-3,8-9, 5"), Some(vec![0, 1, 2, 3, 5, 8, 9]));
        assert_eq!(parse_list("7"), Some(vec![7]));
        assert_eq!(parse_list(""), None);
        assert_eq!(parse_list("3-1"), None);
        assert_eq!(parse_list("a"), None);
        assert_eq!(format_list(&[0, 1, 2, 3, 5, 8, 9]), "0-3,5,8-9");
        assert_eq!(parse_list(&format_list(&allowed())), Some(allowed()));
    }

    #[test]
    fn quotas_parse() {
        assert_eq!(parse_v2("max 100000\n"), None);
        assert_eq!(parse_v2("150000 100000\n"), Some(1.5));
        assert_eq!(parse_v1("-1\n", "100000\n"), None);
        assert_eq!(parse_v1("50000", "100000"), Some(0.5));
        assert_eq!(
            ancestors("/sys/fs/cgroup", "/a/b"),
            ["/sys/fs/cgroup/a/b", "/sys/fs/cgroup/a", "/sys/fs/cgroup"]
        );
        assert_eq!(ancestors("/sys/fs/cgroup", "/"), ["/sys/fs/cgroup"]);
    }

    #[test]
    fn shares_count_the_ranks_on_each_cpu() {
        let all = vec![0, 1];
        // Four unbound ranks on two CPUs: half a CPU each.
        assert_eq!(share(0, &vec![all.clone(); 4], None), 0.5);
        // Two ranks each bound to a CPU of its own: one each.
        assert_eq!(share(1, &[vec![0], vec![1]], None), 1.0);
        // Bound round-robin, three ranks on two CPUs: the one alone on its CPU has it whole.
        let rr = [vec![0], vec![1], vec![0]];
        assert_eq!((share(0, &rr, None), share(1, &rr, None)), (0.5, 1.0));
        // Eight CPUs under a quota of two, four ranks: the quota decides.
        assert_eq!(share(0, &vec![(0..8).collect(); 4], Some(2.0)), 0.5);
    }
}
