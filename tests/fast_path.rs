//! The fast path of small blocking allreduces (`engine::fast`), on in-process jobs: ranks on
//! one host reduce without the coordinator, an offer that meets another rank's engine op goes
//! to the engine (and still completes, with the right sum), and ranks on two hosts never offer.

use std::time::Duration;

use _core::engine::fast::Outcome;
use _core::engine::{Engine, OpSpec, Ran};
use _core::ReduceOp;
use common::jobs::{allreduce_op, f32_from};

mod common;

const SECRET: &[u8] = b"fast-path-test-secret-0123456789";

fn op(name: &str, data: &[f32]) -> OpSpec {
    allreduce_op(name, data, ReduceOp::Sum, 0)
}

/// A blocking allreduce through the engine's entry, as every adapter's: the outcome of its
/// offer to the fast path and the result.
fn blocking(e: &Engine, spec: OpSpec) -> (Outcome, Vec<f32>) {
    match e.run(spec, Some(&|| false)).expect("run") {
        Ran::Done(out) => (Outcome::Done, f32_from(out.tensors[0].0.as_slice())),
        // An engine op hands an owned output back through its handle.
        Ran::Queued(h, outcome) => (outcome, wait_sum(&h)),
    }
}

fn wait_sum(h: &_core::engine::Handle) -> Vec<f32> {
    let out = h.wait(Duration::ZERO).expect("first wait").expect("op");
    f32_from(out.tensors[0].0.as_slice())
}

#[test]
fn blocking_allreduces_on_one_host_take_the_fast_path_and_fall_back_when_ranks_differ() {
    // Two ranks: both on host0 (see common::jobs::config).
    let results = common::jobs::job(2, &[], SECRET, |rank, e| {
        let mut outcomes = Vec::new();
        for i in 0..600usize {
            let data: Vec<f32> = (0..7).map(|k| (rank * 100 + i + k) as f32).collect();
            let expect: Vec<f32> = (0..7).map(|k| (100 + 2 * (i + k)) as f32).collect();
            if i % 10 == 9 {
                // Rank 0 has an engine op in flight when it reaches the blocking one, so it
                // declines; rank 1 offers first and meets that decline.
                let x = op(&format!("x{i}"), &data);
                if rank == 0 {
                    let hx = e.submit(x).unwrap();
                    let (o, got) = blocking(e, op(&format!("y{i}"), &data));
                    assert_eq!((o, &got), (Outcome::Ineligible, &expect));
                    hx.wait(Duration::ZERO).unwrap().unwrap();
                } else {
                    let (o, got) = blocking(e, op(&format!("y{i}"), &data));
                    assert_eq!((o, &got), (Outcome::Declined, &expect));
                    e.submit(x).unwrap().wait(Duration::ZERO).unwrap().unwrap();
                }
                outcomes.push(o_marker(rank));
                continue;
            }
            let (o, got) = blocking(e, op(&format!("a{}", i % 3), &data));
            assert_eq!(o, Outcome::Done, "rank {rank} op {i}");
            assert_eq!(got, expect, "rank {rank} op {i}");
            outcomes.push(o);
        }
        (outcomes, e.fast_path().stats())
    });
    for (rank, (outcomes, (taken, declined))) in results.into_iter().enumerate() {
        let done = outcomes.iter().filter(|&&o| o == Outcome::Done).count() as u64;
        assert_eq!(done, 540, "rank {rank}");
        assert_eq!(taken, 540, "rank {rank}");
        // Rank 1's offers met rank 0's declines; rank 0 never offered then.
        assert_eq!(declined, if rank == 1 { 60 } else { 0 }, "rank {rank}");
    }
}

fn o_marker(rank: usize) -> Outcome {
    if rank == 0 {
        Outcome::Ineligible
    } else {
        Outcome::Declined
    }
}

