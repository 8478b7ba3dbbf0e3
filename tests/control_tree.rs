//! The control tree: with a small `FERROVOD_CONTROL_FANOUT`, control messages pass through
//! relays (ranks with children) on their way to and from the coordinator. N engines (one per
//! thread, two ranks per host name, so host leaders relay across "hosts" and a fanout of 1
//! makes a chain) negotiate named ops, fused and cached, on the global set and on process
//! sets, a mismatch, a join, a relay that shuts down while the ranks below it go on, and a
//! rank leaving while others wait for it.

use std::time::Duration;

use _core::engine::{Engine, SetScope};
use _core::{Error, ReduceOp};
use common::jobs::{allreduce_op, f32_from};

mod common;

const SECRET: &[u8] = b"control-tree-test-secret-0123456";

fn job<R: Send>(
    n: usize,
    fanout: &str,
    sets: &[Vec<usize>],
    f: impl Fn(usize, &mut Engine) -> R + Sync,
) -> Vec<R> {
    common::jobs::job_with(n, sets, SECRET, &[("FERROVOD_CONTROL_FANOUT", fanout)], f)
}

fn result_f32(h: &_core::engine::Handle) -> Result<Vec<f32>, Error> {
    let out = h.wait(Duration::ZERO).expect("first wait")?;
    Ok(f32_from(out.tensors[0].0.as_slice()))
}

/// Rank `rank`'s input for name `i` of round `round` (lengths differ per name).
fn input(rank: usize, i: usize, round: usize) -> Vec<f32> {
    (0..(i * 13 + 1))
        .map(|k| (rank * 100 + k * 3 + round) as f32)
        .collect()
}

fn sum_of(ranks: &[usize], i: usize, round: usize) -> Vec<f32> {
    (0..(i * 13 + 1))
        .map(|k| ranks.iter().map(|&r| input(r, i, round)[k]).sum::<f32>())
        .collect()
}

#[test]
fn ops_through_relays_match_fuse_cache_and_reach_process_sets() {
    for (n, fanout) in [(8, "2"), (7, "1")] {
        let sets = vec![vec![1, 3, 4, 6], vec![0, 5]];
        let results = job(n, fanout, &sets, |rank, e| {
            for round in 0..4 {
                // Every rank submits the same names in its own order: the relays pass the
                // first (full) submissions and then the cached ids.
                let mut names: Vec<usize> = (0..5).collect();
                names.rotate_left(rank % 5);
                let handles: Vec<_> = names
                    .iter()
                    .map(|&i| {
                        let op = allreduce_op(
                            &format!("g{i}"),
                            &input(rank, i, round),
                            ReduceOp::Sum,
                            0,
                        );
                        (i, e.submit(op).unwrap())
                    })
                    .collect();
                let all: Vec<usize> = (0..n).collect();
                for (i, h) in handles {
                    assert_eq!(
                        result_f32(&h).unwrap(),
                        sum_of(&all, i, round),
                        "rank {rank} g{i}"
                    );
                }
                for (id, members) in sets.iter().enumerate() {
                    if members.contains(&rank) && members.iter().all(|&m| m < n) {
                        let op =
                            allreduce_op("s", &input(rank, 2, round), ReduceOp::Sum, id as u32 + 1);
                        let got = result_f32(&e.submit(op).unwrap()).unwrap();
                        assert_eq!(got, sum_of(members, 2, round), "rank {rank} set {id}");
                    }
                }
            }
            // A set added at run time reaches every relay on its way down.
            let id = e
                .add_process_set(vec![2, n - 1], SetScope::EveryRank)
                .wait()
                .unwrap();
            if rank == 2 || rank == n - 1 {
                let op = allreduce_op("late", &[rank as f32], ReduceOp::Max, id);
                assert_eq!(
                    result_f32(&e.submit(op).unwrap()).unwrap(),
                    vec![(n - 1) as f32]
                );
            }
            assert!(e.remove_process_set(id).wait().unwrap());
            // A set its members register alone (torch.distributed's groups): the others never
            // ask, and the answer finds its members through the relays.
            let members = [1, n - 2];
            if members.contains(&rank) {
                let id = e
                    .add_process_set(members.to_vec(), SetScope::Members { timeout: None })
                    .wait()
                    .unwrap();
                let op = allreduce_op("members", &[rank as f32 + 1.0], ReduceOp::Sum, id);
                assert_eq!(
                    result_f32(&e.submit(op).unwrap()).unwrap(),
                    vec![(n - 2 + 1 + 2) as f32]
                );
            }
            // Rank 0's coordinator serves the members until they are done.
            let op = allreduce_op("done", &[1.0], ReduceOp::Sum, 0);
            assert_eq!(result_f32(&e.submit(op).unwrap()).unwrap(), vec![n as f32]);
            rank
        });
        assert_eq!(results, (0..n).collect::<Vec<_>>());
    }
}

