//! Configuration: the only code that reads environment variables. Every `FERROVOD_*` variable
//! has its row in [`VARS`] (name, Horovod alias, default, meaning); the README's table is
//! written from it (`ferrovod._core.env_vars()`), so the two cannot drift apart. A default is
//! written only in its row: the parsers here, and Python, read it from there ([`default_of`]).
//! What the launch environment says (launcher, rank, rendezvous) is worked out by
//! [`crate::bootstrap::launch`], through the lookups this module hands it.

use std::time::Duration;

use crate::bootstrap::auth::secret_to_hex;
use crate::bootstrap::launch::{self, Lookup};
use crate::comm::Hierarchical;
use crate::error::{Error, Result};

pub use crate::bootstrap::launch::{LaunchInfo, Launcher};

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
    Var { name: "FERROVOD_CONTROL_FANOUT", alias: None, default: "16", doc: "Children per node of the control tree. Each host's first rank relays the control messages (submissions up, the coordinator's answers down) of up to this many of the host's other ranks (a tree of them beyond), and those first ranks form a tree of this fanout under rank 0, so no process holds more than this many control connections plus its own, and the coordinator answers each of its links once per op rather than every rank. 0: every rank connects to rank 0 (a star). Must be the same on every rank." },
    Var { name: "FERROVOD_TIMEOUT_SECONDS", alias: Some("HOROVOD_GLOO_TIMEOUT_SECONDS"), default: "30", doc: "Seconds a peer may make no progress in a collective before the op fails (a dead peer is detected at once). Must be above 0: there is no \"never\"." },
    Var { name: "FERROVOD_START_TIMEOUT", alias: Some("HOROVOD_START_TIMEOUT"), default: "60", doc: "Seconds init() waits for every rank to rendezvous. Must be above 0." },
    Var { name: "FERROVOD_DYNAMIC_PROCESS_SETS", alias: Some("HOROVOD_DYNAMIC_PROCESS_SETS"), default: "0", doc: "Allow add_process_set/remove_process_set after init()." },
    Var { name: "FERROVOD_FAST_PATH_BYTES", alias: None, default: "65536", doc: "Largest blocking allreduce, broadcast, allgather, reducescatter (Sum, Average) or alltoall without splits (bytes, per rank) that takes the fast path when every rank is on one host over shared memory: the ranks agree through shared memory, without the coordinator, and each sums (or copies) the others' inputs itself; in a job of one rank per host (2 to 16 ranks), blocking allreduces of at most 16384 bytes likewise, agreed over connections of their own. An op the ranks do not all offer alike (or any rank with other ops pending) goes the usual way. 0: off. At most 65536. Off while FERROVOD_STALL_SHUTDOWN_TIME_SECONDS is set (a fast op cannot be abandoned by one rank alone)." },
    Var { name: "FERROVOD_OVERLAP", alias: None, default: "auto", doc: "Whether torch's DistributedOptimizer submits gradients' allreduces during backward (1) or all at step() (0: in the order they came in, or, for dense CPU gradients of one dtype, kept in one flat buffer reduced by one in-place allreduce). auto: overlap, unless every rank is on one host, the gradients are on the CPU and local_size x torch threads fill every core (with FERROVOD_BIND_CORES: torch threads fill the rank's own cores; then the allreduces only take cores from the backward pass: on 2 ranks with 2 cores an MLP trained at 0.80-0.86 of its speed without communication, against 0.73-0.80 overlapped). In an elastic job auto means overlap (workers that join later must choose as the others did). The optimizer's `overlap` argument wins." },
    Var { name: "FERROVOD_ELASTIC_TIMEOUT", alias: Some("HOROVOD_ELASTIC_TIMEOUT"), default: "600", doc: "Elastic jobs: seconds ferrovodrun waits for enough hosts (at the start, for -np slots; later, for --min-np) before the job fails naming what it waited for; its --elastic-timeout flag wins. Workers wait somewhat longer for the launcher's next membership." },
    Var { name: "FERROVOD_ELASTIC", alias: Some("HOROVOD_ELASTIC"), default: "0", doc: "1 in a worker of an elastic job (set by the launchers: ferrovodrun --min-np, ElasticRayExecutor, spark.run_elastic): init() joins the launcher's memberships, and the optimizers keep their state for resets." },
    Var { name: "FERROVOD_ELASTIC_EPOCH", alias: None, default: "1", doc: "Elastic jobs: the membership (epoch) the launcher started this worker for; it joins that one or a newer one (set by the launchers)." },
    Var { name: "FERROVOD_ELASTIC_LOCAL_RANK", alias: None, default: "FERROVOD_LOCAL_RANK, else 0", doc: "Elastic jobs: this worker's slot on its host, which names its place in every membership (set by the launchers)." },
    Var { name: "FERROVOD_LAUNCHER", alias: None, default: "unset", doc: "What started this worker: ferrovodrun, ray or spark (set by them; for the worker's information, nothing reads it to decide)." },
    Var { name: "FERROVOD_WATCHDOG", alias: None, default: "unset", doc: "The mark ferrovodrun puts in every worker's environment, by which its supervisor finds the worker's whole process tree when it must stop the job (set by ferrovodrun; kept off ssh sessions)." },
    Var { name: "FERROVOD_AS_HOROVOD", alias: None, default: "0", doc: "Anything but empty, 0 or false: `import horovod`, `horovod.torch`, `horovod.tensorflow.keras`, ... (any `horovod.X`) give the module `ferrovod.X` itself, for code that imports Horovod and cannot be edited (`ferrovodrun --as-horovod` sets it for every worker). Read at interpreter start-up by the `ferrovod_as_horovod.pth` the wheel installs, which imports nothing of ferrovod until code imports horovod; not by the engine. A Horovod installed beside ferrovod is left alone, saying so once on stderr. See docs/horovod_compat.md." },
    Var { name: "FERROVOD_SPARK_START_TIMEOUT", alias: Some("HOROVOD_SPARK_START_TIMEOUT"), default: "600", doc: "ferrovod.spark.run and run_elastic: seconds to wait for Spark to start the tasks (the start_timeout argument wins)." },
    Var { name: "FERROVOD_BIND_CORES", alias: None, default: "auto", doc: "Whether ferrovodrun binds each worker it starts, on every host, to its local rank's share of the CPUs the launcher (or the host's agent) may use: whole physical cores (a core's hyperthreads together), contiguous; its thread pools (OMP_NUM_THREADS and the BLAS ones, unless set) get as many threads, and its threads and child processes inherit the binding. auto (the default): where every worker of the host gets at least one whole physical core; 1 (--bind-cores): always, single CPUs shared round-robin where there are fewer; 0 (--no-bind-cores): never. A synchronous job waits for its slowest rank every step, and a waiting rank's unbound threads can take the core a peer computes on. ferrovodrun sets it to 1 in a worker it bound; --verbose says what it did. Other launchers bind their own way (mpirun --bind-to, Kubernetes' CPU manager)." },
    Var { name: "FERROVOD_SPIN_US", alias: None, default: "250", doc: "Microseconds an idle wait (engine thread, coordinator, a caller driving its own op in synchronize) keeps polling, yielding the core between polls, before it blocks; also how long a caller that drove keeps the background threads asleep. A wait that blocked costs a thread wake-up when it ends, the dearest part of a small op. When waits are crowded (FERROVOD_YIELD_WHEN_IDLE), the fast path's waits yield for at least 2 ms. 0: block at once." },
    Var { name: "FERROVOD_YIELD_WHEN_IDLE", alias: None, default: "auto", doc: "Whether idle waits are crowded: yield the core between every poll for the whole FERROVOD_SPIN_US, never spin without yielding, and never block early because the core is contended (Open MPI's mpi_yield_when_idle). auto: when this rank has less than one CPU to itself (its affinity shared with its host's other ranks, or the host's cgroup CPU quota, e.g. a Kubernetes CPU limit, split between them), as with more ranks than cores; at debug log level each rank says what it found. 1: always; 0: never." },
    Var { name: "FERROVOD_NCCL_LIBRARY", alias: None, default: "unset", doc: "Path of the `libnccl.so.2` to use; when set, no other place is searched. Unset: the dynamic linker's search, then the `nvidia-nccl-*` wheel that torch installs." },
    Var { name: "FERROVOD_NCCL_DISPATCH", alias: None, default: "1", doc: "1: CUDA tensors (torch) of allreduce, allgather, broadcast, alltoall and evenly split reducescatter run on NCCL on the device where every rank of the process set can use NCCL and no two ranks share a GPU; elsewhere the engine stages them through pinned host memory, saying why once. 0: the engine always stages them. Must be the same on every rank." },
    Var { name: "FERROVOD_NCCL_SHARED_GPU", alias: None, default: "0", doc: "1: the ranks of a process set that share a GPU still run its CUDA ops on NCCL, instead of being staged through host memory: each such rank appends its process id to `NCCL_HOSTID` (the host name where that is unset), so NCCL takes it for a host of its own and joins the ranks through its network transport (choose it with `NCCL_SOCKET_IFNAME`, e.g. `lo` on one machine). Their kernels time-share the GPU: for tests, and for jobs that place several ranks on each GPU. Needs 1 on every rank of the set; where one lacks it, the set is staged. 0: such sets are staged, saying why once." },
    Var { name: "FERROVOD_SHM_DISABLE", alias: None, default: "0", doc: "Ranks on the same host talk over TCP instead of shared memory (memfd segments, which leave nothing behind even after SIGKILL), and a control connection to a node of the control tree on the same host (the coordinator, a relay) uses its Unix socket instead of shared-memory rings; the fast path (FERROVOD_FAST_PATH_BYTES), which agrees through shared memory, is off." },
    Var { name: "FERROVOD_SMALL_ALLREDUCE_BYTES", alias: None, default: "65536", doc: "Allreduce payloads up to this size use the latency-optimal algorithm." },
    Var { name: "FERROVOD_HIERARCHICAL_ALLREDUCE", alias: Some("HOROVOD_HIERARCHICAL_ALLREDUCE"), default: "unset (auto)", doc: "Allreduce in a process set that spans hosts, with more than one rank on some host: reduce inside each host (shared memory), allreduce across hosts, spread inside each host, so less crosses the network. Unset or `auto`: for payloads above FERROVOD_SMALL_ALLREDUCE_BYTES; 1: for every payload; 0: never. Sets on one host are not affected. CUDA tensors on NCCL go hierarchical only with 1: NCCL inside each host, the engine's TCP collectives across hosts (Horovod's NCCL hierarchical allreduce, TCP in MPI's place); else NCCL spans the set. Must be the same on every rank (init() checks, as for FERROVOD_SMALL_ALLREDUCE_BYTES and FERROVOD_CHUNK_BYTES)." },
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

