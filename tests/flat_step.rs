//! The training step's flat buffer (`engine::FlatStep`) in real in-process jobs: on host
//! memory (every rank maps every segment) and on the rings (the ranks share nothing), its
//! allreduce, and a sharded update's `reduce_shard` and `publish`, against sums computed here
//! for 2 and 3 ranks, float32 and float64, sizes below the rank count (empty shards) and odd
//! ones. An agreement one rank refuses reduces nothing anywhere; a prescale takes the rings'
//! in-place ops on either route and scales each rank's input.

use _core::engine::{Engine, FlatSpec, Route};
use _core::{DType, ReduceOp};

mod common;

const SECRET: &[u8] = b"flat-step-test-secret-0123456789";

fn job<R: Send>(n: usize, f: impl Fn(usize, &mut Engine) -> R + Sync) -> Vec<R> {
    common::jobs::job(n, &[], SECRET, f)
}

fn never() -> bool {
    false
}

fn spec(
    rank: usize,
    n: usize,
    what: &str,
    dtype: DType,
    count: usize,
    sharded: bool,
    share: bool,
) -> FlatSpec {
    FlatSpec {
        set_id: 0,
        rank,
        size: n,
        name: format!("flat_grads.{what}.{}.{count}", dtype.name()),
        count,
        dtype,
        sharded,
        share,
        alone: false,
    }
}

/// Element `i` of rank `r`'s gradients in round `round`: small integers, so that every sum
/// is exact in either dtype whatever order it is added in.
fn value(r: usize, i: usize, round: usize) -> f64 {
    ((i * 7 + r * 13 + round * 5) % 19) as f64 - 9.0
}

fn encode(dtype: DType, vals: impl Iterator<Item = f64>, out: &mut [u8]) {
    let size = dtype.size();
    for (chunk, v) in out.chunks_exact_mut(size).zip(vals) {
        match dtype {
            DType::F32 => chunk.copy_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => chunk.copy_from_slice(&v.to_le_bytes()),
            _ => unreachable!("the tests use float32 and float64"),
        }
    }
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            _ => unreachable!("the tests use float32 and float64"),
        })
        .collect()
}

fn sums(n: usize, count: usize, round: usize) -> Vec<f64> {
    (0..count)
        .map(|i| (0..n).map(|r| value(r, i, round)).sum())
        .collect()
}

const CASES: [(DType, usize); 4] = [
    (DType::F32, 1),
    (DType::F64, 2),
    (DType::F32, 1001),
    (DType::F64, 4099),
];

#[test]
fn allreduce_on_either_route_sums_every_ranks_buffer_into_each() {
    for n in [2, 3] {
        for share in [true, false] {
            job(n, |rank, e| {
                let door = e.door();
                for (dtype, count) in CASES {
                    let what = format!("n={n} share={share} {} x{count}", dtype.name());
                    let step = door
                        .flat_step(spec(rank, n, "ar", dtype, count, false, share), &never)
                        .unwrap()
                        .expect("every rank has memory");
                    let route = if share {
                        Route::HostMemory
                    } else {
                        Route::Rings
                    };
                    assert_eq!(step.route(), route, "{what}");
                    let fill = |round| {
                        step.with_grads(|b| {
                            encode(dtype, (0..count).map(|i| value(rank, i, round)), b)
                        })
                        .unwrap()
                    };
                    let grads = || step.with_grads(|b| decode(dtype, b)).unwrap();
                    for round in 0..2 {
                        fill(round);
                        let all = step.allreduce(&door, true, ReduceOp::Sum, (1.0, 1.0), &never);
                        assert!(all.unwrap(), "{what}: every rank was ready");
                        assert_eq!(
                            grads(),
                            sums(n, count, round),
                            "{what} rank {rank} round {round}"
                        );
                    }
                    // Average over the ranks, times a postscale.
                    fill(2);
                    assert!(step
                        .allreduce(&door, true, ReduceOp::Average, (1.0, 3.0), &never)
                        .unwrap());
                    for (i, (got, s)) in grads().into_iter().zip(sums(n, count, 2)).enumerate() {
                        let want = s * 3.0 / n as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                            "{what}: [{i}] {got} != {want}"
                        );
                    }
                    // A prescale scales each rank's input before the sum (the rings' ops).
                    fill(3);
                    assert!(step
                        .allreduce(&door, true, ReduceOp::Sum, (0.5, 4.0), &never)
                        .unwrap());
                    let want: Vec<f64> = sums(n, count, 3).iter().map(|s| s * 2.0).collect();
                    assert_eq!(grads(), want, "{what}: prescaled");
                    // The last rank is not ready: nothing is reduced on any rank.
                    fill(4);
                    let all =
                        step.allreduce(&door, rank + 1 < n, ReduceOp::Sum, (1.0, 1.0), &never);
                    assert!(!all.unwrap(), "{what}: rank {} was not ready", n - 1);
                    let own: Vec<f64> = (0..count).map(|i| value(rank, i, 4)).collect();
                    assert_eq!(grads(), own, "{what}: refused, yet reduced");
                }
            });
        }
    }
}

