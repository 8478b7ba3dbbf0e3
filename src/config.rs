//! Configuration: the only code that reads environment variables. Every `FERROVOD_*` variable
//! has its row in [`VARS`] (name, Horovod alias, default, meaning); the README's table is
//! written from it (`ferrovod._core.env_vars()`), so the two cannot drift apart.

use std::time::Duration;

use serde_json::Value as Json;

use crate::comm::Hierarchical;
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
    Var { name: "FERROVOD_RENDEZVOUS_ADDR", alias: None, default: "unset", doc: "host:port of the rendezvous store (set by ferrovodrun), an IPv6 host best in brackets (`[fd00::1]:29500`). Anything else is refused at once." },
    Var { name: "FERROVOD_IFACE", alias: Some("HOROVOD_GLOO_IFACE"), default: "unset", doc: "Network interface (e.g. `eth0`) whose IPv4 address the engine's listeners bind to, so that other ranks connect through it (the rendezvous store rank 0 hosts still listens on every interface). Unset: the address of the route to the rendezvous store." },
    Var { name: "FERROVOD_SECRET", alias: None, default: "unset", doc: "Hex job secret every connection must prove (set by ferrovodrun; never put it on a command line)." },
    Var { name: "FERROVOD_FUSION_THRESHOLD", alias: Some("HOROVOD_FUSION_THRESHOLD"), default: "134217728", doc: "Bytes of allreduce tensors fused into one collective; 0 disables fusion." },
    Var { name: "FERROVOD_CYCLE_TIME", alias: Some("HOROVOD_CYCLE_TIME"), default: "0", doc: "Milliseconds the coordinator may wait after a tensor is ready to gather more for fusion. 0: respond at once (fusing whatever is ready together)." },
    Var { name: "FERROVOD_CACHE_CAPACITY", alias: Some("HOROVOD_CACHE_CAPACITY"), default: "1024", doc: "Response-cache entries per process set (names seen before travel as small ids); 0 disables it." },
    Var { name: "FERROVOD_TIMEOUT_SECONDS", alias: Some("HOROVOD_GLOO_TIMEOUT_SECONDS"), default: "30", doc: "Seconds a peer may make no progress in a collective before the op fails (a dead peer is detected at once). Must be above 0: there is no \"never\"." },
    Var { name: "FERROVOD_START_TIMEOUT", alias: Some("HOROVOD_START_TIMEOUT"), default: "60", doc: "Seconds init() waits for every rank to rendezvous. Must be above 0." },
    Var { name: "FERROVOD_DYNAMIC_PROCESS_SETS", alias: Some("HOROVOD_DYNAMIC_PROCESS_SETS"), default: "0", doc: "Allow add_process_set/remove_process_set after init()." },
    Var { name: "FERROVOD_FAST_PATH_BYTES", alias: None, default: "65536", doc: "Largest blocking allreduce, broadcast, allgather, reducescatter (Sum, Average) or alltoall without splits (bytes, per rank) that takes the fast path when every rank is on one host over shared memory: the ranks agree through shared memory, without the coordinator, and each sums (or copies) the others' inputs itself. An op the ranks do not all offer alike (or any rank with other ops pending) goes the usual way. 0: off. At most 65536. Off while FERROVOD_STALL_SHUTDOWN_TIME_SECONDS is set (a fast op cannot be abandoned by one rank alone)." },
    Var { name: "FERROVOD_OVERLAP", alias: None, default: "auto", doc: "Whether torch's DistributedOptimizer submits gradients' allreduces during backward (1) or all at step() (0: in the order they came in, or, for dense CPU gradients of one dtype, kept in one flat buffer reduced by one in-place allreduce). auto: overlap, unless every rank is on one host, the gradients are on the CPU and local_size x torch threads fill every core (then the allreduces only take cores from the backward pass: on 2 ranks with 2 cores an MLP trained at 0.80-0.86 of its speed without communication, against 0.73-0.80 overlapped). The optimizer's `overlap` argument wins." },
    Var { name: "FERROVOD_SPIN_US", alias: None, default: "250", doc: "Microseconds an idle wait (engine thread, coordinator, a caller driving its own op in synchronize) keeps polling, yielding the core between polls, before it blocks; also how long a caller that drove keeps the background threads asleep. A blocking wake-up costs 40-60 us on a VM. 0: block at once." },
    Var { name: "FERROVOD_NCCL_LIBRARY", alias: None, default: "unset", doc: "Path of the `libnccl.so.2` to use; when set, no other place is searched. Unset: the dynamic linker's search, then the `nvidia-nccl-*` wheel that torch installs." },
    Var { name: "FERROVOD_NCCL_DISPATCH", alias: None, default: "0", doc: "1: CUDA tensors (torch) are reduced by NCCL on the device where the engine can (allreduce, broadcast, even reducescatter; the rest stays staged). 0: every CUDA tensor is staged through host memory, with a one-time warning. Off by default until the device path has run on GPU hardware: it is built and its CPU-side checks are tested, but it has not been executed on a GPU yet. Must be the same on every rank (a host/CUDA disagreement is a mismatch error)." },
    Var { name: "FERROVOD_SHM_DISABLE", alias: None, default: "0", doc: "Ranks on the same host talk over TCP instead of shared memory (memfd segments, which leave nothing behind even after SIGKILL), and ranks on rank 0's host send control messages over its Unix socket instead of shared-memory rings." },
    Var { name: "FERROVOD_SMALL_ALLREDUCE_BYTES", alias: None, default: "65536", doc: "Allreduce payloads up to this size use the latency-optimal algorithm." },
    Var { name: "FERROVOD_HIERARCHICAL_ALLREDUCE", alias: Some("HOROVOD_HIERARCHICAL_ALLREDUCE"), default: "unset (auto)", doc: "Allreduce in a process set that spans hosts, with more than one rank on some host: reduce inside each host (shared memory), allreduce across hosts, spread inside each host, so less crosses the network. Unset or `auto`: for payloads above FERROVOD_SMALL_ALLREDUCE_BYTES; 1: for every payload; 0: never. Sets on one host are not affected. Must be the same on every rank (init() checks, as for FERROVOD_SMALL_ALLREDUCE_BYTES and FERROVOD_CHUNK_BYTES)." },
    Var { name: "FERROVOD_CHUNK_BYTES", alias: None, default: "1048576", doc: "Pipelining chunk of the bandwidth-optimal algorithms." },
    Var { name: "FERROVOD_LOG_LEVEL", alias: Some("HOROVOD_LOG_LEVEL"), default: "warning", doc: "trace, debug, info, warning, error or fatal (case-insensitive; anything else means warning). Records go to Python's `logging` under the `ferrovod` logger, with the rank in every line." },
    Var { name: "FERROVOD_LOG_HIDE_TIME", alias: Some("HOROVOD_LOG_HIDE_TIME"), default: "0", doc: "Leave the timestamp out of ferrovod's log lines." },
    Var { name: "FERROVOD_TIMELINE", alias: Some("HOROVOD_TIMELINE"), default: "unset", doc: "Rank 0 writes a Chrome-trace timeline of every tensor to this file (open it in Perfetto or chrome://tracing). `DYNAMIC` (or unset): none until start_timeline()." },
    Var { name: "FERROVOD_TIMELINE_MARK_CYCLES", alias: Some("HOROVOD_TIMELINE_MARK_CYCLES"), default: "0", doc: "Add an instant CYCLE_START mark each time the engine receives work." },
    Var { name: "FERROVOD_AUTOTUNE", alias: Some("HOROVOD_AUTOTUNE"), default: "0", doc: "Tune the fusion threshold and the cycle time online from measured throughput (those not set explicitly), then keep the best." },
    Var { name: "FERROVOD_AUTOTUNE_LOG", alias: Some("HOROVOD_AUTOTUNE_LOG"), default: "unset", doc: "CSV file of the autotune samples and the settled values." },
    Var { name: "FERROVOD_AUTOTUNE_WARMUP_SAMPLES", alias: Some("HOROVOD_AUTOTUNE_WARMUP_SAMPLES"), default: "3", doc: "Samples discarded before autotune scores." },
    Var { name: "FERROVOD_AUTOTUNE_STEPS_PER_SAMPLE", alias: Some("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"), default: "10", doc: "Training steps per autotune sample." },
    Var { name: "FERROVOD_STALL_CHECK_DISABLE", alias: Some("HOROVOD_STALL_CHECK_DISABLE"), default: "0", doc: "Turn the stall inspector off." },
    Var { name: "FERROVOD_STALL_CHECK_TIME_SECONDS", alias: Some("HOROVOD_STALL_CHECK_TIME_SECONDS"), default: "60", doc: "Rank 0 warns, naming each tensor and the ranks that have not submitted it, when some ranks have waited this long. Must be above 0 (FERROVOD_STALL_CHECK_DISABLE turns the check off)." },
    Var { name: "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", alias: Some("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), default: "0", doc: "A tensor stalled this long fails on every rank (FerrovodTimeoutError). 0: never. Otherwise it must be above the check time, with the stall check on: init() refuses anything else rather than never shut down." },
];

/// Which launcher started this process (DESIGN.md, "Launch and bootstrap", in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `ferrovodrun` (or anything setting `FERROVOD_RANK`/`HOROVOD_RANK`).
    Ferrovodrun,
    /// Open MPI `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// MPICH / Intel MPI Hydra (`PMI_*`, `MPI_LOCALRANKID`).
    Hydra,
    /// Slurm `srun` (`SLURM_PROCID`, inside a job step).
    Slurm,
    /// `torchrun` or a Kubeflow PyTorchJob (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...).
    Torchrun,
    /// A TensorFlow job (Kubeflow TFJob and others): `TF_CONFIG`.
    TfConfig,
    /// No launcher: a single process.
    None,
}