/// What the launcher of an elastic job tells each worker.
#[derive(Debug, Clone)]
pub struct ElasticWorker {
    /// Whether this process is a worker of an elastic job (`FERROVOD_ELASTIC`).
    pub enabled: bool,
    /// The membership it was started for (`FERROVOD_ELASTIC_EPOCH`, from 1).
    pub epoch: u64,
    /// Its slot on its host (`FERROVOD_ELASTIC_LOCAL_RANK`, else the local rank, else 0).
    pub local_rank: usize,
    /// How long the launcher waits for hosts (`FERROVOD_ELASTIC_TIMEOUT`).
    pub timeout: Duration,
}

/// Every setting, parsed once.
#[derive(Debug, Clone)]
pub struct Config {
    /// Launch environment.
    pub launch: LaunchInfo,
    /// Host identity.
    pub hostname: String,
    /// This worker's standing in an elastic job, as the launcher set it.
    pub elastic: ElasticWorker,
    /// Interface whose IPv4 address the listeners bind to (`FERROVOD_IFACE`).
    pub iface: Option<String>,
    /// Fusion buffer limit in bytes.
    pub fusion_threshold: usize,
    /// Coordinator batching window.
    pub cycle_time: Duration,
    /// Response cache capacity per process set.
    pub cache_capacity: usize,
    /// Children per node of the control tree (0: a star under rank 0).
    pub control_fanout: usize,
    /// Progress timeout for collectives.
    pub timeout: Duration,
    /// Rendezvous timeout.
    pub start_timeout: Duration,
    /// Whether process sets may be added after start-up.
    pub dynamic_process_sets: bool,
    /// Spin before blocking.
    pub spin: Duration,
    /// Crowded waits (`FERROVOD_YIELD_WHEN_IDLE`): `None` decides from this rank's CPU share.
    pub yield_when_idle: Option<bool>,
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
    pub autotune: Option<AutotuneConfig>,
    /// When the stall inspector warns; `None` when it is disabled.
    pub stall_check: Option<Duration>,
    /// When a stalled tensor becomes an error on every rank; `None`: never.
    pub stall_shutdown: Option<Duration>,
}