#[test]
fn ranks_on_two_hosts_never_offer() {
    // Ranks 0 and 1 share host0, rank 2 is alone on host1: no rank reaches every other over
    // shared memory, so every blocking allreduce goes through the engine.
    let results = common::jobs::job(3, &[], SECRET, |rank, e| {
        for i in 0..50usize {
            let data = vec![(rank + i) as f32; 3];
            let (o, got) = blocking(e, op(&format!("b{i}"), &data));
            assert_eq!(o, Outcome::Ineligible, "rank {rank} op {i}");
            assert_eq!(got, vec![(3 * i + 3) as f32; 3], "rank {rank} op {i}");
        }
        e.fast_path().stats()
    });
    assert!(results.iter().all(|&s| s == (0, 0)), "{results:?}");
}

#[test]
fn ranks_run_ahead_of_a_slow_reader_without_losing_an_offer() {
    // Four ranks on two-core machines: a rank that finished slot s offers s + 1 at once, into
    // its other record, while a peer may still be about to read its offer of s. Every op
    // reduces other values (and lengths), so a record read in the wrong slot gives a wrong sum,
    // and a missed offer a decline.
    const N: usize = 4;
    let one_host = [("FERROVOD_HOSTNAME", "host0")];
    let results = common::jobs::job_with(N, &[], SECRET, &one_host, |rank, e| {
        for i in 0..1500usize {
            let len = 1 + (i * 7) % 41;
            let data: Vec<f32> = (0..len).map(|k| (rank * 1000 + i + k) as f32).collect();
            let expect: Vec<f32> = (0..len)
                .map(|k| (0..N).map(|r| (r * 1000 + i + k) as f32).sum())
                .collect();
            if rank == (i / 100) % N && i % 7 == 0 {
                // One rank at a time falls behind now and then.
                std::thread::sleep(Duration::from_micros(300));
            }
            let (o, got) = blocking(e, op(&format!("r{}", i % 5), &data));
            assert_eq!(o, Outcome::Done, "rank {rank} op {i}");
            assert_eq!(got, expect, "rank {rank} op {i}");
        }
        e.fast_path().stats()
    });
    assert!(results.iter().all(|&s| s == (1500, 0)), "{results:?}");
}

#[test]
fn split_allreduces_sum_every_segment_and_run_ahead_safely() {
    // Five ranks (segments of unequal length) and tensors whose inputs add up to at least
    // the split size, between small unsplit ones: each rank reduces one segment and copies
    // the others' from their records, so a segment read in the wrong slot, or before its
    // owner reduced it, gives a wrong sum somewhere.
    const N: usize = 5;
    let one_host = [("FERROVOD_HOSTNAME", "host0")];
    let results = common::jobs::job_with(N, &[], SECRET, &one_host, |rank, e| {
        for i in 0..300usize {
            let len = [16384, 13109, 7, 16381, 14000, 1][i % 6];
            let data: Vec<f32> = (0..len)
                .map(|k| ((rank * 31 + i * 7 + k) % 1000) as f32)
                .collect();
            let expect: Vec<f32> = (0..len)
                .map(|k| (0..N).map(|r| ((r * 31 + i * 7 + k) % 1000) as f32).sum())
                .collect();
            if rank == (i / 50) % N && i % 5 == 0 {
                std::thread::sleep(Duration::from_micros(500));
            }
            let (o, got) = blocking(e, op(&format!("s{}", i % 4), &data));
            assert_eq!(o, Outcome::Done, "rank {rank} op {i}");
            assert!(
                got == expect,
                "rank {rank} op {i} (length {len}): wrong sums"
            );
        }
        e.fast_path().stats()
    });
    assert!(results.iter().all(|&s| s == (300, 0)), "{results:?}");
}

