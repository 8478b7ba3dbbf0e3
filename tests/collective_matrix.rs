//! Every collective with 1..5 ranks as threads over real loopback TCP, against references
//! computed here independently (sequential folds in i128 / f64), on every dtype and op, odd
//! sizes, sizes below the rank count, large sizes, sub-set communicators, and small `Tuning`
//! values that force the ring, chunking and pipelining paths onto small buffers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use _core::collective;
use _core::comm::{Communicator, Tuning};
use _core::error::Error;
use _core::{DType, ReduceOp, Reduction};

mod common;
use common::*;

const IDLE: Duration = Duration::from_secs(20);
const REDUCIBLE: [DType; 9] = DType::REDUCIBLE;
const OPS: [ReduceOp; 5] = ReduceOp::ELEMENTWISE;

/// Forces the ring for anything over one element and cuts steps into odd-sized chunks
/// (36 bytes: rounded down to whole elements for 8-byte types).
fn tiny() -> Tuning {
    Tuning {
        small_allreduce_bytes: 8,
        chunk_bytes: 36,
        ..Tuning::default()
    }
}

/// Ring for large buffers, with several chunks per step.
fn medium() -> Tuning {
    Tuning {
        small_allreduce_bytes: 1024,
        chunk_bytes: 16 * 1024,
        ..Tuning::default()
    }
}