impl Launcher {
    /// How the debug log names it.
    pub fn describe(self) -> &'static str {
        match self {
            Launcher::Ferrovodrun => "ferrovodrun (FERROVOD_* variables)",
            Launcher::OpenMpi => "Open MPI mpirun (OMPI_COMM_WORLD_*)",
            Launcher::Hydra => "MPICH/Intel MPI Hydra (PMI_*)",
            Launcher::Slurm => "Slurm srun (SLURM_*)",
            Launcher::Torchrun => "torchrun / PyTorchJob (RANK, WORLD_SIZE, MASTER_ADDR)",
            Launcher::TfConfig => "TFJob (TF_CONFIG)",
            Launcher::None => "none (a single process)",
        }
    }

    /// A short stable name (what Python's `init()` sees).
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Ferrovodrun => "ferrovodrun",
            Launcher::OpenMpi => "openmpi",
            Launcher::Hydra => "hydra",
            Launcher::Slurm => "slurm",
            Launcher::Torchrun => "torchrun",
            Launcher::TfConfig => "tf_config",
            Launcher::None => "none",
        }
    }
}

/// Where this rank sits in the job, as given by a launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchInfo {
    /// Which launcher.
    pub launcher: Launcher,
    /// Rank 0 runs the rendezvous store itself at `rendezvous_addr` (no ferrovodrun to do it).
    pub rank0_hosts_store: bool,
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
    /// The secret was derived from the launcher's job identity (no launcher of ours handed one
    /// out): it keeps other jobs out, not an attacker who can read this job's environment.
    pub secret_derived: bool,
    /// Under torchrun, the agent's own store (`MASTER_ADDR:MASTER_PORT`) when its workers may
    /// use it (`TORCHELASTIC_USE_AGENT_STORE=True`) and no rendezvous address was given:
    /// Python's `init()` then agrees on a free port for ferrovod's store through it, instead of
    /// assuming `MASTER_PORT`+1 is free. With the key prefix that keeps jobs and restarts apart.
    pub agent_store: Option<(String, String)>,
}

impl LaunchInfo {
    /// Open MPI or Hydra started more than one rank and no rendezvous address was given: the
    /// ranks can only find each other through one exchange over MPI (Python's `init()` does
    /// it with mpi4py and passes the result back in through [`Config::from_env_with`]).
    pub fn needs_mpi_rendezvous(&self) -> bool {
        matches!(self.launcher, Launcher::OpenMpi | Launcher::Hydra)
            && self.size > 1
            && self.rendezvous_addr.is_none()
    }

    /// Fails, saying how to fix it, when a job of several ranks has no rendezvous address.
    pub fn require_rendezvous(&self) -> Result<()> {
        if self.size > 1 && self.rendezvous_addr.is_none() {
            return Err(Error::InvalidArgument(format!(
                "started by {} with {} ranks, but no rendezvous address: set \
                 FERROVOD_RENDEZVOUS_ADDR=<rank 0's host>:<free port> for every rank \
                 (mpirun -x FERROVOD_RENDEZVOUS_ADDR=...), or install mpi4py so that rank 0 \
                 can broadcast one",
                self.launcher.describe(),
                self.size
            )));
        }
        Ok(())
    }
}

/// Every setting, parsed once.
#[derive(Debug, Clone)]
pub struct Config {
    /// Launch environment.
    pub launch: LaunchInfo,
    /// Host identity.
    pub hostname: String,
    /// Interface whose IPv4 address the listeners bind to (`FERROVOD_IFACE`).
    pub iface: Option<String>,
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
    /// Keep ranks on the same host on TCP instead of shared memory.
    pub shm_disable: bool,
    /// Largest blocking allreduce, broadcast or allgather part the fast path takes (0: off);
    /// see `engine::fast`.
    pub fast_path_bytes: usize,
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
    /// Online tuning of the fusion threshold and cycle time, when enabled.
    pub autotune: Option<crate::engine::autotune::AutotuneConfig>,
    /// When the stall inspector warns; `None` when it is disabled.
    pub stall_check: Option<Duration>,
    /// When a stalled tensor becomes an error on every rank; `None`: never.
    pub stall_shutdown: Option<Duration>,
}