#[test]
fn a_straggler_below_two_relays_is_waited_for_after_they_pass_on_what_they_held() {
    // Fanout 1 over 6 ranks, two per host: 0 <- 1, 0 <- 2 <- 4, 2 <- 3, 4 <- 5. With a stall
    // check of 1 s a relay holds a cached submission 125 ms; rank 5 is 400 ms late every
    // round, so rank 4's relay passes rank 4's submission on by itself, under rank 4, and
    // rank 2's relay must not take that for rank 4's node's claim for 4 and 5.
    let extra = [
        ("FERROVOD_CONTROL_FANOUT", "1"),
        ("FERROVOD_STALL_CHECK_TIME_SECONDS", "1"),
    ];
    let results = common::jobs::job_with(6, &[], SECRET, &extra, |rank, e| {
        (0..4)
            .map(|round| {
                if rank == 5 && round > 0 {
                    std::thread::sleep(Duration::from_millis(400));
                }
                let op = allreduce_op("late", &[rank as f32, round as f32], ReduceOp::Sum, 0);
                result_f32(&e.submit(op).unwrap()).unwrap()
            })
            .collect::<Vec<_>>()
    });
    for (rank, sums) in results.into_iter().enumerate() {
        for (round, s) in sums.into_iter().enumerate() {
            assert_eq!(
                s,
                vec![15.0, 6.0 * round as f32],
                "rank {rank} round {round}"
            );
        }
    }
}

#[test]
fn mismatch_and_join_through_relays_reach_every_rank() {
    let n = 6;
    let results = job(n, "1", &[], |rank, e| {
        let len = if rank == 5 { 3 } else { 2 };
        let err = result_f32(
            &e.submit(allreduce_op("w", &vec![1.0; len], ReduceOp::Sum, 0))
                .unwrap(),
        )
        .unwrap_err();
        let mut sums = Vec::new();
        if rank != 3 {
            for step in 0..3 {
                let op = allreduce_op(&format!("j{step}"), &[6.0, rank as f32], ReduceOp::Sum, 0);
                sums.push(result_f32(&e.submit(op).unwrap()).unwrap());
            }
        }
        let last = e.join().wait(Duration::ZERO).unwrap().unwrap().last_joined;
        (err, sums, last)
    });
    for (rank, (err, sums, last)) in results.into_iter().enumerate() {
        match err {
            Error::Mismatch { name, message } => {
                assert_eq!(name, "w");
                assert!(message.contains("rank 5 sent [3]"), "{message}");
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
        assert!(last.is_some(), "rank {rank}");
        for s in sums {
            // Rank 3 joined at once and contributes zeros.
            assert_eq!(s, vec![30.0, 12.0], "rank {rank}");
        }
    }
}

#[test]
fn a_relay_that_shuts_down_first_keeps_carrying_the_ranks_below_it() {
    // Fanout 1 over 6 ranks, two per host: 0 <- 1, 0 <- 2 <- 4 (leaders), 2 <- 3, 4 <- 5. Rank
    // 2 relays for 3, 4 and 5, and shuts down before they run ops among themselves.
    // Rank 0 stays: the coordinator's end is every rank's.
    let sets = vec![vec![3, 4, 5]];
    let stayers = std::sync::Barrier::new(5);
    let results = job(6, "1", &sets, |rank, e| {
        if rank == 2 {
            return Vec::new();
        }
        let sums = if rank >= 3 {
            std::thread::sleep(Duration::from_millis(300));
            (0..20)
                .map(|i| {
                    let op = allreduce_op(
                        &format!("after{i}"),
                        &[rank as f32, i as f32],
                        ReduceOp::Sum,
                        1,
                    );
                    result_f32(&e.submit(op).unwrap()).unwrap()
                })
                .collect()
        } else {
            Vec::new()
        };
        stayers.wait();
        sums
    });
    for (rank, sums) in results.into_iter().enumerate().skip(3) {
        for (i, s) in sums.into_iter().enumerate() {
            assert_eq!(s, vec![12.0, 3.0 * i as f32], "rank {rank} op {i}");
        }
    }
}

#[test]
fn a_rank_that_leaves_below_a_relay_fails_the_ops_waiting_for_it_naming_it() {
    common::jobs::assert_a_leaver_is_named(6, 5, SECRET, &[("FERROVOD_CONTROL_FANOUT", "1")]);
}