/// Autotune settings (`FERROVOD_AUTOTUNE*`), read here with every other setting and used by
/// the coordinator's tuner (`control::autotune`).
#[derive(Debug, Clone)]
pub struct AutotuneConfig {
    /// Tune the fusion threshold (the user did not set it).
    pub tune_fusion: bool,
    /// Tune the cycle time (the user did not set it).
    pub tune_cycle: bool,
    /// Samples thrown away before scoring starts.
    pub warmup_samples: usize,
    /// Steps per sample.
    pub steps_per_sample: usize,
    /// Samples per candidate (their median is its score).
    pub samples_per_candidate: usize,
    /// CSV log of every sample, if wanted.
    pub log_path: Option<String>,
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
    flag_apart("FERROVOD_NCCL_DISPATCH")
}

/// `FERROVOD_NCCL_SHARED_GPU`: read apart from [`Config`], like [`nccl_dispatch`], beside
/// which the device path decides.
pub fn nccl_shared_gpu() -> bool {
    flag_apart("FERROVOD_NCCL_SHARED_GPU")
}

/// Flag `name` read from the environment now, its table default where unset or empty.
fn flag_apart(name: &str) -> bool {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => is_on(v.trim()),
        _ => is_on(default_of(name)),
    }
}

/// Makes this process a host of its own in NCCL's eyes, for communicators created from now
/// on: NCCL refuses two ranks on one GPU only when their host hashes, which it derives from
/// `NCCL_HOSTID` when set, are equal. Done once per process; returns the value in force.
///
/// NCCL reads the variable when it creates a communicator, on this (the engine's) thread,
/// which is the one place the process writes its environment after start-up.
pub fn nccl_host_of_its_own() -> String {
    static SET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SET.get_or_init(|| {
        let base = std::env::var("NCCL_HOSTID")
            .ok()
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(system_hostname);
        let id = format!("{base}/pid{}", std::process::id());
        std::env::set_var("NCCL_HOSTID", &id);
        id
    })
    .clone()
}