/// `FERROVOD_NCCL_LIBRARY`, when set: read apart from [`Config`] because the library is looked
/// for before (and without) `init()`, e.g. by `ferrovodrun --check-build`.
pub fn nccl_library() -> Option<String> {
    std::env::var("FERROVOD_NCCL_LIBRARY")
        .ok()
        .filter(|s| !s.trim().is_empty())
}

/// `FERROVOD_NCCL_DISPATCH`: read apart from [`Config`], like [`nccl_library`], because the
/// torch adapter asks before (and without) the engine.
pub fn nccl_dispatch() -> bool {
    // The same reading as every other flag: a positive integer, or true.
    std::env::var("FERROVOD_NCCL_DISPATCH").is_ok_and(|v| {
        let v = v.trim();
        v.parse::<i64>()
            .map(|x| x > 0)
            .unwrap_or(v == "true" || v == "True")
    })
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the process environment, with the rendezvous address and the job secret replaced
    /// where given: rank 0 handed them out over MPI, and they are passed in rather than put
    /// into the environment, which child processes would inherit.
    pub fn from_env_with(rendezvous_addr: Option<&str>, secret: Option<&[u8]>) -> Result<Config> {
        let secret_hex = secret.map(encode_hex);
        Config::from_lookup(|k| match (k, rendezvous_addr, &secret_hex) {
            ("FERROVOD_RENDEZVOUS_ADDR", Some(addr), _) => Some(addr.to_string()),
            ("FERROVOD_SECRET", _, Some(hex)) => Some(hex.clone()),
            _ => std::env::var(k).ok(),
        })
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
        // Seconds that must be above 0 (with what to do instead in `hint`); a value too large
        // for a Duration is refused too rather than panicking.
        let seconds = |name: &str, hint: &str| -> Result<Option<Duration>> {
            match lookup(name) {
                None => Ok(None),
                Some((key, v)) => match v.parse::<f64>().ok().filter(|x| *x > 0.0) {
                    Some(x) => Duration::try_from_secs_f64(x).map(Some).map_err(|_| {
                        Error::InvalidArgument(format!(
                            "{key}={v:?} is too large a number of seconds"
                        ))
                    }),
                    None => Err(Error::InvalidArgument(format!(
                        "{key}={v:?} is not a positive number of seconds{hint}"
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

        let launch = detect_launch(&get, &lookup)?;
        let hostname = lookup("FERROVOD_HOSTNAME")
            .map(|(_, v)| v)
            .unwrap_or_else(system_hostname);
        let hierarchical = match lookup("FERROVOD_HIERARCHICAL_ALLREDUCE") {
            None => Hierarchical::Auto,
            Some((key, v)) => match (v.parse::<i64>(), v.to_ascii_lowercase().as_str()) {
                (Ok(x), _) if x > 0 => Hierarchical::Always,
                (Ok(_), _) | (_, "false") => Hierarchical::Never,
                (_, "true") => Hierarchical::Always,
                (_, "auto") => Hierarchical::Auto,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "{key}={v:?}: expected 1, 0 or auto"
                    )))
                }
            },
        };
        let tuning = crate::comm::Tuning {
            small_allreduce_bytes: int("FERROVOD_SMALL_ALLREDUCE_BYTES")?.unwrap_or(64 * 1024),
            chunk_bytes: int("FERROVOD_CHUNK_BYTES")?.unwrap_or(1 << 20).max(64),
            hierarchical,
        };
        let (stall_check, stall_shutdown) = stall_limits(&lookup, &seconds, flag)?;
        Ok(Config {
            launch,
            hostname,
            iface: lookup("FERROVOD_IFACE").map(|(_, v)| v),
            fusion_threshold: int("FERROVOD_FUSION_THRESHOLD")?.unwrap_or(128 << 20),
            cycle_time: match num("FERROVOD_CYCLE_TIME")? {
                None => Duration::ZERO,
                Some(ms) => Duration::try_from_secs_f64(ms / 1e3).map_err(|_| {
                    let (key, v) = lookup("FERROVOD_CYCLE_TIME").unwrap_or_default();
                    Error::InvalidArgument(format!("{key}={v:?} is too many milliseconds"))
                })?,
            },
            cache_capacity: int("FERROVOD_CACHE_CAPACITY")?.unwrap_or(1024),
            timeout: seconds(
                "FERROVOD_TIMEOUT_SECONDS",
                " (how long a peer may make no progress before the op fails; there is no \"never\")",
            )?
            .unwrap_or(Duration::from_secs(30)),
            start_timeout: seconds("FERROVOD_START_TIMEOUT", "")?
                .unwrap_or(Duration::from_secs(60)),
            dynamic_process_sets: flag("FERROVOD_DYNAMIC_PROCESS_SETS"),
            spin: Duration::from_micros(int("FERROVOD_SPIN_US")?.unwrap_or(250) as u64),
            shm_disable: flag("FERROVOD_SHM_DISABLE"),
            fast_path_bytes: int("FERROVOD_FAST_PATH_BYTES")?
                .unwrap_or(crate::transport::shm::BOARD_DATA_BYTES)
                .min(crate::transport::shm::BOARD_DATA_BYTES),
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
            autotune: if flag("FERROVOD_AUTOTUNE") {
                Some(crate::engine::autotune::AutotuneConfig {
                    tune_fusion: lookup("FERROVOD_FUSION_THRESHOLD").is_none(),
                    tune_cycle: lookup("FERROVOD_CYCLE_TIME").is_none(),
                    warmup_samples: int("FERROVOD_AUTOTUNE_WARMUP_SAMPLES")?.unwrap_or(3),
                    steps_per_sample: int("FERROVOD_AUTOTUNE_STEPS_PER_SAMPLE")?
                        .unwrap_or(10)
                        .max(1),
                    samples_per_candidate: 3,
                    log_path: lookup("FERROVOD_AUTOTUNE_LOG").map(|(_, v)| v),
                })
            } else {
                None
            },
            stall_check,
            stall_shutdown,
        })
    }
}

type Lookup<'a> = dyn Fn(&str) -> Option<(String, String)> + 'a;
type Seconds<'a> = dyn Fn(&str, &str) -> Result<Option<Duration>> + 'a;

/// The stall inspector's (warning, shutdown) times. A shutdown time that could never act (not
/// above the warning time, or with the inspector off) is refused: taken silently, it leaves a
/// stalled job hanging when the user asked for it to end.
fn stall_limits(
    lookup: &Lookup<'_>,
    seconds: &Seconds<'_>,
    flag: impl Fn(&str) -> bool,
) -> Result<(Option<Duration>, Option<Duration>)> {
    let check_time = seconds(
        "FERROVOD_STALL_CHECK_TIME_SECONDS",
        " (FERROVOD_STALL_CHECK_DISABLE=1 turns the stall check off)",
    )?;
    let check = (!flag("FERROVOD_STALL_CHECK_DISABLE"))
        .then(|| check_time.unwrap_or(Duration::from_secs(60)));
    let Some((key, v)) = lookup("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS") else {
        return Ok((check, None));
    };
    let shutdown = match v.parse::<f64>() {
        Ok(0.0) => return Ok((check, None)),
        Ok(x) if x > 0.0 => Duration::try_from_secs_f64(x).ok(),
        _ => None,
    }
    .ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{key}={v:?} is not a number of seconds (0: never shut down)"
        ))
    })?;
    let Some(check) = check else {
        let (dkey, dv) = lookup("FERROVOD_STALL_CHECK_DISABLE").unwrap_or_default();
        return Err(Error::InvalidArgument(format!(
            "{key}={v:?} cannot take effect while {dkey}={dv:?} turns the stall check off: \
             unset one of them"
        )));
    };
    if shutdown <= check {
        let check_source = match lookup("FERROVOD_STALL_CHECK_TIME_SECONDS") {
            Some((ckey, cv)) => format!("{ckey}={cv:?}"),
            None => "60 s (the default of FERROVOD_STALL_CHECK_TIME_SECONDS)".into(),
        };
        return Err(Error::InvalidArgument(format!(
            "{key}={v:?} is not above the stall check time, {check_source}: a stalled tensor \
             would be warned about but never failed. Set it above the check time (or lower \
             the check time), or to 0 to never shut down"
        )));
    }
    Ok((Some(check), Some(shutdown)))
}