#[test]
fn one_rank_per_host_agrees_across_hosts_and_falls_back_when_ranks_differ() {
    // Three ranks, each on a host of its own: blocking allreduces agree over the fast path's
    // connections. Every tenth op rank 0 has an engine op in flight, so it declines, and the
    // others' offers are answered with its decline; every 25th op rank 2 offers another shape,
    // so no rank's offer is fast and the engine reports the difference on every rank.
    const N: usize = 3;
    let results = common::jobs::job_one_per_host(N, SECRET, |rank, e| {
        let (mut done, mut declined, mut refused) = (0u64, 0u64, 0u64);
        for i in 0..400usize {
            let len = 1 + (i * 5) % 19;
            let data: Vec<f32> = (0..len).map(|k| (rank * 100 + i + k) as f32).collect();
            let expect: Vec<f32> = (0..len)
                .map(|k| (0..N).map(|r| (r * 100 + i + k) as f32).sum())
                .collect();
            if i % 25 == 24 {
                let mut mine = data.clone();
                if rank == 2 {
                    mine.push(0.0);
                }
                let len_mine = mine.len();
                let r = e
                    .run(op(&format!("odd{i}"), &mine), Some(&|| false))
                    .expect("run");
                let Ran::Queued(h, o) = r else {
                    panic!("rank {rank} op {i}: shapes differ, yet it was reduced")
                };
                assert_eq!(o, Outcome::Declined, "rank {rank} op {i} ({len_mine})");
                let Some(Err(err)) = h.wait(Duration::ZERO) else {
                    panic!("rank {rank} op {i}: shapes differ, yet the engine reduced them")
                };
                assert!(err.to_string().contains("odd"), "rank {rank} op {i}: {err}");
                refused += 1;
                continue;
            }
            if i % 10 == 9 {
                let x = op(&format!("x{i}"), &data);
                if rank == 0 {
                    let hx = e.submit(x).unwrap();
                    let (o, got) = blocking(e, op(&format!("y{i}"), &data));
                    assert_eq!((o, &got), (Outcome::Ineligible, &expect), "op {i}");
                    hx.wait(Duration::ZERO).unwrap().unwrap();
                } else {
                    let (o, got) = blocking(e, op(&format!("y{i}"), &data));
                    assert_eq!(
                        (o, &got),
                        (Outcome::Declined, &expect),
                        "rank {rank} op {i}"
                    );
                    e.submit(x).unwrap().wait(Duration::ZERO).unwrap().unwrap();
                    declined += 1;
                }
                continue;
            }
            let (o, got) = blocking(e, op(&format!("a{}", i % 3), &data));
            assert_eq!(o, Outcome::Done, "rank {rank} op {i}");
            assert_eq!(got, expect, "rank {rank} op {i}");
            done += 1;
        }
        (done, declined, refused, e.fast_path().stats())
    });
    for (rank, (done, declined, refused, (taken, not_taken))) in results.into_iter().enumerate() {
        assert_eq!(done, taken, "rank {rank}");
        // 16 ops of two shapes (i % 25 == 24), 32 met rank 0's engine op (i % 10 == 9, less
        // the 8 of those that are also of two shapes).
        assert_eq!(done, 400 - 16 - 32, "rank {rank}");
        assert_eq!(refused, 16, "rank {rank}");
        assert_eq!(not_taken, declined + refused, "rank {rank}");
    }
}

#[test]
fn a_rank_that_closes_turns_the_fast_path_off_across_hosts() {
    // Rank 1 joins after the first ops: its closed post makes the others' offers decline, and
    // every later op goes through the engine, with the joined rank's part as Horovod's join
    // gives it (nothing), on every rank alike.
    let results = common::jobs::job_one_per_host(2, SECRET, |rank, e| {
        for i in 0..20usize {
            let (o, got) = blocking(e, op("warm", &[rank as f32 + 1.0, i as f32]));
            assert_eq!(
                (o, got),
                (Outcome::Done, vec![3.0, 2.0 * i as f32]),
                "rank {rank}"
            );
        }
        if rank == 1 {
            e.join().wait(Duration::ZERO).unwrap().unwrap();
            return (e.fast_path().stats(), e.fast_path().max_bytes());
        }
        let (o, got) = blocking(e, op("after", &[5.0, 6.0]));
        assert_ne!(o, Outcome::Done, "an offer met a rank that joined");
        assert_eq!(got, vec![5.0, 6.0]);
        e.join().wait(Duration::ZERO).unwrap().unwrap();
        (e.fast_path().stats(), e.fast_path().max_bytes())
    });
    assert_eq!(results[1].0, (20, 0), "{results:?}");
    assert_eq!(results[0].0 .0, 20, "{results:?}");
    assert!(results.iter().all(|r| r.1 == 0), "{results:?}");
}