/// The default of variable `name`, as its row in [`VARS`] gives it: the one place a default is
/// written. The parsers read it as they read a value the user set, so a default written
/// anywhere else could not take effect. Empty for a name not in the table, which no parser
/// accepts, so a missing row fails every `Config` (and the tests) at once.
pub fn default_of(name: &str) -> &'static str {
    VARS.iter()
        .find(|v| v.name == name)
        .map_or("", |v| v.default)
}

/// How every flag is read: a positive integer, or true.
fn is_on(v: &str) -> bool {
    v.parse::<i64>()
        .map(|x| x > 0)
        .unwrap_or(v == "true" || v == "True")
}

/// A setting that is `auto` (`None`) or a flag: an integer (on above 0), `true` or `false`
/// (any case).
fn auto_or_flag(key: &str, v: &str) -> Result<Option<bool>> {
    match (v.parse::<i64>(), v.to_ascii_lowercase().as_str()) {
        (Ok(x), _) => Ok(Some(x > 0)),
        (_, "true") => Ok(Some(true)),
        (_, "false") => Ok(Some(false)),
        (_, "auto") => Ok(None),
        _ => Err(Error::InvalidArgument(format!(
            "{key}={v:?}: expected 1, 0 or auto"
        ))),
    }
}

/// The process environment, read once: every variable whose name and value are UTF-8 (as
/// `std::env::var` would see them). Settings parsed from one reading agree with each other,
/// whatever changes the environment meanwhile (the binding's `Settings`).
#[derive(Debug, Clone, Default)]
pub struct Environment(std::collections::HashMap<String, String>);

impl Environment {
    /// Reads the process environment now.
    pub fn read() -> Environment {
        Environment(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .collect(),
        )
    }

