//! The launch environment: which launcher started this process and what it says about the
//! job — rank, size, local ranks, the rendezvous address, the job secret — parsed from its
//! variables (ferrovodrun's, Open MPI's, Hydra's `PMI_*`, Slurm's, torchrun's and `TF_CONFIG`).
//!
//! It reads variables only through the functions [`detect`] is given: `config` is still the
//! one reader of the environment, and settings keep one parser (with the Horovod aliases).

use super::auth::secret_from_hex;
use crate::error::{Error, Result};

mod kubeflow;
pub use kubeflow::{dmlc_worker, parse_tf_config, DmlcWorker, TfJob};

/// How [`detect`] reads one of ferrovod's own variables: `(name found under, value)`.
pub type Lookup<'a> = dyn Fn(&str) -> Option<(String, String)> + 'a;

/// Which launcher started this process (docs/design.md, "Launch and bootstrap", in this order).
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
    /// torch.distributed's `init_process_group` with `backend="ferrovod"`: rank and size are
    /// torch's, and the job forms over the store torch hands the backend, whatever launched
    /// the process. Never detected from the environment; the front end says so.
    ProcessGroup,
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
            Launcher::ProcessGroup => {
                "torch.distributed's process group (the store torch hands the backend)"
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
            Launcher::ProcessGroup => "process_group",
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
    /// it with mpi4py and passes the result to the binding's `init`, which parses it with the
    /// environment it read: [`crate::config::Config::from_lookup_with`]).
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

/// One rank started by no launcher, with `secret`.
fn alone(secret: Option<Vec<u8>>) -> LaunchInfo {
    LaunchInfo {
        launcher: Launcher::None,
        rank0_hosts_store: false,
        rank: 0,
        size: 1,
        local: None,
        rendezvous_addr: None,
        secret,
        secret_derived: false,
        agent_store: None,
    }
}

/// `FERROVOD_SECRET`'s secret, decoded, when set.
fn given_secret(lookup: &Lookup<'_>) -> Result<Option<Vec<u8>>> {
    lookup("FERROVOD_SECRET")
        .map(|(_, hex)| {
            secret_from_hex(&hex)
                .map_err(|_| Error::InvalidArgument("FERROVOD_SECRET is not valid hex".into()))
        })
        .transpose()
}

/// The launch of a job whose rank and size are handed in rather than read from a launcher's
/// variables (see `Config::from_lookup_without_launch`): one rank, and the secret the user set.
pub fn placeholder(lookup: &Lookup<'_>) -> Result<LaunchInfo> {
    Ok(alone(given_secret(lookup)?))
}

/// Works out the launch environment (docs/design.md's order: ferrovodrun, MPI launchers, Slurm,
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
        return Ok(alone(None));
    };
    let secret = given_secret(lookup)?;
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
        Launcher::None | Launcher::ProcessGroup => unreachable!("returned above"),
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

#[cfg(test)]
mod tests;