#[test]
fn a_sharded_update_reduces_each_shard_and_publishes_every_one_to_every_rank() {
    for n in [2, 3] {
        for share in [true, false] {
            job(n, |rank, e| {
                let door = e.door();
                for (dtype, count) in CASES {
                    let what = format!("n={n} share={share} {} x{count}", dtype.name());
                    let step = door
                        .flat_step(spec(rank, n, "sharded", dtype, count, true, share), &never)
                        .unwrap()
                        .expect("every rank has memory");
                    let esize = dtype.size();
                    let shard = step.shard();
                    let (lo, hi) = (shard.start / esize, shard.end / esize);
                    assert!(lo <= hi && hi <= count, "{what}: shard {shard:?}");
                    // Each rank writes its shard of the parameters; published, every rank sees
                    // them all.
                    let mut params: Vec<f64> = (0..count).map(|i| (i * 3) as f64).collect();
                    step.with_params(|b| {
                        encode(dtype, params[lo..hi].iter().copied(), &mut b[shard.clone()])
                    })
                    .unwrap();
                    step.publish(&door, &never).unwrap();
                    assert_eq!(
                        step.with_params(|b| decode(dtype, b)).unwrap(),
                        params,
                        "{what}: published"
                    );
                    for round in 0..3 {
                        step.with_grads(|b| {
                            encode(dtype, (0..count).map(|i| value(rank, i, round)), b)
                        })
                        .unwrap();
                        let all = step.reduce_shard(&door, true, ReduceOp::Sum, (1.0, 1.0), &never);
                        assert!(all.unwrap(), "{what}: every rank was ready");
                        let s = sums(n, count, round);
                        let reduced = step
                            .with_grads(|b| decode(dtype, &b[shard.clone()]))
                            .unwrap();
                        assert_eq!(
                            reduced,
                            s[lo..hi],
                            "{what} rank {rank} round {round}: shard"
                        );
                        // The update: this rank's shard of the parameters plus its gradients.
                        for i in lo..hi {
                            params[i] += s[i];
                        }
                        step.with_params(|b| {
                            encode(dtype, params[lo..hi].iter().copied(), &mut b[shard.clone()])
                        })
                        .unwrap();
                        step.publish(&door, &never).unwrap();
                        for i in (0..lo).chain(hi..count) {
                            params[i] += s[i];
                        }
                        let seen = step.with_params(|b| decode(dtype, b)).unwrap();
                        assert_eq!(seen, params, "{what} rank {rank} round {round}: parameters");
                    }
                }
            });
        }
    }
}

#[test]
fn a_step_made_alone_meets_no_one_and_takes_the_rings() {
    // Rank 1 makes its object only once rank 0 has made its own: made collectively, rank 0's
    // would wait for rank 1 and fail at the engine's timeout.
    let made = std::sync::Barrier::new(2);
    job(2, |rank, e| {
        let door = e.door();
        let mut s = spec(rank, 2, "alone", DType::F32, 5, false, true);
        s.alone = true;
        if rank == 1 {
            made.wait();
        }
        let step = door.flat_step(s, &never).unwrap().expect("memory");
        if rank == 0 {
            made.wait();
        }
        assert_eq!(step.route(), Route::Rings);
        step.with_grads(|b| encode(DType::F32, (0..5).map(|i| value(rank, i, 0)), b))
            .unwrap();
        assert!(step
            .allreduce(&door, true, ReduceOp::Sum, (1.0, 1.0), &never)
            .unwrap());
        let got = step.with_grads(|b| decode(DType::F32, b)).unwrap();
        assert_eq!(got, sums(2, 5, 0));
        assert!(
            step.publish(&door, &never).is_err(),
            "made without parameters"
        );
    });
}