    /// The value of `name` in this reading.
    pub fn get(&self, name: &str) -> Option<String> {
        self.0.get(name).cloned()
    }
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads settings through `get`, with the rendezvous address and the job secret replaced
    /// where given: rank 0 handed them out over MPI, and they are passed in rather than put
    /// into the environment, which child processes would inherit. What the launch detection
    /// derives from them (a derived secret) follows.
    pub fn from_lookup_with(
        get: impl Fn(&str) -> Option<String>,
        rendezvous_addr: Option<&str>,
        secret: Option<&[u8]>,
    ) -> Result<Config> {
        let secret_hex = secret.map(secret_to_hex);
        Config::from_lookup(|k| match (k, rendezvous_addr, &secret_hex) {
            ("FERROVOD_RENDEZVOUS_ADDR", Some(addr), _) => Some(addr.to_string()),
            ("FERROVOD_SECRET", _, Some(hex)) => Some(hex.clone()),
            _ => get(k),
        })
    }

    /// Reads settings through `get` but not the launch, for a job whose rank and size come
    /// from elsewhere (torch.distributed's front end hands them in): a launcher's variables
    /// there are not this job's, and half of a pair (torch's test harness sets `WORLD_SIZE`
    /// without `RANK`) must not fail it. `launch` is a one-rank placeholder holding only
    /// `FERROVOD_SECRET`'s secret, for the caller to fill in.
    pub fn from_lookup_without_launch(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        Config::read(get, false)
    }

