//! The launch variables of TensorFlow and MXNet jobs: `TF_CONFIG` (Kubeflow's TFJob,
//! `tf.distribute`) and `DMLC_*` with `MX_CONFIG` (Kubeflow's MXJob, MXNet's `tools/launch.py`).
//! Both can describe the whole cluster in JSON, whose parsing and errors are kept apart from the
//! order of detection in the parent module.

use serde_json::Value as Json;

use super::{check_rendezvous_addr, int_of, unset};
use crate::error::{Error, Result};

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
