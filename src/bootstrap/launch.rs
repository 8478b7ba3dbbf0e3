//! The launch environment: which launcher started this process and what it says about the
//! job — rank, size, local ranks, the rendezvous address, the job secret — parsed from its
//! variables (ferrovodrun's, Open MPI's, Hydra's `PMI_*`, Slurm's, torchrun's and `TF_CONFIG`).
//!
//! It reads variables only through the functions [`detect`] is given: `config` is still the
//! one reader of the environment, and settings keep one parser (with the Horovod aliases).

use serde_json::Value as Json;

use super::auth::secret_from_hex;
use crate::error::{Error, Result};

/// How [`detect`] reads one of ferrovod's own variables: `(name found under, value)`.
pub type Lookup<'a> = dyn Fn(&str) -> Option<(String, String)> + 'a;

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
    /// A Kubeflow Trainer TrainJob with the Torch policy whose command is not torchrun: one
    /// process per pod, placed by the `PET_*` variables torchrun would have read.
    TrainerTorch,
    /// A TensorFlow job (Kubeflow TFJob and others): `TF_CONFIG`.
    TfConfig,
    /// A worker of an MXNet job set up for parameter servers (`DMLC_*`): the mxnet-operator's
    /// MXJob (`MX_CONFIG`) or MXNet's `tools/launch.py` (`DMLC_TASK_ID`, `DMLC_WORKER_ID`).
    Dmlc,
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
            Launcher::TrainerTorch => {
                "Kubeflow Trainer's Torch policy without torchrun (PET_NODE_RANK, PET_NNODES, \
                 PET_MASTER_ADDR)"
            }
            Launcher::TfConfig => "TFJob (TF_CONFIG)",
            Launcher::Dmlc => {
                "MXNet's DMLC_* variables (MXJob's MX_CONFIG, DMLC_WORKER_ID or DMLC_TASK_ID)"
            }
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
            Launcher::TrainerTorch => "trainer_torch",
            Launcher::TfConfig => "tf_config",
            Launcher::Dmlc => "dmlc",
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
    /// it with mpi4py and passes the result back in through
    /// [`crate::config::Config::from_env_with`]).
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
///
/// `get` reads a variable as the launcher set it; `lookup` reads one of ferrovod's own
/// variables the way every setting is read (the `FERROVOD_*` name, else its Horovod alias;
/// trimmed, empty meaning unset) and returns the name it was found under with the value, so
/// that errors name what the user actually set.
pub fn detect(get: &dyn Fn(&str) -> Option<String>, lookup: &Lookup<'_>) -> Result<LaunchInfo> {
    let raw = |name: &str| {
        get(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
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
    if found.is_none() {
        // Under torchrun the workers have RANK too and are found above.
        found = pair(
            Launcher::TrainerTorch,
            "PET_NODE_RANK",
            "PET_NNODES",
            raw("PET_NODE_RANK"),
            raw("PET_NNODES"),
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
    let mut dmlc_addr = None;
    if found.is_none() {
        if let Some(worker) = dmlc_worker(&raw)? {
            found = Some((Launcher::Dmlc, worker.rank, worker.size));
            dmlc_addr = Some(worker.rendezvous);
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
            secret_from_hex(&hex)
                .map_err(|_| Error::InvalidArgument("FERROVOD_SECRET is not valid hex".into()))?,
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
                // Workers started by hand the way Horovod's Gloo workers are: rank 0 hosts the
                // store at the rendezvous host and port they were given.
                let gloo = match (
                    raw("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
                    raw("HOROVOD_GLOO_RENDEZVOUS_PORT"),
                ) {
                    (Some(host), Some(port)) => Some(format!("{host}:{port}")),
                    _ => None,
                };
                let Some(addr) = gloo else {
                    return Err(Error::InvalidArgument(format!(
                        "FERROVOD_SIZE={size} but FERROVOD_RENDEZVOUS_ADDR is not set: start the \
                         job with ferrovodrun (or give every rank FERROVOD_RENDEZVOUS_ADDR, or \
                         Horovod's HOROVOD_GLOO_RENDEZVOUS_ADDR and _PORT)"
                    )));
                };
                check_rendezvous_addr(
                    "HOROVOD_GLOO_RENDEZVOUS_ADDR:HOROVOD_GLOO_RENDEZVOUS_PORT",
                    &addr,
                )?;
                (local, Some(addr.clone()), true, Some(addr))
            } else {
                (local, explicit_addr, false, None)
            }
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
                        return Err(Error::InvalidArgument(format!(
                            "RANK and WORLD_SIZE are set but {} missing: set MASTER_ADDR and \
                             MASTER_PORT (torchrun and PyTorchJob do), or FERROVOD_RENDEZVOUS_ADDR",
                            unset(&["MASTER_ADDR", "MASTER_PORT"], &raw).unwrap_or_default()
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
        Launcher::TrainerTorch => {
            let per_pod = raw("PET_NPROC_PER_NODE");
            if let Some(n) = per_pod.as_deref().and_then(|v| v.parse::<usize>().ok()) {
                if n > 1 {
                    return Err(Error::InvalidArgument(format!(
                        "PET_NPROC_PER_NODE={n} without torchrun: this command runs one \
                         process per pod. Make torchrun the TrainJob's command, or set \
                         numProcPerNode: 1"
                    )));
                }
            }
            let host = raw("PET_MASTER_ADDR");
            let port = raw("PET_MASTER_PORT");
            let addr = match (explicit_addr, &host, &port) {
                (Some(a), _, _) => a,
                (None, Some(h), Some(p)) => {
                    let addr = format!("{h}:{p}");
                    check_rendezvous_addr("PET_MASTER_ADDR:PET_MASTER_PORT", &addr)?;
                    addr
                }
                _ => {
                    return Err(Error::InvalidArgument(
                        "PET_NODE_RANK and PET_NNODES are set but PET_MASTER_ADDR or \
                         PET_MASTER_PORT is missing (Kubeflow Trainer sets all of them), or \
                         set FERROVOD_RENDEZVOUS_ADDR"
                            .into(),
                    ))
                }
            };
            // Rank 0 serves the store at the master's address; its pod declares the port.
            let job = Some(addr.clone());
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
        Launcher::Dmlc => {
            let addr = explicit_addr.or(dmlc_addr);
            // Every worker sees the same rendezvous address, which names the job's hosts.
            let job = addr.clone().map(|a| format!("dmlc:{a}"));
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
        // ferrovodrun hands every worker its secret; workers started by hand with Horovod's
        // variables (rank 0 hosting the store) derive one, as under other launchers.
        None if (launcher == Launcher::Ferrovodrun && !rank0_hosts_store) || size == 1 => {
            (None, false)
        }
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

/// Variable `name`'s value `v` as a count or index; `None` when unset.
fn int_of(name: &str, v: Option<String>) -> Result<Option<usize>> {
    v.map(|v| {
        v.parse::<usize>().map_err(|_| {
            Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer"))
        })
    })
    .transpose()
}

/// Which of `names` are unset, as the subject of a sentence ("A is", "A and B are"); `None`
/// when all are set.
fn unset(names: &[&str], raw: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let missing: Vec<&str> = names.iter().copied().filter(|n| raw(n).is_none()).collect();
    match missing.len() {
        0 => None,
        1 => Some(format!("{} is", missing[0])),
        _ => Some(format!("{} are", missing.join(" and "))),
    }
}

/// A worker of an MXNet job set up for parameter servers, from the `DMLC_*` variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DmlcWorker {
    /// This worker's index.
    pub rank: usize,
    /// `DMLC_NUM_WORKER`.
    pub size: usize,
    /// Where worker 0 serves the rendezvous store: its own endpoint in `MX_CONFIG`, else the
    /// scheduler's address, which the scheduler (not needed here) leaves free.
    pub rendezvous: String,
}

/// The worker `DMLC_ROLE` and its companions describe: `Ok(None)` without `DMLC_ROLE`. The
/// mxnet-operator gives every pod `MX_CONFIG` (the cluster and this task's index, as
/// `TF_CONFIG` does) besides `DMLC_*`; MXNet's `tools/launch.py` numbers its local workers in
/// `DMLC_TASK_ID`, and elsewhere workers say which they are with `DMLC_WORKER_ID`. Servers and
/// schedulers are not ranks: their role is an error here (`ferrovod.init()` and
/// `import ferrovod.mxnet` end such a process before it gets here, saying it is not needed).
pub fn dmlc_worker(raw: &dyn Fn(&str) -> Option<String>) -> Result<Option<DmlcWorker>> {
    let Some(role) = raw("DMLC_ROLE") else {
        return Ok(None);
    };
    if let Some(missing) = unset(
        &["DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER"],
        raw,
    ) {
        return Err(Error::InvalidArgument(format!(
            "DMLC_ROLE={role} is set but {missing} missing (the mxnet-operator and MXNet's \
             tools/launch.py set DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT and DMLC_NUM_WORKER)"
        )));
    }
    match role.to_ascii_lowercase().as_str() {
        "worker" => {}
        "server" | "scheduler" => {
            return Err(Error::InvalidArgument(format!(
                "DMLC_ROLE={role}: ferrovod's workers average with allreduce and need no \
                 {role}; run nothing in this process (`import ferrovod.mxnet` ends it)"
            )))
        }
        _ => {
            return Err(Error::InvalidArgument(format!(
                "DMLC_ROLE={role} is not worker, server or scheduler"
            )))
        }
    }
    // Only variables known to be set are read this way.
    let int = |name: &str| int_of(name, raw(name)).map(Option::unwrap_or_default);
    let size = int("DMLC_NUM_WORKER")?;
    if size == 0 {
        return Err(Error::InvalidArgument(
            "DMLC_NUM_WORKER=0: no worker to run".into(),
        ));
    }
    let (rank, rendezvous) = match raw("MX_CONFIG") {
        Some(text) => mx_config_worker(&text, size)?,
        // tools/launch.py's local launcher numbers its workers 0.. in DMLC_TASK_ID; BytePS's
        // scripts, and users, give DMLC_WORKER_ID.
        None => match ["DMLC_WORKER_ID", "DMLC_TASK_ID"]
            .into_iter()
            .find(|n| raw(n).is_some())
        {
            Some(id) => {
                let port = int("DMLC_PS_ROOT_PORT")?;
                let host = raw("DMLC_PS_ROOT_URI").unwrap_or_default();
                (int(id)?, format!("{host}:{port}"))
            }
            None => {
                return Err(Error::InvalidArgument(
                    "DMLC_ROLE=worker, but neither MX_CONFIG (the mxnet-operator's) nor \
                     DMLC_WORKER_ID nor DMLC_TASK_ID (tools/launch.py's) says which worker this \
                     is: give each worker DMLC_WORKER_ID=0, 1, ... (worker 0 on the host of \
                     DMLC_PS_ROOT_URI)"
                        .into(),
                ))
            }
        },
    };
    if rank >= size {
        return Err(Error::InvalidArgument(format!(
            "worker {rank} of DMLC_NUM_WORKER={size}: the index must be below the count"
        )));
    }
    check_rendezvous_addr("the DMLC rendezvous address", &rendezvous)?;
    Ok(Some(DmlcWorker {
        rank,
        size,
        rendezvous,
    }))
}

/// This worker's index and worker 0's endpoint from the mxnet-operator's `MX_CONFIG`
/// (`{"cluster": {"worker": [{"url": .., "port": ..}, ..], ..}, "task": {"type", "index"}}`).
fn mx_config_worker(text: &str, size: usize) -> Result<(usize, String)> {
    let bad = |msg: String| Error::InvalidArgument(format!("MX_CONFIG: {msg}"));
    let json: Json =
        serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
    let task = json.get("task").ok_or_else(|| bad("no \"task\"".into()))?;
    let kind = task.get("type").and_then(Json::as_str).unwrap_or_default();
    if !kind.eq_ignore_ascii_case("worker") {
        return Err(bad(format!("task type {kind:?} with DMLC_ROLE=worker")));
    }
    let index = task
        .get("index")
        .and_then(Json::as_u64)
        .ok_or_else(|| bad("task.index is not a non-negative integer".into()))?;
    let workers = json
        .get("cluster")
        .and_then(|c| c.get("worker"))
        .and_then(Json::as_array)
        .ok_or_else(|| bad("no cluster.worker list".into()))?;
    if workers.len() != size {
        return Err(bad(format!(
            "{} workers in cluster.worker but DMLC_NUM_WORKER={size}",
            workers.len()
        )));
    }
    let first = &workers[0];
    let (Some(url), Some(port)) = (
        first.get("url").and_then(Json::as_str),
        first.get("port").and_then(Json::as_u64),
    ) else {
        return Err(bad("cluster.worker[0] needs a url and a port".into()));
    };
    Ok((index as usize, format!("{url}:{port}")))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::auth::secret_to_hex;
    use std::collections::HashMap;

    /// Detects from `pairs` alone, reading ferrovod's variables as `config` does (no alias is
    /// used here).
    fn cfg(pairs: &[(&str, &str)]) -> Result<LaunchInfo> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let get = |k: &str| m.get(k).cloned();
        let lookup = |k: &str| {
            get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .map(|v| (k.to_string(), v))
        };
        detect(&get, &lookup)
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
            assert_eq!(job(good).unwrap().rendezvous_addr.as_deref(), Some(good));
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
        assert_eq!((c.launcher, c.rank, c.size), (Launcher::OpenMpi, 1, 4));
        assert!(c.rank0_hosts_store && c.secret_derived);
        // No address: the exchange over MPI is needed, and without it the engine refuses.
        let c = cfg(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4")]).unwrap();
        assert!(c.needs_mpi_rendezvous());
        let e = c.require_rendezvous().unwrap_err().to_string();
        assert!(
            e.contains("FERROVOD_RENDEZVOUS_ADDR") && e.contains("mpi4py"),
            "{e}"
        );
        // One rank needs nobody to find.
        let c = cfg(&[("PMI_RANK", "0"), ("PMI_SIZE", "1")]).unwrap();
        assert!(!c.needs_mpi_rendezvous());
        assert!(c.require_rendezvous().is_ok());
        let c = cfg(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "x"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Torchrun);
        assert_eq!(
            c.rendezvous_addr.as_deref(),
            Some("m:29501"),
            "torchrun's agent owns MASTER_PORT"
        );
        assert_eq!(c.agent_store, None, "no TORCHELASTIC_USE_AGENT_STORE");
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
            c.agent_store,
            Some(("m:29500".into(), "ferrovod/r1/2/".into()))
        );
        let c =
            cfg(&[torchrun.as_slice(), &[("FERROVOD_RENDEZVOUS_ADDR", "a:1")]].concat()).unwrap();
        assert_eq!(c.agent_store, None, "an explicit address wins");
        let c = cfg(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "23456"),
        ])
        .unwrap();
        assert_eq!(c.rendezvous_addr.as_deref(), Some("m:23456"));
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
        assert_eq!(c.launcher, Launcher::None);
        let c = cfg(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_NODELIST", "gpu[007-009],cpu1"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Slurm);
        assert_eq!(c.rendezvous_addr.as_deref(), Some("gpu007:23456"));
        let c = cfg(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("FERROVOD_RENDEZVOUS_ADDR", "h:1"),
            ("FERROVOD_SECRET", "00ff"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Hydra);
        assert!(!c.secret_derived);
        // ferrovodrun's variables win over everything.
        let c = cfg(&[
            ("FERROVOD_RANK", "0"),
            ("FERROVOD_SIZE", "1"),
            ("RANK", "5"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Ferrovodrun);
    }

    #[test]
    fn a_trainer_torch_policy_pod_without_torchrun_is_one_rank() {
        let pet = [
            ("PET_NNODES", "3"),
            ("PET_NODE_RANK", "2"),
            ("PET_NPROC_PER_NODE", "1"),
            ("PET_MASTER_ADDR", "job-node-0-0.job"),
            ("PET_MASTER_PORT", "29500"),
        ];
        let c = cfg(&pet).unwrap();
        assert_eq!((c.launcher, c.rank, c.size), (Launcher::TrainerTorch, 2, 3));
        assert_eq!(c.rendezvous_addr.as_deref(), Some("job-node-0-0.job:29500"));
        assert!(c.rank0_hosts_store && c.secret_derived);
        // Under torchrun the workers' RANK wins: torchrun placed them.
        let mut under = pet.to_vec();
        under.extend([
            ("RANK", "5"),
            ("WORLD_SIZE", "6"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "1"),
        ]);
        assert_eq!(cfg(&under).unwrap().launcher, Launcher::Torchrun);
        let mut two = pet.to_vec();
        two[2] = ("PET_NPROC_PER_NODE", "2");
        let e = cfg(&two).unwrap_err().to_string();
        assert!(e.contains("PET_NPROC_PER_NODE=2 without torchrun"), "{e}");
        let e = cfg(&pet[..3]).unwrap_err().to_string();
        assert!(e.contains("PET_MASTER_ADDR"), "{e}");
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
        assert_eq!(c.secret.as_deref(), Some(&[0u8, 255, 16][..]));
    }

    fn tf(config: &str) -> Result<LaunchInfo> {
        cfg(&[("TF_CONFIG", config)])
    }

    /// An MXJob pod's DMLC_* and MX_CONFIG, as the mxnet-operator sets them.
    fn mxjob(role: &str, index: usize, workers: usize) -> Vec<(String, String)> {
        let hosts: Vec<String> = (0..workers)
            .map(|i| format!(r#"{{"url": "job-worker-{i}", "port": 9991}}"#))
            .collect();
        let config = format!(
            r#"{{"cluster": {{"scheduler": [{{"url": "job-scheduler-0", "port": 9991}}],
                "server": [{{"url": "job-server-0", "port": 9991}}], "worker": [{}]}},
                "labels": {{}}, "task": {{"type": "{role}", "index": {index}}}}}"#,
            hosts.join(", ")
        );
        [
            ("MX_CONFIG", config),
            ("DMLC_PS_ROOT_URI", "job-scheduler-0".into()),
            ("DMLC_PS_ROOT_PORT", "9991".into()),
            ("DMLC_NUM_SERVER", "1".into()),
            ("DMLC_NUM_WORKER", workers.to_string()),
            ("DMLC_ROLE", role.into()),
            ("DMLC_USE_KUBERNETES", "1".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn cfg_owned(pairs: &[(String, String)]) -> Result<LaunchInfo> {
        let refs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        cfg(&refs)
    }

    #[test]
    fn an_mxjob_worker_takes_its_index_and_worker_0_serves_the_store() {
        for index in 0..3 {
            let l = cfg_owned(&mxjob("worker", index, 3)).unwrap();
            assert_eq!((l.launcher, l.rank, l.size), (Launcher::Dmlc, index, 3));
            assert_eq!(l.rendezvous_addr.as_deref(), Some("job-worker-0:9991"));
            assert!(l.rank0_hosts_store && l.secret_derived);
        }
        // tools/launch.py: DMLC_WORKER_ID, worker 0 at the scheduler's address
        let l = cfg(&[
            ("DMLC_ROLE", "worker"),
            ("DMLC_PS_ROOT_URI", "127.0.0.1"),
            ("DMLC_PS_ROOT_PORT", "9300"),
            ("DMLC_NUM_WORKER", "2"),
            ("DMLC_NUM_SERVER", "1"),
            ("DMLC_WORKER_ID", "1"),
        ])
        .unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::Dmlc, 1, 2));
        assert_eq!(l.rendezvous_addr.as_deref(), Some("127.0.0.1:9300"));
        // tools/launch.py's local launcher: DMLC_TASK_ID
        let l = cfg(&[
            ("DMLC_ROLE", "worker"),
            ("DMLC_PS_ROOT_URI", "127.0.0.1"),
            ("DMLC_PS_ROOT_PORT", "9300"),
            ("DMLC_NUM_WORKER", "3"),
            ("DMLC_NUM_SERVER", "1"),
            ("DMLC_TASK_ID", "2"),
            ("DMLC_JOB_CLUSTER", "local"),
        ])
        .unwrap();
        assert_eq!((l.rank, l.size), (2, 3));
    }

    #[test]
    fn dmlc_errors_say_what_is_missing_or_wrong() {
        let err = |pairs: Vec<(String, String)>| cfg_owned(&pairs).unwrap_err().to_string();
        let without = |name: &str| {
            mxjob("worker", 0, 2)
                .into_iter()
                .filter(|(k, _)| k != name)
                .collect::<Vec<_>>()
        };
        let e = err(without("DMLC_NUM_WORKER"));
        assert!(e.contains("DMLC_NUM_WORKER is missing"), "{e}");
        let e = err(without("MX_CONFIG"));
        assert!(
            e.contains("neither MX_CONFIG") && e.contains("DMLC_WORKER_ID"),
            "{e}"
        );
        let e = err(mxjob("server", 0, 2));
        assert!(e.contains("need no server"), "{e}");
        let e = err(mxjob("scheduler", 0, 2));
        assert!(e.contains("need no scheduler"), "{e}");
        let mut odd = mxjob("worker", 0, 2);
        odd.iter_mut()
            .filter(|(k, _)| k == "DMLC_NUM_WORKER")
            .for_each(|(_, v)| *v = "3".into());
        let e = err(odd);
        assert!(
            e.contains("2 workers in cluster.worker but DMLC_NUM_WORKER=3"),
            "{e}"
        );
        let e = err(mxjob("worker", 2, 2));
        assert!(e.contains("worker 2 of DMLC_NUM_WORKER=2"), "{e}");
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
            let l = &c;
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
        assert_eq!((c.rank, c.size), (0, 3));
        assert_eq!(c.rendezvous_addr.as_deref(), Some("m:3"));
        let c = tf(
            r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 1}}"#,
        )
        .unwrap();
        assert_eq!((c.rank, c.size), (1, 2));
        assert_eq!(c.rendezvous_addr.as_deref(), Some("w0:1"));
        // Every rank derives the same secret; another cluster derives another one.
        let other = tf(
            r#"{"cluster": {"worker": ["x0:1", "x1:2"]}, "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap();
        let same = tf(
            r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap();
        assert_eq!(c.secret, same.secret);
        assert_ne!(c.secret, other.secret);
        // FERROVOD_RENDEZVOUS_ADDR and FERROVOD_SECRET win.
        let c = cfg(&[
            ("TF_CONFIG", r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 1}}"#),
            ("FERROVOD_RENDEZVOUS_ADDR", "r:9"),
            ("FERROVOD_SECRET", "0a0b"),
        ])
        .unwrap();
        assert_eq!(c.rendezvous_addr.as_deref(), Some("r:9"));
        assert_eq!(c.secret.as_deref(), Some(&[10u8, 11][..]));
        assert!(!c.secret_derived);
        // A single task needs no rendezvous; no cluster at all is no TFJob.
        let c = tf(r#"{"cluster": {"chief": ["c:1"]}, "task": {"type": "chief"}}"#).unwrap();
        assert_eq!((c.launcher, c.size), (Launcher::TfConfig, 1));
        assert_eq!(c.rendezvous_addr, None);
        assert_eq!(tf("{}").unwrap().launcher, Launcher::None);
        // torchrun's variables come first.
        let c = cfg(&[
            ("TF_CONFIG", "not json"),
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Torchrun);
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
    fn overrides_from_the_mpi_exchange_complete_an_mpi_launch() {
        // What Config::from_env_with layers over the environment.
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("FERROVOD_RENDEZVOUS_ADDR", "10.0.0.1:4000"),
            ("FERROVOD_SECRET", &secret_to_hex(&[1, 2, 255])),
        ])
        .unwrap();
        assert!(!c.needs_mpi_rendezvous());
        assert_eq!(c.secret.as_deref(), Some(&[1u8, 2, 255][..]));
        assert!(!c.secret_derived && c.rank0_hosts_store);
    }
}
