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
    Var { name: "FERROVOD_AUTOTUNE", alias: Some("HOROVOD_AUTOTUNE"), default: "0", doc: "Tune the fusion threshold and the cycle time online from measured throughput (those not set explicitly), then keep the best." },
    Var { name: "FERROVOD_AUTOTUNE_LOG", alias: Some("HOROVOD_AUTOTUNE_LOG"), default: "unset", doc: "CSV file of the autotune samples and the settled values." },
    Var { name: "FERROVOD_AUTOTUNE_WARMUP_SAMPLES", alias: Some("HOROVOD_AUTOTUNE_WARMUP_SAMPLES"), default: "3", doc: "Samples discarded before autotune scores." },
    Var { name: "FERROVOD_AUTOTUNE_STEPS_PER_SAMPLE", alias: Some("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"), default: "10", doc: "Training steps per autotune sample." },
    Var { name: "FERROVOD_STALL_CHECK_DISABLE", alias: Some("HOROVOD_STALL_CHECK_DISABLE"), default: "0", doc: "Turn the stall inspector off." },
    Var { name: "FERROVOD_STALL_CHECK_TIME_SECONDS", alias: Some("HOROVOD_STALL_CHECK_TIME_SECONDS"), default: "60", doc: "Rank 0 warns, naming each tensor and the ranks that have not submitted it, when some ranks have waited this long." },
    Var { name: "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", alias: Some("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), default: "0", doc: "If above the check time: a tensor stalled this long fails on every rank (FerrovodTimeoutError). 0: never." },
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
            Launcher::None => "none (a single process)",
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
    /// Online tuning of the fusion threshold and cycle time, when enabled.
    pub autotune: Option<crate::engine::autotune::AutotuneConfig>,
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

        let launch = detect_launch(&get, &lookup)?;
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
    let in_slurm_step = raw("SLURM_STEP_ID").is_some();
    let found = match ours {
        Some(f) => Some(f),
        None => match pair(
            Launcher::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            raw("OMPI_COMM_WORLD_RANK"),
            raw("OMPI_COMM_WORLD_SIZE"),
        )? {
            Some(f) => Some(f),
            None => match pair(
                Launcher::Hydra,
                "PMI_RANK",
                "PMI_SIZE",
                raw("PMI_RANK"),
                raw("PMI_SIZE"),
            )? {
                Some(f) => Some(f),
                // SLURM_PROCID outside a job step (e.g. in the batch script) is not a rank.
                None => match (in_slurm_step, raw("SLURM_PROCID")) {
                    (true, Some(r)) => pair(
                        Launcher::Slurm,
                        "SLURM_PROCID",
                        "SLURM_NTASKS",
                        Some(r),
                        raw("SLURM_NTASKS").or_else(|| raw("SLURM_NPROCS")),
                    )?,
                    _ => pair(
                        Launcher::Torchrun,
                        "RANK",
                        "WORLD_SIZE",
                        raw("RANK"),
                        raw("WORLD_SIZE"),
                    )?,
                },
            },
        },
    };
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
                    format!("{host}:{port}")
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
        Launcher::OpenMpi | Launcher::Hydra | Launcher::Slurm => {
            let addr = match (explicit_addr, launcher) {
                (Some(a), _) => Some(a),
                (None, Launcher::Slurm) => slurm_rendezvous(&raw),
                (None, _) => None,
            };
            let Some(addr) = addr else {
                return Err(Error::InvalidArgument(format!(
                    "started by {} with {size} ranks, but no rendezvous address: set \
                     FERROVOD_RENDEZVOUS_ADDR=<rank 0's host>:<free port> for every rank \
                     (mpirun -x FERROVOD_RENDEZVOUS_ADDR=...), or install mpi4py so that rank 0 \
                     can broadcast one",
                    launcher.describe()
                )));
            };
            let job = match launcher {
                Launcher::Slurm => raw("SLURM_JOB_ID")
                    .map(|j| format!("{j}.{}", raw("SLURM_STEP_ID").unwrap_or_default())),
                Launcher::OpenMpi => {
                    raw("OMPI_MCA_ess_base_jobid").or_else(|| raw("PMIX_NAMESPACE"))
                }
                _ => raw("PMI_FD").map(|_| addr.clone()),
            };
            (None, Some(addr), true, job)
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
        let e = cfg(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FERROVOD_RENDEZVOUS_ADDR") && e.contains("mpi4py"),
            "{e}"
        );
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
}