/// Checks that `addr` (from `source`, which the error names) is `host:port` with a port from 1
/// to 65535. Whether the host resolves is not checked here: a name may resolve only later (a
/// service still coming up), so connecting retries it.
fn check_rendezvous_addr(source: &str, addr: &str) -> Result<()> {
    let bad = |why: String| {
        Err(Error::InvalidArgument(format!(
            "{source}={addr:?} is not a rendezvous address: {why}; expected host:port, e.g. \
             10.0.0.1:29500, node-0:29500 or [fd00::1]:29500"
        )))
    };
    let Some((host, port)) = addr.rsplit_once(':') else {
        return bad("it has no port".into());
    };
    if host.is_empty() {
        return bad("it has no host".into());
    }
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        // An IPv6 address without brackets ("fd00::1:29500") is read as connecting reads it,
        // the port after the last colon; it has always worked, from torchrun's MASTER_ADDR too.
        None => {
            host.parse::<std::net::Ipv6Addr>().is_ok()
                || host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        }
    };
    if !host_ok {
        return bad(format!("{host:?} is not a host name or IP address"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => bad(format!("port {port:?} is not a number from 1 to 65535")),
    }
}

/// Works out the launch environment (DESIGN.md order: ferrovodrun, MPI launchers, Slurm,
/// torchrun/PyTorchJob, none). A half-set environment is an error naming what is missing.
fn detect_launch(get: &dyn Fn(&str) -> Option<String>, lookup: &Lookup<'_>) -> Result<LaunchInfo> {
    let raw = |name: &str| {
        get(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let int_of = |name: &str, v: Option<String>| -> Result<Option<usize>> {
        v.map(|v| {
            v.parse::<usize>().map_err(|_| {
                Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer"))
            })
        })
        .transpose()
    };
    let pair = |launcher: Launcher,
                rank_var: &str,
                size_var: &str,
                rank: Option<String>,
                size: Option<String>|
     -> Result<Option<(Launcher, usize, usize)>> {
        match (int_of(rank_var, rank)?, int_of(size_var, size)?) {
            (None, None) => Ok(None),
            (Some(r), Some(n)) if n > 0 && r < n => Ok(Some((launcher, r, n))),
            (Some(r), Some(n)) => Err(Error::InvalidArgument(format!(
                "{rank_var}={r} is not below {size_var}={n}"
            ))),
            (Some(_), None) => Err(Error::InvalidArgument(format!(
                "{rank_var} is set but {size_var} is missing ({})",
                launcher.describe()
            ))),
            (None, Some(_)) => Err(Error::InvalidArgument(format!(
                "{size_var} is set but {rank_var} is missing ({})",
                launcher.describe()
            ))),
        }
    };
    let ours = pair(
        Launcher::Ferrovodrun,
        "FERROVOD_RANK",
        "FERROVOD_SIZE",
        lookup("FERROVOD_RANK").map(|(_, v)| v),
        lookup("FERROVOD_SIZE").map(|(_, v)| v),
    )?;
    let mut found = ours;
    if found.is_none() {
        found = pair(
            Launcher::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            raw("OMPI_COMM_WORLD_RANK"),
            raw("OMPI_COMM_WORLD_SIZE"),
        )?;
    }
    if found.is_none() {
        found = pair(
            Launcher::Hydra,
            "PMI_RANK",
            "PMI_SIZE",
            raw("PMI_RANK"),
            raw("PMI_SIZE"),
        )?;
    }
    // SLURM_PROCID outside a job step (e.g. in the batch script) is not a rank.
    if found.is_none() && raw("SLURM_STEP_ID").is_some() && raw("SLURM_PROCID").is_some() {
        found = pair(
            Launcher::Slurm,
            "SLURM_PROCID",
            "SLURM_NTASKS",
            raw("SLURM_PROCID"),
            raw("SLURM_NTASKS").or_else(|| raw("SLURM_NPROCS")),
        )?;
    }
    if found.is_none() {
        found = pair(
            Launcher::Torchrun,
            "RANK",
            "WORLD_SIZE",
            raw("RANK"),
            raw("WORLD_SIZE"),
        )?;
    }
    let mut tf_endpoints = Vec::new();
    if found.is_none() {
        if let Some(tf) = raw("TF_CONFIG")
            .map(|t| parse_tf_config(&t))
            .transpose()?
            .flatten()
        {
            found = Some((Launcher::TfConfig, tf.rank, tf.size));
            tf_endpoints = tf.endpoints;
        }
    }
    let Some((launcher, rank, size)) = found else {
        return Ok(LaunchInfo {
            launcher: Launcher::None,
            rank0_hosts_store: false,
            rank: 0,
            size: 1,
            local: None,
            rendezvous_addr: None,
            secret: None,
            secret_derived: false,
            agent_store: None,
        });
    };
    let secret = match lookup("FERROVOD_SECRET") {
        None => None,
        Some((_, hex)) => Some(
            decode_hex(&hex)
                .ok_or_else(|| Error::InvalidArgument("FERROVOD_SECRET is not valid hex".into()))?,
        ),
    };
    let explicit_addr = lookup("FERROVOD_RENDEZVOUS_ADDR").map(|(_, v)| v);
    if let Some(addr) = &explicit_addr {
        check_rendezvous_addr("FERROVOD_RENDEZVOUS_ADDR", addr)?;
    }
    let agent_store = match (
        launcher,
        &explicit_addr,
        raw("TORCHELASTIC_USE_AGENT_STORE"),
        raw("MASTER_ADDR"),
        raw("MASTER_PORT"),
    ) {
        (Launcher::Torchrun, None, Some(use_it), Some(host), Some(port))
            if size > 1 && use_it.eq_ignore_ascii_case("true") =>
        {
            let key = format!(
                "ferrovod/{}/{}/",
                raw("TORCHELASTIC_RUN_ID").unwrap_or_default(),
                raw("TORCHELASTIC_RESTART_COUNT").unwrap_or_default()
            );
            Some((format!("{host}:{port}"), key))
        }
        _ => None,
    };
    let (local, rendezvous_addr, rank0_hosts_store, job_id) = match launcher {
        Launcher::Ferrovodrun => {
            let int = |n: &str| int_of(n, lookup(n).map(|(_, v)| v));
            let local = match (
                int("FERROVOD_LOCAL_RANK")?,
                int("FERROVOD_LOCAL_SIZE")?,
                int("FERROVOD_CROSS_RANK")?,
                int("FERROVOD_CROSS_SIZE")?,
            ) {
                (Some(a), Some(b), Some(c), Some(d)) => Some((a, b, c, d)),
                _ => None,
            };
            if size > 1 && explicit_addr.is_none() {
                return Err(Error::InvalidArgument(format!(
                    "FERROVOD_SIZE={size} but FERROVOD_RENDEZVOUS_ADDR is not set: start the job \
                     with ferrovodrun"
                )));
            }
            (local, explicit_addr, false, None)
        }
        Launcher::Torchrun => {
            let under_torchrun = raw("TORCHELASTIC_RUN_ID");
            // A PyTorchJob with nprocPerNode > 1 and no torchrun sets RANK to the node rank.
            if under_torchrun.is_none()
                && raw("PET_NPROC_PER_NODE")
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(1)
                    > 1
            {
                return Err(Error::InvalidArgument(
                    "PET_NPROC_PER_NODE > 1 without torchrun: RANK is the node rank here, not the \
                     process rank. Start the script with torchrun (the PyTorchJob command \
                     `torchrun train.py` uses the PET_* settings)."
                        .into(),
                ));
            }
            let addr = match explicit_addr {
                Some(a) => a,
                None => {
                    let host = raw("MASTER_ADDR");
                    let port = int_of("MASTER_PORT", raw("MASTER_PORT"))?;
                    let (Some(host), Some(port)) = (host, port) else {
                        let missing: Vec<&str> = [
                            ("MASTER_ADDR", raw("MASTER_ADDR").is_none()),
                            ("MASTER_PORT", raw("MASTER_PORT").is_none()),
                        ]
                        .iter()
                        .filter(|(_, m)| *m)
                        .map(|(n, _)| *n)
                        .collect();
                        return Err(Error::InvalidArgument(format!(
                            "RANK and WORLD_SIZE are set but {} missing: set MASTER_ADDR and \
                             MASTER_PORT (torchrun and PyTorchJob do), or FERROVOD_RENDEZVOUS_ADDR",
                            missing.join(" and ") + if missing.len() > 1 { " are" } else { " is" }
                        )));
                    };
                    // torchrun's agent already serves its own store on MASTER_PORT.
                    let port = if under_torchrun.is_some() {
                        port + 1
                    } else {
                        port
                    };
                    let addr = format!("{host}:{port}");
                    let source = if under_torchrun.is_some() {
                        "MASTER_ADDR:MASTER_PORT+1 (torchrun's agent has MASTER_PORT)"
                    } else {
                        "MASTER_ADDR:MASTER_PORT"
                    };
                    check_rendezvous_addr(source, &addr)?;
                    addr
                }
            };
            // Local and cross ranks come from grouping the ranks' host names, which agrees with
            // LOCAL_RANK / LOCAL_WORLD_SIZE and also gives cross ranks.
            let job = under_torchrun.or_else(|| {
                raw("MASTER_ADDR")
                    .map(|a| format!("{a}:{}", raw("MASTER_PORT").unwrap_or_default()))
            });
            (None, Some(addr), true, job)
        }
        Launcher::TfConfig => {
            let addr = match explicit_addr {
                Some(a) => Some(a),
                None if size > 1 => Some(tf_endpoints[0].clone()),
                None => None,
            };
            // Every rank sees the same cluster, and its host names carry the job's name.
            let job = Some(tf_endpoints.join(","));
            (None, addr, true, job)
        }
        Launcher::Slurm => {
            let Some(addr) = explicit_addr.or_else(|| slurm_rendezvous(&raw)) else {
                return Err(Error::InvalidArgument(format!(
                    "started by {} with {size} ranks, but no rendezvous address: set \
                     FERROVOD_RENDEZVOUS_ADDR=<rank 0's host>:<free port> for every rank",
                    launcher.describe()
                )));
            };
            let job = raw("SLURM_JOB_ID")
                .map(|j| format!("{j}.{}", raw("SLURM_STEP_ID").unwrap_or_default()));
            (None, Some(addr), true, job)
        }
        Launcher::OpenMpi | Launcher::Hydra => {
            // Without an address, a job of several ranks needs the exchange over MPI
            // (`LaunchInfo::needs_mpi_rendezvous`); the engine refuses to start without one.
            let job = match launcher {
                Launcher::OpenMpi => {
                    raw("OMPI_MCA_ess_base_jobid").or_else(|| raw("PMIX_NAMESPACE"))
                }
                _ => raw("PMI_FD").and(explicit_addr.clone()),
            };
            (None, explicit_addr, true, job)
        }
        Launcher::None => unreachable!("returned above"),
    };
    let (secret, secret_derived) = match secret {
        Some(s) => (Some(s), false),
        None if launcher == Launcher::Ferrovodrun || size == 1 => (None, false),
        None => {
            // No launcher of ours handed out a secret. Derive one every rank of this job can
            // compute and other jobs cannot guess by accident.
            use sha2::Digest;
            let mut h = sha2::Sha256::new();
            h.update(b"ferrovod-derived-secret-v1\0");
            h.update(launcher.describe().as_bytes());
            h.update(rendezvous_addr.as_deref().unwrap_or("").as_bytes());
            h.update(job_id.as_deref().unwrap_or("").as_bytes());
            h.update(size.to_le_bytes());
            (Some(h.finalize().to_vec()), true)
        }
    };
    Ok(LaunchInfo {
        launcher,
        rank0_hosts_store,
        rank,
        size,
        local,
        rendezvous_addr,
        secret,
        secret_derived,
        agent_store,
    })
}

/// Slurm: the first host of the step's node list and a port derived from the job id, so every
/// rank computes the same address with no communication.
fn slurm_rendezvous(raw: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let list = raw("SLURM_STEP_NODELIST").or_else(|| raw("SLURM_JOB_NODELIST"))?;
    let job: u64 = raw("SLURM_JOB_ID")?.parse().ok()?;
    Some(format!(
        "{}:{}",
        first_slurm_host(&list)?,
        20000 + job % 10000
    ))
}

/// The first host of a compressed Slurm node list: `node[007-009,011],gpu1` → `node007`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let first = list.split(',').next()?.trim();
    match first.find('[') {
        None => (!first.is_empty()).then(|| first.to_string()),
        Some(i) => {
            let inner = list[list.find('[')? + 1..].split([',', '-', ']']).next()?;
            Some(format!("{}{inner}", &first[..i]))
        }
    }
}

/// A TensorFlow job's process, from `TF_CONFIG`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TfJob {
    /// Index of this task among the chief (or `master`) tasks, then the worker tasks.
    pub rank: usize,
    /// Number of chief and worker tasks.
    pub size: usize,
    /// Their `host:port` endpoints in rank order; the first one is the rendezvous address.
    pub endpoints: Vec<String>,
}

/// Parses `TF_CONFIG` (Kubeflow TFJob, `tf.distribute`'s cluster resolver). `Ok(None)` when it
/// describes no cluster, which TensorFlow reads as a single local process. Parameter-server and
/// evaluator tasks, and the sparse form `enableDynamicWorker` gives, are errors: ferrovod needs
/// every chief and worker endpoint and runs only those tasks.
pub fn parse_tf_config(text: &str) -> Result<Option<TfJob>> {
    let bad = |msg: String| Error::InvalidArgument(format!("TF_CONFIG: {msg}"));
    let json: Json =
        serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
    if !json.is_object() {
        return Err(bad("not a JSON object".into()));
    }
    let cluster = match json.get("cluster") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Object(m)) if m.is_empty() => return Ok(None),
        Some(c @ Json::Object(_)) => c,
        Some(_) => return Err(bad("\"cluster\" is not an object".into())),
    };
    // The order ranks follow: chief tasks ("master" is the older name), then workers.
    let mut endpoints = Vec::new();
    let mut groups = Vec::new();
    for kind in ["chief", "master", "worker"] {
        let start = endpoints.len();
        match cluster.get(kind) {
            None | Some(Json::Null) => {}
            Some(Json::Array(list)) => {
                for e in list {
                    match e {
                        Json::String(s) if !s.trim().is_empty() => {
                            endpoints.push(s.trim().to_string())
                        }
                        other => {
                            return Err(bad(format!(
                                "cluster.{kind} holds {other:?}, not a \"host:port\" string"
                            )))
                        }
                    }
                }
            }
            Some(Json::Object(_)) => {
                return Err(bad(format!(
                    "cluster.{kind} is a map of task index to endpoint: this is the sparse form \
                     a TFJob with enableDynamicWorker gives, where a worker sees only itself. \
                     ferrovod needs every chief and worker endpoint: turn enableDynamicWorker off"
                )))
            }
            Some(other) => {
                return Err(bad(format!(
                    "cluster.{kind} is {other:?}, not a list of \"host:port\" strings"
                )))
            }
        }
        groups.push((kind, start, endpoints.len() - start));
    }
    let task = json
        .get("task")
        .ok_or_else(|| bad("there is a cluster but no \"task\" saying which one this is".into()))?;
    let kind = match task.get("type") {
        Some(Json::String(t)) => t.to_ascii_lowercase(),
        _ => return Err(bad("\"task\" has no \"type\" string".into())),
    };
    let index = match task.get("index") {
        None | Some(Json::Null) => 0,
        Some(Json::Number(x)) if x.as_u64().is_some_and(|i| i < 1 << 30) => {
            x.as_u64().unwrap_or(0) as usize
        }
        Some(Json::String(s)) if s.trim().parse::<usize>().is_ok() => s.trim().parse().unwrap_or(0),
        Some(other) => {
            return Err(bad(format!(
                "task index {other:?} is not a non-negative integer"
            )))
        }
    };
    let Some(&(_, start, count)) = groups.iter().find(|(k, _, _)| *k == kind) else {
        return Err(bad(format!(
            "this process is a {kind:?} task; ferrovod runs chief and worker tasks only (start \
             parameter-server and evaluator tasks without ferrovod.init())"
        )));
    };
    if index >= count {
        return Err(bad(format!(
            "task {kind} index {index} is out of range: cluster.{kind} has {count} entries"
        )));
    }
    // Rank 0 serves the rendezvous store on its own endpoint's port.
    let first = &endpoints[0];
    if first
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .is_none()
    {
        return Err(bad(format!("endpoint {first:?} is not \"host:port\"")));
    }
    Ok(Some(TfJob {
        rank: start + index,
        size: endpoints.len(),
        endpoints,
    }))
}