/// Runs `body` on every member of every set (disjoint lists of global ranks of one `n`-rank
/// TCP mesh), all sets at once; returns `out[set][set_rank]`.
fn run_sets<R: Send>(
    n: usize,
    sets: &[Vec<usize>],
    tuning: &Tuning,
    body: impl Fn(usize, &mut Communicator<'_>) -> R + Sync,
) -> Vec<Vec<R>> {
    let mut mesh = _core::testing::tcp_mesh(n, b"secret").expect("mesh");
    std::thread::scope(|s| {
        let mut handles: Vec<Vec<_>> = sets.iter().map(|_| Vec::new()).collect();
        for (g, t) in mesh.iter_mut().enumerate() {
            let Some(si) = sets.iter().position(|m| m.contains(&g)) else {
                continue;
            };
            let (members, body, tuning) = (&sets[si], &body, tuning.clone());
            let h = s.spawn(move || {
                let mut comm = Communicator::new(t, members, IDLE, tuning);
                body(si, &mut comm)
            });
            handles[si].push((g, h));
        }
        handles
            .into_iter()
            .map(|mut hs| {
                hs.sort_by_key(|(g, _)| *g);
                hs.into_iter()
                    .map(|(_, h)| h.join().expect("rank panicked"))
                    .collect()
            })
            .collect()
    })
}

/// All `n` ranks as one set.
fn run<R: Send>(
    n: usize,
    tuning: &Tuning,
    body: impl Fn(&mut Communicator<'_>) -> R + Sync,
) -> Vec<R> {
    run_sets(n, &[(0..n).collect()], tuning, |_, c| body(c)).remove(0)
}

#[test]
fn allreduce_every_dtype_and_op_on_small_sizes() {
    for n in 1usize..=5 {
        for (tname, tuning) in [("default", Tuning::default()), ("tiny", tiny())] {
            let counts = [0, 1, n - 1, 7, 1023];
            let results = run(n, &tuning, |c| {
                let mut out = Vec::new();
                for dtype in REDUCIBLE {
                    for op in OPS {
                        for count in counts {
                            out.push(allreduce_one(c, dtype, op, count));
                        }
                    }
                }
                out
            });
            let mut k = 0;
            for dtype in REDUCIBLE {
                for op in OPS {
                    for count in counts {
                        let per_rank: Vec<Vec<u8>> = results.iter().map(|r| r[k].clone()).collect();
                        let what =
                            format!("n={n} {tname} {} {} count={count}", dtype.name(), op.name());
                        check_allreduce(dtype, op, count, &per_rank, &what);
                        k += 1;
                    }
                }
            }
        }
    }
}

/// Recursive doubling with 2, 3 and 4 ranks folded in (6, 7 ranks) and with none (8).
#[test]
fn allreduce_small_path_on_more_ranks() {
    let cases = [
        (DType::F32, ReduceOp::Sum),
        (DType::I8, ReduceOp::Product),
        (DType::F16, ReduceOp::Min),
        (DType::I64, ReduceOp::Max),
    ];
    for n in 6..=8 {
        let counts = [1, 5, 100];
        let results = run(n, &Tuning::default(), |c| {
            let mut out = Vec::new();
            for (dtype, op) in cases {
                for count in counts {
                    out.push(allreduce_one(c, dtype, op, count));
                }
            }
            out
        });
        let mut k = 0;
        for (dtype, op) in cases {
            for count in counts {
                let per_rank: Vec<Vec<u8>> = results.iter().map(|r| r[k].clone()).collect();
                let what = format!("n={n} {} {} count={count}", dtype.name(), op.name());
                check_allreduce(dtype, op, count, &per_rank, &what);
                k += 1;
            }
        }
    }
}

#[test]
fn allreduce_large() {
    let cases = [
        (DType::F32, ReduceOp::Sum),
        (DType::I64, ReduceOp::Product),
        (DType::BF16, ReduceOp::Max),
        (DType::U8, ReduceOp::Sum),
    ];
    for n in [2, 3, 5] {
        for (tname, tuning) in [("default", Tuning::default()), ("medium", medium())] {
            let count = 300_001;
            let results = run(n, &tuning, |c| {
                cases.map(|(dtype, op)| allreduce_one(c, dtype, op, count))
            });
            for (k, (dtype, op)) in cases.iter().enumerate() {
                let per_rank: Vec<Vec<u8>> = results.iter().map(|r| r[k].clone()).collect();
                let what = format!("n={n} {tname} {} {} large", dtype.name(), op.name());
                check_allreduce(*dtype, *op, count, &per_rank, &what);
            }
        }
    }
}

/// The engine's post-scale folded into the allreduce gives the same bits as scaling after it,
/// on every path (small, ring with one or several chunks per step, one rank), and every rank
/// gets them.
#[test]
fn allreduce_scaled_equals_allreduce_then_scale() {
    for n in 1usize..=4 {
        for (tname, tuning) in [
            ("default", Tuning::default()),
            ("tiny", tiny()),
            ("medium", medium()),
        ] {
            // Many exchanges of 36-byte chunks add up: the tiny tuning stays small.
            let large = if tname == "tiny" { 257 } else { 100_003 };
            let cases = scale_cases(&[0, 1, n + 1, 1023, large]);
            let results = run(n, &tuning, |c| scaled_and_after(c, &cases));
            check_scaled(&results, &cases, &format!("n={n} {tname}"));
        }
    }
}

/// The ring allreduce shares each chunk of a rank's segment as soon as it is final; that must
/// give the bits of the reduce-scatter and the allgather run one after the other, with uneven
/// and empty segments, one chunk or many per step, and a post-scale. The reduce-scatter that
/// reads its input in place (the public reducescatter's) must give the in-place ring's bits
/// for this rank's segment and leave its input as it was; so must the allreduce into new
/// memory for the whole result.
#[test]
fn ring_sharing_final_chunks_equals_reduce_scatter_then_allgather() {
    let cases = [
        (DType::F32, ReduceOp::Sum, 0.5),
        (DType::BF16, ReduceOp::Sum, 1.0 / 3.0),
        (DType::F64, ReduceOp::Product, 1.0),
        (DType::I32, ReduceOp::Max, 1.0),
    ];
    for n in 2usize..=5 {
        for (tname, tuning) in [("tiny", tiny()), ("medium", medium())] {
            let counts = [n - 1, n + 1, 257, 10_007];
            let results = run(n, &tuning, |c| {
                let mut out = Vec::new();
                for (dtype, op, factor) in cases {
                    for count in counts {
                        let vals: Vec<V> = (0..count)
                            .map(|i| match dtype {
                                DType::I32 => input(dtype, op, c.rank(), i, n),
                                _ => V::F(messy(dtype, c.rank(), i)),
                            })
                            .collect();
                        let mut fused = encode(dtype, &vals);
                        collective::allreduce::ring(
                            c,
                            &mut fused,
                            Reduction::new(dtype, op).scaled(factor),
                        )
                        .unwrap();
                        // Horovod's split: the lowest `count % n` segments hold one more.
                        let es = dtype.size();
                        let mut segs = Vec::new();
                        let mut at = 0;
                        for r in 0..n {
                            let len = (count / n + usize::from(r < count % n)) * es;
                            segs.push(at..at + len);
                            at += len;
                        }
                        let mut apart = encode(dtype, &vals);
                        collective::reducescatter::ring_reduce_scatter(
                            c,
                            &mut apart,
                            &segs,
                            Reduction::new(dtype, op).scaled(factor),
                        )
                        .unwrap();
                        let original = encode(dtype, &vals);
                        let mine = &segs[c.rank()];
                        let mut into = vec![0x5Au8; mine.len()];
                        let mut scratch = vec![0xA5u8; original.len()];
                        collective::reducescatter::ring_reduce_scatter_into(
                            c,
                            &original,
                            &mut scratch,
                            &segs,
                            Reduction::new(dtype, op).scaled(factor),
                            &mut into,
                        )
                        .unwrap();
                        assert_eq!(original, encode(dtype, &vals), "input was written");
                        assert_eq!(
                            into,
                            &apart[mine.clone()],
                            "n={n} {tname} {} {} count={count}: reduce-scatter into an \
                             output differs from the in-place ring on rank {}",
                            dtype.name(),
                            op.name(),
                            c.rank()
                        );
                        // Into new memory (any contents), the input only read: the bits of
                        // the in-place ring, through the ring itself and through the
                        // dispatcher (which takes the small path below its threshold).
                        let mut ring_into = vec![0x3Cu8; original.len()];
                        collective::allreduce::ring_into(
                            c,
                            &original,
                            &mut ring_into,
                            Reduction::new(dtype, op).scaled(factor),
                        )
                        .unwrap();
                        let mut scaled_into = vec![0xC3u8; original.len()];
                        collective::allreduce_into(
                            c,
                            &original,
                            &mut scaled_into,
                            Reduction::new(dtype, op).scaled(factor),
                        )
                        .unwrap();
                        let mut scaled = encode(dtype, &vals);
                        collective::allreduce(
                            c,
                            &mut scaled,
                            Reduction::new(dtype, op).scaled(factor),
                        )
                        .unwrap();
                        assert_eq!(original, encode(dtype, &vals), "input was written");
                        let what = format!(
                            "n={n} {tname} {} {} count={count} rank {}",
                            dtype.name(),
                            op.name(),
                            c.rank()
                        );
                        assert_eq!(ring_into, fused, "{what}: ring into an output differs");
                        assert_eq!(
                            scaled_into, scaled,
                            "{what}: allreduce into an output differs"
                        );
                        collective::allgather::ring_allgather(c, &mut apart, &segs).unwrap();
                        out.push((fused, apart));
                    }
                }
                out
            });
            let mut k = 0;
            for (dtype, op, _) in cases {
                for count in counts {
                    let what =
                        format!("n={n} {tname} {} {} count={count}", dtype.name(), op.name());
                    for (r, res) in results.iter().enumerate() {
                        assert_eq!(
                            res[k].0, res[k].1,
                            "{what}: rank {r} fused differs from apart"
                        );
                        assert_eq!(
                            res[k].0, results[0][k].0,
                            "{what}: rank {r} differs from rank 0"
                        );
                    }
                    k += 1;
                }
            }
        }
    }
}

/// Inputs whose float sums depend on the order of addition (wide magnitudes, signed zeros for
/// min/max): ranks must still agree bit for bit, on every algorithm path.
#[test]
fn float_allreduce_is_bitwise_identical_across_ranks() {
    for n in 2..=5 {
        for (tname, tuning) in [("default", Tuning::default()), ("tiny", tiny())] {
            let results = run(n, &tuning, |c| messy_allreduces(c, 257));
            check_messy(&results, &format!("n={n} {tname}"));
        }
    }
}

#[test]
fn allreduce_rejects_bool_integer_adasum_and_partial_elements() {
    let errs = run(2, &Tuning::default(), |c| {
        let mut b = vec![1u8; 8];
        [
            collective::allreduce(c, &mut b, Reduction::new(DType::Bool, ReduceOp::Sum)),
            collective::allreduce(c, &mut b, Reduction::new(DType::I32, ReduceOp::Adasum)),
            collective::allreduce(c, &mut b[..6], Reduction::new(DType::F32, ReduceOp::Sum)),
        ]
    });
    for e in errs.into_iter().flatten() {
        assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    }
}

/// Bytes rank `r` contributes in test `salt`.
fn block(r: usize, len: usize, salt: u64) -> Vec<u8> {
    (0..len).map(|i| hash(r, i, salt) as u8).collect()
}

#[test]
fn allgatherv_broadcast_alltoallv() {
    for n in 1..=5 {
        for (tname, tuning) in [("default", Tuning::default()), ("tiny", tiny())] {
            // allgatherv: patterns with zeros, all-zero, and one large enough for the ring.
            let patterns: Vec<Vec<usize>> = vec![
                (0..n).map(|r| (r * 3 + 1) % 5).collect(),
                vec![0; n],
                (0..n)
                    .map(|r| if r % 2 == 0 { 0 } else { 1000 + r })
                    .collect(),
                (0..n).map(|r| 30_000 + 7 * r).collect(),
            ];
            let bcast_sizes = [0usize, 1, 1000, 70_001];
            let a2a = |r: usize, p: usize| (r * 7 + p * 3) % 4 * (1 + (r + p) % 3 * 5000);
            let results = run(n, &tuning, |c| {
                let r = c.rank();
                let mut gathered = Vec::new();
                for (k, counts) in patterns.iter().enumerate() {
                    let mut out = vec![0u8; counts.iter().sum()];
                    let input = block(r, counts[r], k as u64);
                    collective::allgatherv(c, &input, &mut out, counts).unwrap();
                    // In place: garbage everywhere but this rank's block.
                    let mut inplace = vec![0xEEu8; out.len()];
                    let own: usize = counts[..r].iter().sum();
                    inplace[own..own + counts[r]].copy_from_slice(&input);
                    collective::allgatherv_in_place(c, &mut inplace, counts).unwrap();
                    assert!(inplace == out, "rank {r}: allgatherv_in_place pattern {k}");
                    gathered.push(out);
                }
                let mut bcast = Vec::new();
                for root in 0..n {
                    for &len in &bcast_sizes {
                        let mut buf = if r == root {
                            block(root, len, 77)
                        } else {
                            vec![0; len]
                        };
                        collective::broadcast(c, &mut buf, root).unwrap();
                        bcast.push(buf);
                    }
                }
                let send: Vec<usize> = (0..n).map(|p| a2a(r, p)).collect();
                let recv: Vec<usize> = (0..n).map(|p| a2a(p, r)).collect();
                let input: Vec<u8> = (0..n).flat_map(|p| block(r * 10 + p, send[p], 5)).collect();
                let mut out = vec![0u8; recv.iter().sum()];
                collective::alltoallv(c, &input, &send, &mut out, &recv).unwrap();
                (gathered, bcast, out)
            });
            for (r, (gathered, bcast, a2a_out)) in results.iter().enumerate() {
                let what = format!("n={n} {tname} rank {r}");
                for (k, counts) in patterns.iter().enumerate() {
                    let want: Vec<u8> =
                        (0..n).flat_map(|q| block(q, counts[q], k as u64)).collect();
                    assert!(gathered[k] == want, "{what}: allgatherv pattern {k}");
                }
                for root in 0..n {
                    for (j, &len) in bcast_sizes.iter().enumerate() {
                        let got = &bcast[root * bcast_sizes.len() + j];
                        assert!(
                            *got == block(root, len, 77),
                            "{what}: broadcast root {root} len {len}"
                        );
                    }
                }
                let want: Vec<u8> = (0..n)
                    .flat_map(|p| block(p * 10 + r, a2a(p, r), 5))
                    .collect();
                assert!(*a2a_out == want, "{what}: alltoallv");
            }
        }
    }
}

/// The small-payload choice in alltoallv is made from each rank's own counts, so one rank may
/// take the direct exchange while its peers go pairwise; the two must interoperate.
#[test]
fn alltoallv_with_ranks_on_different_paths() {
    for n in 2..=5 {
        // Rank 0 sends 250 bytes to everyone and gets 10 back: ≤ 1024 both ways, so it goes
        // direct; the others receive 250 + 300·(n-2), over 1024 from n = 4 on.
        let count = |r: usize, p: usize| match (r, p) {
            (0, _) => 250,
            (_, 0) => 10,
            _ => 300,
        };
        let outs = run(n, &medium(), |c| {
            let r = c.rank();
            let send: Vec<usize> = (0..n).map(|p| count(r, p)).collect();
            let recv: Vec<usize> = (0..n).map(|p| count(p, r)).collect();
            let input: Vec<u8> = (0..n).flat_map(|p| block(r * 10 + p, send[p], 8)).collect();
            let mut out = vec![0u8; recv.iter().sum()];
            collective::alltoallv(c, &input, &send, &mut out, &recv).unwrap();
            out
        });
        for (r, out) in outs.iter().enumerate() {
            let want: Vec<u8> = (0..n)
                .flat_map(|p| block(p * 10 + r, count(p, r), 8))
                .collect();
            assert!(*out == want, "n={n} rank {r}");
        }
    }
}

/// Reducescatter of i32 sums and f32 minima with uneven segments (zeros, one rank holding
/// nearly all), and the Horovod split (lowest ranks get the extra rows).
#[test]
fn reducescatter_variable_segments() {
    for n in 1..=5 {
        for (tname, tuning) in [("default", Tuning::default()), ("tiny", tiny())] {
            let layouts: Vec<Vec<usize>> = vec![
                (0..n)
                    .map(|r| 1023 / n + usize::from(r < 1023 % n))
                    .collect(),
                (0..n).map(|r| (r * 5 + 2) % 4).collect(),
                (0..n)
                    .map(|r| if r == n / 2 { 40_000 } else { r % 2 })
                    .collect(),
                vec![0; n],
            ];
            let cases = [(DType::I32, ReduceOp::Sum), (DType::F32, ReduceOp::Min)];
            let results = run(n, &tuning, |c| {
                let (r, n) = (c.rank(), c.size());
                let mut out = Vec::new();
                for layout in &layouts {
                    for (dtype, op) in cases {
                        let count: usize = layout.iter().sum();
                        let vals: Vec<V> = (0..count).map(|i| input(dtype, op, r, i, n)).collect();
                        let buf = encode(dtype, &vals);
                        let bytes: Vec<usize> = layout.iter().map(|e| e * dtype.size()).collect();
                        let mut mine = vec![0u8; bytes[r]];
                        let mut scratch = vec![0xEEu8; buf.len()];
                        collective::reducescatter(
                            c,
                            &buf,
                            &mut scratch,
                            &bytes,
                            Reduction::new(dtype, op),
                            &mut mine,
                        )
                        .unwrap();
                        assert_eq!(buf, encode(dtype, &vals), "reducescatter wrote its input");
                        // In place: the same bits in this rank's segment of the buffer.
                        let mut inplace = buf.clone();
                        collective::reducescatter_in_place(
                            c,
                            &mut inplace,
                            &bytes,
                            Reduction::new(dtype, op),
                        )
                        .unwrap();
                        let own: usize = bytes[..r].iter().sum();
                        assert!(
                            inplace[own..own + bytes[r]] == mine[..],
                            "rank {r}: reducescatter_in_place differs"
                        );
                        out.push(mine);
                    }
                }
                out
            });
            for (r, res) in results.iter().enumerate() {
                let mut k = 0;
                for layout in &layouts {
                    let start: usize = layout[..r].iter().sum();
                    for (dtype, op) in cases {
                        let got = decode(dtype, &res[k]);
                        assert_eq!(got.len(), layout[r]);
                        for (j, g) in got.iter().enumerate() {
                            let i = start + j;
                            let inputs: Vec<V> =
                                (0..n).map(|q| input(dtype, op, q, i, n)).collect();
                            let inputs = decode(dtype, &encode(dtype, &inputs));
                            let what = format!("n={n} {tname} rank {r} {:?} element {i}", dtype);
                            check_elem(dtype, op, *g, fold(dtype, op, &inputs), &inputs, &what);
                        }
                        k += 1;
                    }
                }
            }
        }
    }
}

/// Ranks arrive at staggered times; after each barrier every rank must see all arrivals.
#[test]
fn barrier_waits_for_everyone() {
    for n in 1..=5 {
        let arrived = AtomicUsize::new(0);
        let seen = run(n, &Tuning::default(), |c| {
            let mut seen = Vec::new();
            for round in 0..3 {
                std::thread::sleep(Duration::from_millis(((c.rank() + round) % n * 15) as u64));
                arrived.fetch_add(1, Ordering::SeqCst);
                collective::barrier(c).unwrap();
                seen.push(arrived.load(Ordering::SeqCst));
                // A second barrier keeps the next round's increments out of this round's view.
                collective::barrier(c).unwrap();
            }
            seen
        });
        for (r, s) in seen.iter().enumerate() {
            for (round, &count) in s.iter().enumerate() {
                assert_eq!(count, n * (round + 1), "n={n} rank {r} round {round}");
            }
        }
    }
}

/// Two process sets of one 5-rank mesh run at the same time: [1, 3, 4] and [0, 2].
#[test]
fn subset_communicators_run_side_by_side() {
    let sets = vec![vec![1, 3, 4], vec![0, 2]];
    for tuning in [Tuning::default(), tiny()] {
        let results = run_sets(5, &sets, &tuning, |si, c| {
            let (r, n) = (c.rank(), c.size());
            let mut sums = Vec::new();
            for count in [1, 2, 1023] {
                sums.push(allreduce_one(c, DType::F32, ReduceOp::Sum, count));
                sums.push(allreduce_one(c, DType::I16, ReduceOp::Product, count));
            }
            let counts: Vec<usize> = (0..n).map(|q| q * 100 + si).collect();
            let mut gathered = vec![0u8; counts.iter().sum()];
            collective::allgatherv(c, &block(r, counts[r], 3), &mut gathered, &counts).unwrap();
            let mut b = if r == n - 1 {
                block(9, 5000, 1)
            } else {
                vec![0; 5000]
            };
            collective::broadcast(c, &mut b, n - 1).unwrap();
            collective::barrier(c).unwrap();
            (sums, gathered, b)
        });
        for (si, set) in sets.iter().enumerate() {
            let n = set.len();
            let per: Vec<_> = results[si].iter().collect();
            let mut k = 0;
            for count in [1, 2, 1023] {
                for (dtype, op) in [(DType::F32, ReduceOp::Sum), (DType::I16, ReduceOp::Product)] {
                    let res: Vec<Vec<u8>> = per.iter().map(|x| x.0[k].clone()).collect();
                    check_allreduce(
                        dtype,
                        op,
                        count,
                        &res,
                        &format!("set {set:?} count {count}"),
                    );
                    k += 1;
                }
            }
            let counts: Vec<usize> = (0..n).map(|q| q * 100 + si).collect();
            let want: Vec<u8> = (0..n).flat_map(|q| block(q, counts[q], 3)).collect();
            for (_, g, b) in &per {
                assert!(*g == want, "set {set:?} allgatherv");
                assert!(*b == block(9, 5000, 1), "set {set:?} broadcast");
            }
        }
    }
}

#[test]
fn bad_arguments_are_errors_not_hangs() {
    let errs = run(3, &Tuning::default(), |c| {
        let mut b = vec![0u8; 4];
        let mut b2 = vec![0u8; 4];
        let mut out = vec![0u8; 4];
        let mut out2 = vec![0u8; if c.rank() == 1 { 4 } else { 0 }];
        vec![
            collective::broadcast(c, &mut b, 3),
            collective::allgatherv(c, &b, &mut out, &[4, 0]),
            collective::allgatherv(c, &b[..2], &mut out, &[4, 0, 0]),
            collective::alltoallv(c, &b, &[4, 0, 0], &mut out, &[0, 4]),
            collective::reducescatter(
                c,
                &b,
                &mut b2,
                &[2, 2, 0],
                Reduction::new(DType::F32, ReduceOp::Sum),
                &mut out,
            ),
            collective::reducescatter(
                c,
                &b,
                &mut b2,
                &[4, 0, 0],
                Reduction::new(DType::Bool, ReduceOp::Sum),
                &mut out,
            ),
            // Three ranks need room for partial sums in transit.
            collective::reducescatter(
                c,
                &b,
                &mut [],
                &[0, 4, 0],
                Reduction::new(DType::F32, ReduceOp::Sum),
                &mut out2,
            ),
        ]
    });
    for (r, es) in errs.iter().enumerate() {
        for (k, e) in es.iter().enumerate() {
            assert!(
                matches!(e, Err(Error::InvalidArgument(_))),
                "rank {r} case {k}: {e:?}"
            );
        }
    }
}
