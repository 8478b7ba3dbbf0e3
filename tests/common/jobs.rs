//! In-process jobs for the engine suites: `n` engines, one per thread, each with its own
//! coordinator connection and data mesh, meeting at a real rendezvous store on 127.0.0.1.

use std::collections::HashMap;
use std::net::SocketAddr;

use _core::bootstrap::tcp_store::TcpStoreServer;
use _core::config::Config;
use _core::engine::{Engine, OpSpec, TensorBuf, TensorMeta, TensorSpec};
use _core::{DType, OpKind, ReduceOp};

/// Seconds a transfer may make no progress (`FERROVOD_TIMEOUT_SECONDS`): "promptly" in the
/// suites means well inside it.
pub const TIMEOUT_S: u64 = 10;

/// Rank `rank` of `size`, two ranks per host name (so shared memory and the local control
/// socket are used as on a real host).
pub fn config(rank: usize, size: usize, addr: SocketAddr, secret: &[u8]) -> Config {
    config_with(rank, size, addr, secret, &[])
}

/// [`config`] with more variables (`extra` wins over the defaults).
pub fn config_with(
    rank: usize,
    size: usize,
    addr: SocketAddr,
    secret: &[u8],
    extra: &[(&'static str, &str)],
) -> Config {
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let vars: HashMap<&str, String> = [
        ("FERROVOD_RANK", rank.to_string()),
        ("FERROVOD_SIZE", size.to_string()),
        ("FERROVOD_RENDEZVOUS_ADDR", addr.to_string()),
        ("FERROVOD_SECRET", hex),
        ("FERROVOD_HOSTNAME", format!("host{}", rank / 2)),
        ("FERROVOD_TIMEOUT_SECONDS", TIMEOUT_S.to_string()),
        ("FERROVOD_START_TIMEOUT", "20".into()),
        ("FERROVOD_DYNAMIC_PROCESS_SETS", "1".into()),
    ]
    .into_iter()
    .chain(extra.iter().map(|&(k, v)| (k, v.to_string())))
    .collect();
    Config::from_lookup(|k| vars.get(k).cloned()).unwrap()
}

/// Runs `f(rank, engine)` on `n` engines at once (with `sets` as `init(process_sets=...)`)
/// and returns the results in rank order.
pub fn job<R: Send>(
    n: usize,
    sets: &[Vec<usize>],
    secret: &[u8],
    f: impl Fn(usize, &mut Engine) -> R + Sync,
) -> Vec<R> {
    job_with(n, sets, secret, &[], f)
}

/// [`job`] with more configuration variables (see [`config_with`]).
pub fn job_with<R: Send>(
    n: usize,
    sets: &[Vec<usize>],
    secret: &[u8],
    extra: &[(&'static str, &str)],
    f: impl Fn(usize, &mut Engine) -> R + Sync,
) -> Vec<R> {
    job_each(n, sets, secret, |_| extra.to_vec(), f)
}

/// [`job`] with each rank on a host of its own (`host<rank>`).
pub fn job_one_per_host<R: Send>(
    n: usize,
    secret: &[u8],
    f: impl Fn(usize, &mut Engine) -> R + Sync,
) -> Vec<R> {
    const NAMES: [&str; 8] = [
        "host0", "host1", "host2", "host3", "host4", "host5", "host6", "host7",
    ];
    job_each(
        n,
        &[],
        secret,
        |rank| vec![("FERROVOD_HOSTNAME", NAMES[rank])],
        f,
    )
}

/// [`job`] with configuration variables of each rank's own.
pub fn job_each<'a, R: Send>(
    n: usize,
    sets: &[Vec<usize>],
    secret: &[u8],
    extra: impl Fn(usize) -> Vec<(&'static str, &'a str)> + Sync,
    f: impl Fn(usize, &mut Engine) -> R + Sync,
) -> Vec<R> {
    let server = TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), secret.to_vec()).unwrap();
    let addr = server.local_addr();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, extra) = (&f, &extra);
                s.spawn(move || {
                    let vars = extra(rank);
                    let mut engine =
                        Engine::start(&config_with(rank, n, addr, secret, &vars), sets, 0).unwrap();
                    let r = f(rank, &mut engine);
                    engine.shutdown();
                    r
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every rank of an `n`-rank job but `leaver` submits an allreduce that `leaver` never does
/// (it shuts down at once); each must fail promptly, naming it.
pub fn assert_a_leaver_is_named(
    n: usize,
    leaver: usize,
    secret: &[u8],
    extra: &[(&'static str, &str)],
) {
    // The others shut down only once all have their result: rank 0 (the coordinator) gone
    // early would rightly be reported instead.
    let all = std::sync::Barrier::new(n - 1);
    let results = job_with(n, &[], secret, extra, |rank, e| {
        if rank == leaver {
            return None;
        }
        let h = e
            .submit(allreduce_op("never", &[1.0], ReduceOp::Sum, 0))
            .unwrap();
        let start = std::time::Instant::now();
        let r = h.wait(std::time::Duration::ZERO).expect("first wait");
        let took = start.elapsed();
        all.wait();
        Some((r.err(), took))
    });
    for (err, took) in results.into_iter().flatten() {
        let err = err.expect("the op must fail");
        assert!(err.to_string().contains(&format!("rank {leaver}")), "{err}");
        assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn f32_from(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// An allreduce of `data` (float32) into an engine-owned output of the same size.
pub fn allreduce_op(name: &str, data: &[f32], op: ReduceOp, set_id: u32) -> OpSpec {
    let bytes = f32_bytes(data);
    OpSpec {
        set_id,
        name: name.into(),
        base_at: 0,
        kind: OpKind::Allreduce,
        op,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        tensors: vec![TensorSpec {
            meta: TensorMeta {
                dtype: DType::F32,
                shape: vec![data.len()],
            },
            output: Some(TensorBuf::Owned(vec![0; bytes.len()])),
            input: TensorBuf::Owned(bytes),
        }],
        splits: vec![],
    }
}
