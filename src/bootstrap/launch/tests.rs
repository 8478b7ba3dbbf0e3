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
    let c = cfg(&[torchrun.as_slice(), &[("FERROVOD_RENDEZVOUS_ADDR", "a:1")]].concat()).unwrap();
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
    let c =
        tf(r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 1}}"#)
            .unwrap();
    assert_eq!((c.rank, c.size), (1, 2));
    assert_eq!(c.rendezvous_addr.as_deref(), Some("w0:1"));
    // Every rank derives the same secret; another cluster derives another one.
    let other =
        tf(r#"{"cluster": {"worker": ["x0:1", "x1:2"]}, "task": {"type": "worker", "index": 0}}"#)
            .unwrap();
    let same =
        tf(r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 0}}"#)
            .unwrap();
    assert_eq!(c.secret, same.secret);
    assert_ne!(c.secret, other.secret);
    // FERROVOD_RENDEZVOUS_ADDR and FERROVOD_SECRET win.
    let c = cfg(&[
        (
            "TF_CONFIG",
            r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 1}}"#,
        ),
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
        e.contains("TF_CONFIG") && e.contains("not valid JSON") && e.contains("EOF while parsing"),
        "{e}"
    );
    let e = err("{'cluster': 1}");
    assert!(
        e.contains("TF_CONFIG") && e.contains("not valid JSON"),
        "{e}"
    );
    let e =
        err(r#"{"cluster": {"worker": ["w0:1", "w1:2"]}, "task": {"type": "worker", "index": 2}}"#);
    assert!(
        e.contains("index 2 is out of range") && e.contains("2 entries"),
        "{e}"
    );
    let e = err(r#"{"cluster": {"worker": ["w0:1"]}, "task": {"type": "chief", "index": 0}}"#);
    assert!(e.contains("out of range"), "{e}");
    let e = err(r#"{"cluster": {"worker": ["w0:1"]}, "task": {"type": "worker", "index": -1}}"#);
    assert!(e.contains("not a non-negative integer"), "{e}");
    let e = err(r#"{"cluster": {"worker": ["w0:1"]}}"#);
    assert!(e.contains("no \"task\""), "{e}");
    let e =
        err(r#"{"cluster": {"worker": ["w0", "w1:2"]}, "task": {"type": "worker", "index": 1}}"#);
    assert!(e.contains("\"w0\" is not \"host:port\""), "{e}");
    let e = err(r#"{"cluster": {"worker": [3]}, "task": {"type": "worker"}}"#);
    assert!(e.contains("not a \"host:port\" string"), "{e}");
    let e = err("[1]");
    assert!(e.contains("not a JSON object"), "{e}");
}

#[test]
fn overrides_from_the_mpi_exchange_complete_an_mpi_launch() {
    // What Config::from_lookup_with layers over the environment.
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
