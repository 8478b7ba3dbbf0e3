//! Configuration: the only code that reads environment variables. Every `FERROVOD_*` variable
//! has its row in [`VARS`] (name, Horovod alias, default, meaning); the README's table is
//! written from it (`ferrovod._core.env_vars()`), so the two cannot drift apart.

use std::time::Duration;

use crate::error::{Error, Result};

/// One documented environment variable.
#[derive(Debug, Clone, Copy)]
pub struct Var {
    /// The `FERROVOD_*` name (wins when both are set).
    pub name: &'static str,
    /// The Horovod name read as an alias, if any.
    pub alias: Option<&'static str>,
    /// Default, as shown to users.
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
}

/// Every variable the engine reads.
pub const VARS: &[Var] = &[
    Var { name: "FERROVOD_RANK", alias: Some("HOROVOD_RANK"), default: "0", doc: "Global rank (set by ferrovodrun)." },
    Var { name: "FERROVOD_SIZE", alias: Some("HOROVOD_SIZE"), default: "1", doc: "Number of ranks (set by ferrovodrun)." },
    Var { name: "FERROVOD_LOCAL_RANK", alias: Some("HOROVOD_LOCAL_RANK"), default: "from host grouping", doc: "Rank within the host." },
    Var { name: "FERROVOD_LOCAL_SIZE", alias: Some("HOROVOD_LOCAL_SIZE"), default: "from host grouping", doc: "Ranks on this host." },
    Var { name: "FERROVOD_CROSS_RANK", alias: Some("HOROVOD_CROSS_RANK"), default: "from host grouping", doc: "Index of this host among hosts with this local rank." },
    Var { name: "FERROVOD_CROSS_SIZE", alias: Some("HOROVOD_CROSS_SIZE"), default: "from host grouping", doc: "Number of hosts with this local rank." },
    Var { name: "FERROVOD_HOSTNAME", alias: Some("HOROVOD_HOSTNAME"), default: "the host name", doc: "Host identity used to group ranks into hosts." },
    Var { name: "FERROVOD_RENDEZVOUS_ADDR", alias: None, default: "unset", doc: "host:port of the rendezvous store (set by ferrovodrun)." },
    Var { name: "FERROVOD_SECRET", alias: None, default: "unset", doc: "Hex job secret every connection must prove (set by ferrovodrun; never put it on a command line)." },
    Var { name: "FERROVOD_FUSION_THRESHOLD", alias: Some("HOROVOD_FUSION_THRESHOLD"), default: "134217728", doc: "Bytes of allreduce tensors fused into one collective; 0 disables fusion." },
    Var { name: "FERROVOD_CYCLE_TIME", alias: Some("HOROVOD_CYCLE_TIME"), default: "0", doc: "Milliseconds the coordinator may wait after a tensor is ready to gather more for fusion. 0: respond at once (fusing whatever is ready together)." },
    Var { name: "FERROVOD_CACHE_CAPACITY", alias: Some("HOROVOD_CACHE_CAPACITY"), default: "1024", doc: "Response-cache entries per process set (names seen before travel as small ids); 0 disables it." },
    Var { name: "FERROVOD_TIMEOUT_SECONDS", alias: Some("HOROVOD_GLOO_TIMEOUT_SECONDS"), default: "30", doc: "A peer that makes no progress in a collective for this long is an error (a dead peer is detected at once)." },
    Var { name: "FERROVOD_START_TIMEOUT", alias: Some("HOROVOD_START_TIMEOUT"), default: "60", doc: "Seconds init() waits for every rank to rendezvous." },
    Var { name: "FERROVOD_DYNAMIC_PROCESS_SETS", alias: Some("HOROVOD_DYNAMIC_PROCESS_SETS"), default: "0", doc: "Allow add_process_set/remove_process_set after init()." },
    Var { name: "FERROVOD_SPIN_US", alias: None, default: "0", doc: "Microseconds a waiting thread polls before it blocks. 0 by default: with as many ranks as cores, spinning steals the core the peer needs (measured: 4-byte allreduce on 2 ranks 197 us without spin, 1029 us with 50 us)." },
    Var { name: "FERROVOD_SMALL_ALLREDUCE_BYTES", alias: None, default: "65536", doc: "Allreduce payloads up to this size use the latency-optimal algorithm." },
    Var { name: "FERROVOD_CHUNK_BYTES", alias: None, default: "1048576", doc: "Pipelining chunk of the bandwidth-optimal algorithms." },
    Var { name: "FERROVOD_LOG_LEVEL", alias: Some("HOROVOD_LOG_LEVEL"), default: "warning", doc: "trace, debug, info, warning, error or fatal (case-insensitive; anything else means warning). Records go to Python's `logging` under the `ferrovod` logger, with the rank in every line." },
    Var { name: "FERROVOD_LOG_HIDE_TIME", alias: Some("HOROVOD_LOG_HIDE_TIME"), default: "0", doc: "Leave the timestamp out of ferrovod's log lines." },
    Var { name: "FERROVOD_TIMELINE", alias: Some("HOROVOD_TIMELINE"), default: "unset", doc: "Rank 0 writes a Chrome-trace timeline of every tensor to this file (open it in Perfetto or chrome://tracing). `DYNAMIC` (or unset): none until start_timeline()." },
    Var { name: "FERROVOD_TIMELINE_MARK_CYCLES", alias: Some("HOROVOD_TIMELINE_MARK_CYCLES"), default: "0", doc: "Add an instant CYCLE_START mark each time the engine receives work." },
    Var { name: "FERROVOD_STALL_CHECK_DISABLE", alias: Some("HOROVOD_STALL_CHECK_DISABLE"), default: "0", doc: "Turn the stall inspector off." },
    Var { name: "FERROVOD_STALL_CHECK_TIME_SECONDS", alias: Some("HOROVOD_STALL_CHECK_TIME_SECONDS"), default: "60", doc: "Rank 0 warns, naming each tensor and the ranks that have not submitted it, when some ranks have waited this long." },
    Var { name: "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", alias: Some("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), default: "0", doc: "If above the check time: a tensor stalled this long fails on every rank (FerrovodTimeoutError). 0: never." },
];

/// Where this rank sits in the job, as given by a launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchInfo {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// (local_rank, local_size, cross_rank, cross_size) when the launcher set them.
    pub local: Option<(usize, usize, usize, usize)>,
    /// host:port of the rendezvous store; `None` only for a job of size 1.
    pub rendezvous_addr: Option<String>,
    /// Job secret (decoded).
    pub secret: Option<Vec<u8>>,
}

/// Every setting, parsed once.
#[derive(Debug, Clone)]
pub struct Config {
    /// Launch environment.
    pub launch: LaunchInfo,
    /// Host identity.
    pub hostname: String,
    /// Fusion buffer limit in bytes.
    pub fusion_threshold: usize,
    /// Coordinator batching window.
    pub cycle_time: Duration,
    /// Response cache capacity per process set.
    pub cache_capacity: usize,
    /// Progress timeout for collectives.
    pub timeout: Duration,
    /// Rendezvous timeout.
    pub start_timeout: Duration,
    /// Whether process sets may be added after start-up.
    pub dynamic_process_sets: bool,
    /// Spin before blocking.
    pub spin: Duration,
    /// Algorithm thresholds.
    pub tuning: crate::comm::Tuning,
    /// Log level name: trace, debug, info, warning, error or fatal.
    pub log_level: String,
    /// Leave timestamps out of log lines.
    pub log_hide_time: bool,
    /// Timeline file written by rank 0 from the start (`None`: none, or `DYNAMIC`).
    pub timeline: Option<String>,
    /// Cycle marks in the timeline.
    pub timeline_mark_cycles: bool,
    /// When the stall inspector warns; `None` when it is disabled.
    pub stall_check: Option<Duration>,
    /// When a stalled tensor becomes an error on every rank; `None`: never.
    pub stall_shutdown: Option<Duration>,
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads settings through `get` (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let lookup = |name: &str| -> Option<(String, String)> {
            let var = VARS.iter().find(|v| v.name == name);
            if let Some(v) = get(name).filter(|s| !s.trim().is_empty()) {
                return Some((name.to_string(), v.trim().to_string()));
            }
            let alias = var.and_then(|v| v.alias)?;
            get(alias)
                .filter(|s| !s.trim().is_empty())
                .map(|v| (alias.to_string(), v.trim().to_string()))
        };
        let num = |name: &str| -> Result<Option<f64>> {
            match lookup(name) {
                None => Ok(None),
                Some((key, v)) => match v.parse::<f64>() {
                    Ok(x) if x >= 0.0 && x.is_finite() => Ok(Some(x)),
                    _ => Err(Error::InvalidArgument(format!(
                        "{key}={v:?} is not a non-negative number"
                    ))),
                },
            }
        };
        let int = |name: &str| -> Result<Option<usize>> {
            match lookup(name) {
                None => Ok(None),
                Some((key, v)) => v.parse::<usize>().map(Some).map_err(|_| {
                    Error::InvalidArgument(format!("{key}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let flag = |name: &str| -> bool {
            lookup(name)
                .map(|(_, v)| {
                    v.parse::<i64>()
                        .map(|x| x > 0)
                        .unwrap_or(v == "true" || v == "True")
                })
                .unwrap_or(false)
        };

        let rank = int("FERROVOD_RANK")?;
        let size = int("FERROVOD_SIZE")?;
        let launch = match (rank, size) {
            (None, None) => LaunchInfo {
                rank: 0,
                size: 1,
                local: None,
                rendezvous_addr: None,
                secret: None,
            },
            (Some(rank), Some(size)) => {
                if size == 0 || rank >= size {
                    return Err(Error::InvalidArgument(format!(
                        "FERROVOD_RANK={rank} is not below FERROVOD_SIZE={size}"
                    )));
                }
                let local = match (
                    int("FERROVOD_LOCAL_RANK")?,
                    int("FERROVOD_LOCAL_SIZE")?,
                    int("FERROVOD_CROSS_RANK")?,
                    int("FERROVOD_CROSS_SIZE")?,
                ) {
                    (Some(a), Some(b), Some(c), Some(d)) => Some((a, b, c, d)),
                    _ => None,
                };
                let rendezvous_addr = lookup("FERROVOD_RENDEZVOUS_ADDR").map(|(_, v)| v);
                if size > 1 && rendezvous_addr.is_none() {
                    return Err(Error::InvalidArgument(format!(
                        "FERROVOD_SIZE={size} but FERROVOD_RENDEZVOUS_ADDR is not set: \
                         start the job with ferrovodrun"
                    )));
                }
                let secret = match lookup("FERROVOD_SECRET") {
                    None => None,
                    Some((_, hex)) => Some(decode_hex(&hex).ok_or_else(|| {
                        Error::InvalidArgument("FERROVOD_SECRET is not valid hex".into())
                    })?),
                };
                LaunchInfo {
                    rank,
                    size,
                    local,
                    rendezvous_addr,
                    secret,
                }
            }
            (Some(_), None) => {
                return Err(Error::InvalidArgument(
                    "FERROVOD_RANK (or HOROVOD_RANK) is set but FERROVOD_SIZE is missing".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::InvalidArgument(
                    "FERROVOD_SIZE (or HOROVOD_SIZE) is set but FERROVOD_RANK is missing".into(),
                ))
            }
        };
        let hostname = lookup("FERROVOD_HOSTNAME")
            .map(|(_, v)| v)
            .unwrap_or_else(system_hostname);
        let tuning = crate::comm::Tuning {
            small_allreduce_bytes: int("FERROVOD_SMALL_ALLREDUCE_BYTES")?.unwrap_or(64 * 1024),
            chunk_bytes: int("FERROVOD_CHUNK_BYTES")?.unwrap_or(1 << 20).max(64),
        };
        let stall_check = (!flag("FERROVOD_STALL_CHECK_DISABLE")).then(|| {
            Duration::from_secs_f64(
                num("FERROVOD_STALL_CHECK_TIME_SECONDS")
                    .ok()
                    .flatten()
                    .unwrap_or(60.0)
                    .max(0.001),
            )
        });
        // As in Horovod: a shutdown time not above the warning time is ignored.
        let stall_shutdown = match (num("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS")?, stall_check) {
            (Some(t), Some(check)) if Duration::from_secs_f64(t) > check => {
                Some(Duration::from_secs_f64(t))
            }
            _ => None,
        };
        Ok(Config {
            launch,
            hostname,
            fusion_threshold: int("FERROVOD_FUSION_THRESHOLD")?.unwrap_or(128 << 20),
            cycle_time: Duration::from_secs_f64(num("FERROVOD_CYCLE_TIME")?.unwrap_or(0.0) / 1e3),
            cache_capacity: int("FERROVOD_CACHE_CAPACITY")?.unwrap_or(1024),
            timeout: Duration::from_secs_f64(
                num("FERROVOD_TIMEOUT_SECONDS")?.unwrap_or(30.0).max(0.001),
            ),
            start_timeout: Duration::from_secs_f64(
                num("FERROVOD_START_TIMEOUT")?.unwrap_or(60.0).max(0.001),
            ),
            dynamic_process_sets: flag("FERROVOD_DYNAMIC_PROCESS_SETS"),
            spin: Duration::from_micros(int("FERROVOD_SPIN_US")?.unwrap_or(0) as u64),
            tuning,
            log_level: lookup("FERROVOD_LOG_LEVEL")
                .map(|(_, v)| v.to_ascii_lowercase())
                .filter(|v| LOG_LEVELS.contains(&v.as_str()))
                .unwrap_or_else(|| "warning".into()),
            log_hide_time: flag("FERROVOD_LOG_HIDE_TIME"),
            timeline: lookup("FERROVOD_TIMELINE")
                .map(|(_, v)| v)
                .filter(|v| !v.eq_ignore_ascii_case("dynamic")),
            timeline_mark_cycles: flag("FERROVOD_TIMELINE_MARK_CYCLES"),
            stall_check,
            stall_shutdown,
        })
    }
}

/// Accepted values of `FERROVOD_LOG_LEVEL`.
pub const LOG_LEVELS: [&str; 6] = ["trace", "debug", "info", "warning", "error", "fatal"];

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn system_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_are_a_single_process() {
        let c = cfg(&[]).unwrap();
        assert_eq!((c.launch.rank, c.launch.size), (0, 1));
        assert_eq!(c.fusion_threshold, 128 << 20);
        assert_eq!(c.timeout, Duration::from_secs(30));
    }

    #[test]
    fn ferrovod_name_wins_over_horovod_alias() {
        let c = cfg(&[
            ("HOROVOD_FUSION_THRESHOLD", "1000"),
            ("FERROVOD_FUSION_THRESHOLD", "2000"),
            ("HOROVOD_CYCLE_TIME", "2.5"),
        ])
        .unwrap();
        assert_eq!(c.fusion_threshold, 2000);
        assert_eq!(c.cycle_time, Duration::from_micros(2500));
    }

    #[test]
    fn half_set_environment_is_a_clear_error() {
        let e = cfg(&[("FERROVOD_RANK", "1")]).unwrap_err().to_string();
        assert!(e.contains("FERROVOD_SIZE is missing"), "{e}");
        let e = cfg(&[("FERROVOD_RANK", "2"), ("FERROVOD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not below"), "{e}");
        let e = cfg(&[("FERROVOD_FUSION_THRESHOLD", "lots")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("FERROVOD_FUSION_THRESHOLD"), "{e}");
    }

    #[test]
    fn stall_and_log_settings() {
        let c = cfg(&[
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "2"),
            ("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", "5"),
            ("FERROVOD_LOG_LEVEL", "DEBUG"),
        ])
        .unwrap();
        assert_eq!(c.stall_check, Some(Duration::from_secs(2)));
        assert_eq!(c.stall_shutdown, Some(Duration::from_secs(5)));
        assert_eq!(c.log_level, "debug");
        let c = cfg(&[
            ("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", "5"),
            ("FERROVOD_LOG_LEVEL", "chatty"),
        ])
        .unwrap();
        assert_eq!(
            c.stall_shutdown, None,
            "below the 60 s warning time: ignored"
        );
        assert_eq!(c.log_level, "warning");
        let c = cfg(&[("FERROVOD_STALL_CHECK_DISABLE", "1")]).unwrap();
        assert_eq!(c.stall_check, None);
    }

    #[test]
    fn secret_is_decoded() {
        let c = cfg(&[
            ("FERROVOD_RANK", "0"),
            ("FERROVOD_SIZE", "2"),
            ("FERROVOD_RENDEZVOUS_ADDR", "127.0.0.1:5"),
            ("FERROVOD_SECRET", "00ff10"),
        ])
        .unwrap();
        assert_eq!(c.launch.secret.as_deref(), Some(&[0u8, 255, 16][..]));
    }
}
