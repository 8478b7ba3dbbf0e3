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
fn a_job_whose_rank_is_handed_in_reads_no_launcher_variables() {
    let pairs = [
        ("WORLD_SIZE", "2"),
        ("FERROVOD_SECRET", "00ff"),
        ("FERROVOD_FUSION_THRESHOLD", "4096"),
    ];
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let err = cfg(&pairs).expect_err("half of torchrun's pair");
    assert!(err.to_string().contains("RANK is missing"), "{err}");
    let c = Config::read(|k| m.get(k).cloned(), false).unwrap();
    assert_eq!((c.launch.launcher, c.launch.size), (Launcher::None, 1));
    assert_eq!(c.launch.secret.as_deref(), Some(&[0x00, 0xff][..]));
    assert!(!c.launch.secret_derived);
    assert_eq!(c.fusion_threshold, 4096);
}

#[test]
fn an_elastic_worker_reads_what_its_launcher_set() {
    let e = cfg(&[]).unwrap().elastic;
    assert!(!e.enabled);
    assert_eq!((e.epoch, e.local_rank), (1, 0));
    assert_eq!(e.timeout, Duration::from_secs(600));
    let e = cfg(&[
        ("HOROVOD_ELASTIC", "1"),
        ("FERROVOD_ELASTIC_EPOCH", "7"),
        ("FERROVOD_LOCAL_RANK", "3"),
        ("HOROVOD_ELASTIC_TIMEOUT", "2.5"),
    ])
    .unwrap()
    .elastic;
    assert!(e.enabled);
    assert_eq!((e.epoch, e.local_rank), (7, 3));
    assert_eq!(e.timeout, Duration::from_millis(2500));
    let e = cfg(&[
        ("FERROVOD_ELASTIC_LOCAL_RANK", "5"),
        ("FERROVOD_LOCAL_RANK", "3"),
    ]);
    assert_eq!(e.unwrap().elastic.local_rank, 5);
    let err = cfg(&[("FERROVOD_ELASTIC_EPOCH", "first")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("FERROVOD_ELASTIC_EPOCH"), "{err}");
    let err = cfg(&[("FERROVOD_ELASTIC_TIMEOUT", "0")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("FERROVOD_ELASTIC_TIMEOUT"), "{err}");
}

#[test]
fn defaults_are_a_single_process() {
    let c = cfg(&[]).unwrap();
    assert_eq!((c.launch.rank, c.launch.size), (0, 1));
    assert_eq!(c.fusion_threshold, 128 << 20);
    assert_eq!(c.timeout, Duration::from_secs(30));
}

#[test]
fn every_default_in_the_table_is_the_one_in_force() {
    // Setting a variable to the default its row shows must change nothing: a default also
    // written in the parsing code, and different, would show here.
    let unset = format!("{:?}", cfg(&[]).unwrap());
    for v in VARS {
        // Rows whose default says what happens ("unset", "from host grouping") rather than
        // give a value, and the launch's rank and size, which mean a launcher only together.
        if v.default.contains(' ')
            || v.default == "unset"
            || matches!(v.name, "FERROVOD_RANK" | "FERROVOD_SIZE")
        {
            continue;
        }
        let set = format!("{:?}", cfg(&[(v.name, v.default)]).unwrap());
        assert_eq!(set, unset, "{}={}", v.name, v.default);
    }
    // The fast path's limit is also its default: the table must not promise more.
    assert_eq!(
        default_of("FERROVOD_FAST_PATH_BYTES"),
        crate::transport::offers::OFFER_DATA_BYTES.to_string()
    );
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
