//! Forming a job again in the same process leaves nothing of the earlier one behind: 50 rounds
//! of start, one allreduce and shutdown, on 2 ranks as threads with real links over loopback
//! (shared memory, the coordinator's local socket and its control rings, TCP to the store),
//! counting this process's open descriptors and threads.
//!
//! Alternate rounds meet at a store the test keeps for every round (as ferrovodrun's outlives
//! a re-init; each round is a new generation) and at a store rank 0 serves itself (as under
//! mpirun), so that store's thread and sockets are counted too. The suite is its own test
//! binary because other tests running beside it in one process would change the counts.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use _core::bootstrap::tcp_store::TcpStoreServer;
use _core::config::Config;
use _core::engine::Engine;
use _core::ReduceOp;
use common::jobs::{allreduce_op, f32_from, TIMEOUT_S};

mod common;

const SECRET: &[u8] = b"reform-test-secret-0123456789abcd";
const RANKS: usize = 2;
const ROUNDS: u64 = 50;

/// Rank `rank`'s settings for round `round`: ferrovodrun's variables (the test's store) on even
/// rounds, Open MPI's with a given address (rank 0 serves the store there) on odd ones.
fn config(rank: usize, round: u64, kept_store: SocketAddr, own_store: SocketAddr) -> Config {
    let hex: String = SECRET.iter().map(|b| format!("{b:02x}")).collect();
    let (rank_var, size_var, addr) = if round % 2 == 0 {
        ("FERROVOD_RANK", "FERROVOD_SIZE", kept_store)
    } else {
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", own_store)
    };
    let vars: HashMap<&str, String> = [
        (rank_var, rank.to_string()),
        (size_var, RANKS.to_string()),
        ("FERROVOD_RENDEZVOUS_ADDR", addr.to_string()),
        ("FERROVOD_SECRET", hex),
        ("FERROVOD_HOSTNAME", "host0".into()),
        ("FERROVOD_TIMEOUT_SECONDS", TIMEOUT_S.to_string()),
        ("FERROVOD_START_TIMEOUT", "20".into()),
    ]
    .into_iter()
    .collect();
    Config::from_lookup(|k| vars.get(k).cloned()).unwrap()
}

fn round(n: u64, kept_store: SocketAddr, own_store: SocketAddr) {
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..RANKS)
            .map(|rank| {
                s.spawn(move || {
                    let config = config(rank, n, kept_store, own_store);
                    let mut engine = Engine::start(&config, &[], n).unwrap();
                    let data = [rank as f32 + 1.0; 5];
                    let h = engine
                        .submit(allreduce_op("x", &data, ReduceOp::Sum, 0))
                        .unwrap();
                    let out = h.wait(Duration::ZERO).expect("first wait").unwrap();
                    assert_eq!(f32_from(out.tensors[0].0.as_slice()), [3.0; 5], "round {n}");
                    engine.shutdown();
                })
            })
            .collect();
        for r in ranks {
            r.join().unwrap();
        }
    });
}

/// (open descriptors, threads, memory mappings) of this process. A shared-memory segment
/// still mapped after its descriptor closed shows in the last.
fn counts() -> (usize, usize, usize) {
    let n = |dir: &str| std::fs::read_dir(dir).unwrap().count();
    let maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count();
    (n("/proc/self/fd"), n("/proc/self/task"), maps)
}

/// The counts once they hold still for 200 ms (up to 5 s): a store server's per-client thread
/// ends just after its client hangs up, not before `shutdown()` returns.
fn settled() -> (usize, usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = counts();
    let mut since = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let now = counts();
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= Duration::from_millis(200) || Instant::now() > deadline {
            return now;
        }
    }
}

#[test]
fn fifty_formings_leave_no_descriptors_or_threads_behind() {
    let kept = TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), SECRET.to_vec()).unwrap();
    // A port nothing listens on now, for the store rank 0 serves in odd rounds.
    let own = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let before = counts();
    // The first rounds (one of each kind) create what lives as long as the process (e.g. the
    // log crate's and the transport's lazily made globals); later rounds must add nothing.
    round(0, kept.local_addr(), own);
    round(1, kept.local_addr(), own);
    let base = settled();
    for n in 2..ROUNDS {
        round(n, kept.local_addr(), own);
    }
    let after = settled();
    eprintln!(
        "(fds, threads, mappings): {before:?} before any job, {base:?} after 2 rounds, \
         {after:?} after {ROUNDS}"
    );
    assert_eq!(
        (after.0, after.1),
        (base.0, base.1),
        "(descriptors, threads) after {ROUNDS} rounds, against after the first two"
    );
    // A round that left a segment mapped would add a mapping or two every round. A few are
    // allowed for the allocator: glibc keeps an arena, and a cached stack, per thread that was
    // ever alive at once, and a round may overlap its threads a little more than the first two.
    assert!(
        after.2 <= base.2 + 8,
        "{} memory mappings after {ROUNDS} rounds, {} after the first two",
        after.2,
        base.2
    );
}