    /// Reads settings through `get` (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        Config::read(get, true)
    }

    /// Reads settings through `get`; the launch from the launcher's variables when `detect`,
    /// else the placeholder [`Config::from_lookup_without_launch`] describes.
    fn read(get: impl Fn(&str) -> Option<String>, detect: bool) -> Result<Config> {
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
        // What the user set, else the table's default (named as such in an error, which only
        // a wrong row could cause).
        let value = |name: &str| -> (String, String) {
            lookup(name)
                .unwrap_or_else(|| (format!("{name} (default)"), default_of(name).to_string()))
        };
        let num = |name: &str| -> Result<f64> {
            let (key, v) = value(name);
            match v.parse::<f64>() {
                Ok(x) if x >= 0.0 && x.is_finite() => Ok(x),
                _ => Err(Error::InvalidArgument(format!(
                    "{key}={v:?} is not a non-negative number"
                ))),
            }
        };
        // Seconds that must be above 0 (with what to do instead in `hint`); a value too large
        // for a Duration is refused too rather than panicking.
        let seconds = |name: &str, hint: &str| -> Result<Duration> {
            let (key, v) = value(name);
            match v.parse::<f64>().ok().filter(|x| *x > 0.0) {
                Some(x) => Duration::try_from_secs_f64(x).map_err(|_| {
                    Error::InvalidArgument(format!("{key}={v:?} is too large a number of seconds"))
                }),
                None => Err(Error::InvalidArgument(format!(
                    "{key}={v:?} is not a positive number of seconds{hint}"
                ))),
            }
        };
        let int = |name: &str| -> Result<usize> {
            let (key, v) = value(name);
            v.parse::<usize>().map_err(|_| {
                Error::InvalidArgument(format!("{key}={v:?} is not a non-negative integer"))
            })
        };
        let flag = |name: &str| -> bool { is_on(&value(name).1) };

        let launch = if detect {
            launch::detect(&get, &lookup)?
        } else {
            launch::placeholder(&lookup)?
        };
        let hostname = lookup("FERROVOD_HOSTNAME")
            .map(|(_, v)| v)
            .unwrap_or_else(system_hostname);
        let hierarchical = match lookup("FERROVOD_HIERARCHICAL_ALLREDUCE") {
            None => Hierarchical::Auto,
            Some((key, v)) => match auto_or_flag(&key, &v)? {
                None => Hierarchical::Auto,
                Some(true) => Hierarchical::Always,
                Some(false) => Hierarchical::Never,
            },
        };
        let tuning = crate::comm::Tuning {
            small_allreduce_bytes: int("FERROVOD_SMALL_ALLREDUCE_BYTES")?,
            chunk_bytes: int("FERROVOD_CHUNK_BYTES")?.max(64),
            hierarchical,
        };
        let (stall_check, stall_shutdown) = stall_limits(&lookup, &seconds, flag)?;
        let elastic = ElasticWorker {
            enabled: flag("FERROVOD_ELASTIC"),
            epoch: int("FERROVOD_ELASTIC_EPOCH")? as u64,
            local_rank: if lookup("FERROVOD_ELASTIC_LOCAL_RANK").is_some() {
                int("FERROVOD_ELASTIC_LOCAL_RANK")?
            } else if lookup("FERROVOD_LOCAL_RANK").is_some() {
                int("FERROVOD_LOCAL_RANK")?
            } else {
                0
            },
            timeout: seconds("FERROVOD_ELASTIC_TIMEOUT", "")?,
        };
        Ok(Config {
            launch,
            hostname,
            elastic,
            iface: lookup("FERROVOD_IFACE").map(|(_, v)| v),
            fusion_threshold: int("FERROVOD_FUSION_THRESHOLD")?,
            cycle_time: Duration::try_from_secs_f64(num("FERROVOD_CYCLE_TIME")? / 1e3).map_err(
                |_| {
                    let (key, v) = value("FERROVOD_CYCLE_TIME");
                    Error::InvalidArgument(format!("{key}={v:?} is too many milliseconds"))
                },
            )?,
            cache_capacity: int("FERROVOD_CACHE_CAPACITY")?,
            control_fanout: int("FERROVOD_CONTROL_FANOUT")?,
            timeout: seconds(
                "FERROVOD_TIMEOUT_SECONDS",
                " (how long a peer may make no progress before the op fails; there is no \"never\")",
            )?,
            start_timeout: seconds("FERROVOD_START_TIMEOUT", "")?,
            dynamic_process_sets: flag("FERROVOD_DYNAMIC_PROCESS_SETS"),
            spin: Duration::from_micros(int("FERROVOD_SPIN_US")? as u64),
            yield_when_idle: {
                let (key, v) = value("FERROVOD_YIELD_WHEN_IDLE");
                auto_or_flag(&key, &v)?
            },
            shm_disable: flag("FERROVOD_SHM_DISABLE"),
            fast_path_bytes: int("FERROVOD_FAST_PATH_BYTES")?
                .min(crate::transport::offers::OFFER_DATA_BYTES),
            tuning,
            log_level: Some(value("FERROVOD_LOG_LEVEL").1.to_ascii_lowercase())
                .filter(|v| LOG_LEVELS.contains(&v.as_str()))
                .unwrap_or_else(|| default_of("FERROVOD_LOG_LEVEL").into()),
            log_hide_time: flag("FERROVOD_LOG_HIDE_TIME"),
            timeline: lookup("FERROVOD_TIMELINE")
                .map(|(_, v)| v)
                .filter(|v| !v.eq_ignore_ascii_case("dynamic")),
            timeline_mark_cycles: flag("FERROVOD_TIMELINE_MARK_CYCLES"),
            autotune: if flag("FERROVOD_AUTOTUNE") {
                Some(AutotuneConfig {
                    tune_fusion: lookup("FERROVOD_FUSION_THRESHOLD").is_none(),
                    tune_cycle: lookup("FERROVOD_CYCLE_TIME").is_none(),
                    warmup_samples: int("FERROVOD_AUTOTUNE_WARMUP_SAMPLES")?,
                    steps_per_sample: int("FERROVOD_AUTOTUNE_STEPS_PER_SAMPLE")?.max(1),
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

type Seconds<'a> = dyn Fn(&str, &str) -> Result<Duration> + 'a;

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
    let check = (!flag("FERROVOD_STALL_CHECK_DISABLE")).then_some(check_time);
    let name = "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS";
    let (key, v) =
        lookup(name).unwrap_or_else(|| (format!("{name} (default)"), default_of(name).to_string()));
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
            None => format!(
                "{} s (the default of FERROVOD_STALL_CHECK_TIME_SECONDS)",
                default_of("FERROVOD_STALL_CHECK_TIME_SECONDS")
            ),
        };
        return Err(Error::InvalidArgument(format!(
            "{key}={v:?} is not above the stall check time, {check_source}: a stalled tensor \
             would be warned about but never failed. Set it above the check time (or lower \
             the check time), or to 0 to never shut down"
        )));
    }
    Ok((Some(check), Some(shutdown)))
}

/// Accepted values of `FERROVOD_LOG_LEVEL`.
pub const LOG_LEVELS: [&str; 6] = ["trace", "debug", "info", "warning", "error", "fatal"];

fn system_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests;