/// Accepted values of `FERROVOD_LOG_LEVEL`.
pub const LOG_LEVELS: [&str; 6] = ["trace", "debug", "info", "warning", "error", "fatal"];

fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

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
    fn hierarchical_allreduce_and_its_horovod_alias() {
        let mode = |pairs: &[(&str, &str)]| cfg(pairs).map(|c| c.tuning.hierarchical);
        assert_eq!(mode(&[]).unwrap(), Hierarchical::Auto);
        let h = "HOROVOD_HIERARCHICAL_ALLREDUCE";
        let f = "FERROVOD_HIERARCHICAL_ALLREDUCE";
        assert_eq!(mode(&[(h, "1")]).unwrap(), Hierarchical::Always);
        assert_eq!(mode(&[(h, "1"), (f, "0")]).unwrap(), Hierarchical::Never);
        assert_eq!(mode(&[(f, "true")]).unwrap(), Hierarchical::Always);
        assert_eq!(mode(&[(f, "False")]).unwrap(), Hierarchical::Never);
        assert_eq!(mode(&[(f, " AUTO ")]).unwrap(), Hierarchical::Auto);
        let e = mode(&[(h, "sometimes")]).unwrap_err().to_string();
        assert!(e.contains("HOROVOD_HIERARCHICAL_ALLREDUCE"), "{e}");
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
            ("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0"),
            ("FERROVOD_LOG_LEVEL", "chatty"),
        ])
        .unwrap();
        assert_eq!(c.stall_shutdown, None, "0: never");
        assert_eq!(c.stall_check, Some(Duration::from_secs(60)));
        assert_eq!(c.log_level, "warning");
        let c = cfg(&[("FERROVOD_STALL_CHECK_DISABLE", "1")]).unwrap();
        assert_eq!(c.stall_check, None);
    }

    #[test]
    fn a_stall_shutdown_that_could_never_act_is_refused() {
        let err = |pairs: &[(&str, &str)]| cfg(pairs).unwrap_err().to_string();
        // Not above the default check time: it used to be dropped without a word.
        let e = err(&[("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", "5")]);
        assert!(
            e.contains("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS=\"5\"")
                && e.contains("not above the stall check time")
                && e.contains("60 s (the default of FERROVOD_STALL_CHECK_TIME_SECONDS)"),
            "{e}"
        );
        // Equal to an explicit check time, through the Horovod names.
        let e = err(&[
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "10"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "10"),
        ]);
        assert!(
            e.contains("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=\"10\"")
                && e.contains("HOROVOD_STALL_CHECK_TIME_SECONDS=\"10\""),
            "{e}"
        );
        let e = err(&[
            ("FERROVOD_STALL_CHECK_DISABLE", "1"),
            ("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120"),
        ]);
        assert!(
            e.contains("FERROVOD_STALL_CHECK_DISABLE=\"1\"") && e.contains("stall check off"),
            "{e}"
        );
        for bad in ["-5", "soon", "nan"] {
            let e = err(&[("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", bad)]);
            assert!(
                e.contains(&format!("FERROVOD_STALL_SHUTDOWN_TIME_SECONDS={bad:?}")),
                "{e}"
            );
        }
        for bad in ["0", "-1", "x"] {
            let e = err(&[("FERROVOD_STALL_CHECK_TIME_SECONDS", bad)]);
            assert!(
                e.contains(&format!("FERROVOD_STALL_CHECK_TIME_SECONDS={bad:?}"))
                    && e.contains("FERROVOD_STALL_CHECK_DISABLE"),
                "{e}"
            );
        }
    }

    #[test]
    fn timeouts_must_be_positive() {
        for (name, bad) in [
            ("FERROVOD_TIMEOUT_SECONDS", "0"),
            ("FERROVOD_TIMEOUT_SECONDS", "-3"),
            ("HOROVOD_GLOO_TIMEOUT_SECONDS", "0.0"),
            ("FERROVOD_TIMEOUT_SECONDS", "inf"),
            ("FERROVOD_START_TIMEOUT", "0"),
            ("HOROVOD_START_TIMEOUT", "-1"),
            ("FERROVOD_CYCLE_TIME", "1e300"),
        ] {
            let e = cfg(&[(name, bad)]).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{name}=")) && e.contains(bad),
                "{name}={bad}: {e}"
            );
        }
        let c = cfg(&[
            ("FERROVOD_TIMEOUT_SECONDS", "0.5"),
            ("HOROVOD_START_TIMEOUT", "7"),
        ])
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(500));
        assert_eq!(c.start_timeout, Duration::from_secs(7));
    }

    #[test]
    fn malformed_rendezvous_addresses_are_refused_at_once() {
        let job = |addr: &str| {
            cfg(&[
                ("FERROVOD_RANK", "0"),
                ("FERROVOD_SIZE", "2"),
                ("FERROVOD_RENDEZVOUS_ADDR", addr),
            ])
        };
        for (bad, why) in [
            ("nohost:notaport", "port \"notaport\""),
            ("1.2.3.4", "no port"),
            (":99999", "no host"),
            ("h:99999", "port \"99999\""),
            ("h:0", "port \"0\""),
            ("fd00::zz:5000", "\"fd00::zz\" is not a host name"),
            ("[::zz]:5000", "not a host name"),
            ("a b:5000", "not a host name"),
        ] {
            let e = job(bad).unwrap_err().to_string();
            assert!(
                e.contains(&format!("FERROVOD_RENDEZVOUS_ADDR={bad:?}")) && e.contains(why),
                "{bad}: {e}"
            );
        }
        for good in [
            "127.0.0.1:5",
            "node-0.svc_x:29500",
            "[fd00::1]:65535",
            "fd00::1:29500",
            "h:1",
        ] {
            assert_eq!(
                job(good).unwrap().launch.rendezvous_addr.as_deref(),
                Some(good)
            );
        }
        // An address put together from torchrun's variables is checked too.
        let e = cfg(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "65535"),
            ("TORCHELASTIC_RUN_ID", "x"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_PORT") && e.contains("65536"), "{e}");
    }

    #[test]
    fn launchers_are_detected_in_order_and_half_set_ones_are_errors() {
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("FERROVOD_RENDEZVOUS_ADDR", "h0:5000"),
        ])
        .unwrap();
        assert_eq!(
            (c.launch.launcher, c.launch.rank, c.launch.size),
            (Launcher::OpenMpi, 1, 4)
        );
        assert!(c.launch.rank0_hosts_store && c.launch.secret_derived);
        // No address: the exchange over MPI is needed, and without it the engine refuses.
        let c = cfg(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4")]).unwrap();
        assert!(c.launch.needs_mpi_rendezvous());
        let e = c.launch.require_rendezvous().unwrap_err().to_string();
        assert!(
            e.contains("FERROVOD_RENDEZVOUS_ADDR") && e.contains("mpi4py"),
            "{e}"
        );
        // One rank needs nobody to find.
        let c = cfg(&[("PMI_RANK", "0"), ("PMI_SIZE", "1")]).unwrap();
        assert!(!c.launch.needs_mpi_rendezvous());
        assert!(c.launch.require_rendezvous().is_ok());
        let c = cfg(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "x"),
        ])
        .unwrap();
        assert_eq!(c.launch.launcher, Launcher::Torchrun);
        assert_eq!(
            c.launch.rendezvous_addr.as_deref(),
            Some("m:29501"),
            "torchrun's agent owns MASTER_PORT"
        );
        assert_eq!(
            c.launch.agent_store, None,
            "no TORCHELASTIC_USE_AGENT_STORE"
        );
        let torchrun = [
            ("RANK", "2"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "r1"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ];
        let c = cfg(&torchrun).unwrap();
        assert_eq!(
            c.launch.agent_store,
            Some(("m:29500".into(), "ferrovod/r1/2/".into()))
        );
        let c =
            cfg(&[torchrun.as_slice(), &[("FERROVOD_RENDEZVOUS_ADDR", "a:1")]].concat()).unwrap();
        assert_eq!(c.launch.agent_store, None, "an explicit address wins");
        let c = cfg(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "23456"),
        ])
        .unwrap();
        assert_eq!(c.launch.rendezvous_addr.as_deref(), Some("m:23456"));
        let e = cfg(&[("RANK", "1")]).unwrap_err().to_string();
        assert!(e.contains("RANK is set but WORLD_SIZE is missing"), "{e}");
        let e = cfg(&[("RANK", "1"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_ADDR and MASTER_PORT are missing"), "{e}");
        let e = cfg(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "1"),
            ("PET_NPROC_PER_NODE", "2"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("node rank"), "{e}");
        // SLURM_PROCID outside a step is not a rank.
        let c = cfg(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]).unwrap();
        assert_eq!(c.launch.launcher, Launcher::None);
        let c = cfg(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_NODELIST", "gpu[007-009],cpu1"),
        ])
        .unwrap();
        assert_eq!(c.launch.launcher, Launcher::Slurm);
        assert_eq!(c.launch.rendezvous_addr.as_deref(), Some("gpu007:23456"));
        let c = cfg(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("FERROVOD_RENDEZVOUS_ADDR", "h:1"),
            ("FERROVOD_SECRET", "00ff"),
        ])
        .unwrap();
        assert_eq!(c.launch.launcher, Launcher::Hydra);
        assert!(!c.launch.secret_derived);
        // ferrovodrun's variables win over everything.
        let c = cfg(&[
            ("FERROVOD_RANK", "0"),
            ("FERROVOD_SIZE", "1"),
            ("RANK", "5"),
        ])
        .unwrap();
        assert_eq!(c.launch.launcher, Launcher::Ferrovodrun);
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(
            first_slurm_host("node[001-004,007]").as_deref(),
            Some("node001")
        );
        assert_eq!(first_slurm_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_slurm_host("solo").as_deref(), Some("solo"));
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

    fn tf(config: &str) -> Result<Config> {
        cfg(&[("TF_CONFIG", config)])
    }

    const CLUSTER: &str = r#""cluster": {"chief": ["c0:2222"], "ps": ["p0:2222"],
        "worker": ["w0:2222", "w1:2223"]}"#;

    #[test]
    fn tf_config_ranks_chief_then_workers() {
        for (task, rank) in [
            (r#"{"type": "chief", "index": 0}"#, 0),
            (r#"{"type": "worker", "index": 0}"#, 1),
            (r#"{"type": "worker", "index": 1}"#, 2),
        ] {
            let c = tf(&format!(
                r#"{{{CLUSTER}, "task": {task}, "environment": "cloud"}}"#
            ))
            .unwrap();
            let l = &c.launch;
            assert_eq!(
                (l.launcher, l.rank, l.size),
                (Launcher::TfConfig, rank, 3),
                "{task}"
            );
            assert_eq!(l.rendezvous_addr.as_deref(), Some("c0:2222"));
            assert!(l.rank0_hosts_store && l.secret_derived && l.local.is_none());
        }
        // "master" is the older name of the chief; without a chief, worker 0 is rank 0.
        let c = tf(
            r#"{"cluster": {"worker": ["w0:1", "w1:2"], "master": ["m:3"]},
                      "task": {"type": "master", "index": 0}}"#,
        )
        .unwrap();
        assert_eq!((c.launch.rank, c.launch.size), (0, 3));
        assert_eq!(c.launch.rendezvous_addr.as_deref(), Some("m:3"));
        let c = tf(
            r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 1}}"#,
        )
        .unwrap();
        assert_eq!((c.launch.rank, c.launch.size), (1, 2));
        assert_eq!(c.launch.rendezvous_addr.as_deref(), Some("w0:1"));
        // Every rank derives the same secret; another cluster derives another one.
        let other = tf(
            r#"{"cluster": {"worker": ["x0:1", "x1:2"]}, "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap();
        let same = tf(
            r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap();
        assert_eq!(c.launch.secret, same.launch.secret);
        assert_ne!(c.launch.secret, other.launch.secret);
        // FERROVOD_RENDEZVOUS_ADDR and FERROVOD_SECRET win.
        let c = cfg(&[
            ("TF_CONFIG", r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 1}}"#),
            ("FERROVOD_RENDEZVOUS_ADDR", "r:9"),
            ("FERROVOD_SECRET", "0a0b"),
        ])
        .unwrap();
        assert_eq!(c.launch.rendezvous_addr.as_deref(), Some("r:9"));
        assert_eq!(c.launch.secret.as_deref(), Some(&[10u8, 11][..]));
        assert!(!c.launch.secret_derived);
        // A single task needs no rendezvous; no cluster at all is no TFJob.
        let c = tf(r#"{"cluster": {"chief": ["c:1"]}, "task": {"type": "chief"}}"#).unwrap();
        assert_eq!((c.launch.launcher, c.launch.size), (Launcher::TfConfig, 1));
        assert_eq!(c.launch.rendezvous_addr, None);
        assert_eq!(tf("{}").unwrap().launch.launcher, Launcher::None);
        // torchrun's variables come first.
        let c = cfg(&[
            ("TF_CONFIG", "not json"),
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert_eq!(c.launch.launcher, Launcher::Torchrun);
    }

    #[test]
    fn tf_config_errors_say_what_is_wrong() {
        let err = |config: &str| tf(config).unwrap_err().to_string();
        for kind in ["ps", "evaluator"] {
            let e = err(&format!(
                r#"{{{CLUSTER}, "task": {{"type": "{kind}", "index": 0}}}}"#
            ));
            assert!(
                e.contains("TF_CONFIG")
                    && e.contains(kind)
                    && e.contains("chief and worker tasks only"),
                "{e}"
            );
        }
        let e = err(
            r#"{"cluster": {"worker": {"1": "w1:2222"}, "ps": ["p:1"]}, "task": {"type": "worker", "index": 1}}"#,
        );
        assert!(
            e.contains("sparse") && e.contains("enableDynamicWorker"),
            "{e}"
        );
        let e = err(r#"{"cluster": {"worker": ["w0:1"]}, "task": {"type": "worker", "index": 1}"#);
        assert!(
            e.contains("TF_CONFIG")
                && e.contains("not valid JSON")
                && e.contains("EOF while parsing"),
            "{e}"
        );
        let e = err("{'cluster': 1}");
        assert!(
            e.contains("TF_CONFIG") && e.contains("not valid JSON"),
            "{e}"
        );
        let e = err(
            r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 2}}"#,
        );
        assert!(
            e.contains("index 2 is out of range") && e.contains("2 entries"),
            "{e}"
        );
        let e = err(r#"{"cluster": {"worker": ["w0:1"]}, "task": {"type": "chief", "index": 0}}"#);
        assert!(e.contains("out of range"), "{e}");
        let e =
            err(r#"{"cluster": {"worker": ["w0:1"]}, "task": {"type": "worker", "index": -1}}"#);
        assert!(e.contains("not a non-negative integer"), "{e}");
        let e = err(r#"{"cluster": {"worker": ["w0:1"]}}"#);
        assert!(e.contains("no \"task\""), "{e}");
        let e = err(
            r#"{"cluster": {"worker": ["w0", "w1:2"]}, "task": {"type": "worker", "index": 1}}"#,
        );
        assert!(e.contains("\"w0\" is not \"host:port\""), "{e}");
        let e = err(r#"{"cluster": {"worker": [3]}, "task": {"type": "worker"}}"#);
        assert!(e.contains("not a \"host:port\" string"), "{e}");
        let e = err("[1]");
        assert!(e.contains("not a JSON object"), "{e}");
    }

    #[test]
    fn iface_and_its_horovod_alias() {
        assert_eq!(cfg(&[]).unwrap().iface, None);
        assert_eq!(
            cfg(&[("HOROVOD_GLOO_IFACE", "eth1")])
                .unwrap()
                .iface
                .as_deref(),
            Some("eth1")
        );
        let c = cfg(&[("HOROVOD_GLOO_IFACE", "eth1"), ("FERROVOD_IFACE", " lo ")]).unwrap();
        assert_eq!(c.iface.as_deref(), Some("lo"));
    }

    #[test]
    fn overrides_from_the_mpi_exchange_complete_an_mpi_launch() {
        // What Config::from_env_with layers over the environment.
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("FERROVOD_RENDEZVOUS_ADDR", "10.0.0.1:4000"),
            ("FERROVOD_SECRET", &encode_hex(&[1, 2, 255])),
        ])
        .unwrap();
        assert!(!c.launch.needs_mpi_rendezvous());
        assert_eq!(c.launch.secret.as_deref(), Some(&[1u8, 2, 255][..]));
        assert!(!c.launch.secret_derived && c.launch.rank0_hosts_store);
    }
}
