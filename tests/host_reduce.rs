//! The collectives over host memory (`collective::host_memory`): the reduce-scatter that
//! reads its inputs there and the allgather of the shards from their owners. Threads stand for
//! the ranks of one host, each with its own segment shared through real memfds and Unix
//! sockets, and every rank's shard is checked against sums computed here element by element,
//! for several rank counts, dtypes, reductions and odd sizes (shards that cross the reduce's
//! chunks, empty shards); every rank's gathered bytes against their owners' marks.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use _core::engine;
use _core::transport::host_memory::{Exposed, HostMemory};
use _core::{DType, ReduceOp, Reduction};

/// Segments of `len` bytes shared among `n` threads; `f(rank, memory, barrier)` runs on each.
fn on_host<T: Send + 'static>(
    n: usize,
    len: usize,
    f: impl Fn(usize, HostMemory, &Barrier) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let exposed: Vec<Exposed> = (0..n).map(|_| Exposed::new(len).unwrap()).collect();
    let addrs: Vec<Vec<u8>> = exposed.iter().map(|e| e.address().to_vec()).collect();
    let (f, barrier) = (Arc::new(f), Arc::new(Barrier::new(n)));
    let threads: Vec<_> = exposed
        .into_iter()
        .enumerate()
        .map(|(r, e)| {
            let (a, f, b) = (addrs.clone(), f.clone(), barrier.clone());
            thread::spawn(move || {
                let mem = e.share(&a, r, Duration::from_secs(10)).unwrap();
                assert!(mem.complete(), "rank {r} mapped {:?}", mem.mapped());
                f(r, mem, &b)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Horovod's split of `rows` over `n` ranks: rank `r`'s first row and count.
fn split(rows: usize, n: usize, r: usize) -> (usize, usize) {
    (
        r * (rows / n) + r.min(rows % n),
        rows / n + usize::from(r < rows % n),
    )
}

/// Element `i` of rank `r`'s input, as f64 (converted to each dtype by the callers).
fn value(r: usize, i: usize) -> f64 {
    ((i * 7 + r * 13) % 23) as f64 - 11.0 + (r as f64) * 0.125
}

macro_rules! check_dtype {
    ($t:ty, $dtype:expr, $n:expr, $rows:expr, $op:expr, $factor:expr, $fold:expr) => {{
        let (n, rows, op, factor): (usize, usize, ReduceOp, f64) = ($n, $rows, $op, $factor);
        let esize = std::mem::size_of::<$t>();
        let results = on_host(n, rows * esize, move |r, mem, barrier| {
            mem.with_range(0..rows * esize, |own, _| {
                for (i, e) in own.chunks_exact_mut(esize).enumerate() {
                    e.copy_from_slice(&(value(r, i) as $t).to_le_bytes());
                }
                Ok(())
            })
            .unwrap();
            barrier.wait(); // every input final
            let (lo, count) = split(rows, n, r);
            let range = lo * esize..(lo + count) * esize;
            engine::reduce_shard_in_host_memory(
                &mem,
                range.clone(),
                Reduction::new($dtype, op).scaled(factor),
            )
            .unwrap();
            barrier.wait(); // every shard reduced: nobody writes what another reads
            mem.with_range(range, |own, _| Ok(own.to_vec())).unwrap()
        });
        for (r, got) in results.iter().enumerate() {
            let (lo, count) = split(rows, n, r);
            assert_eq!(got.len(), count * esize);
            for k in 0..count {
                let i = lo + k;
                // This rank's element first, then the others' in rank order.
                let mut acc = value(r, i) as $t;
                for p in (0..n).filter(|&p| p != r) {
                    acc = $fold(acc, value(p, i) as $t);
                }
                let want = if factor == 1.0 {
                    acc
                } else {
                    (acc as f64 * factor) as $t
                };
                let got = <$t>::from_le_bytes(got[k * esize..(k + 1) * esize].try_into().unwrap());
                assert_eq!(
                    got.to_le_bytes(),
                    want.to_le_bytes(),
                    "{:?} {op:?} on {n} ranks, {rows} rows: rank {r} element {i}: {got} != {want}",
                    $dtype
                );
            }
        }
    }};
}

#[test]
fn every_rank_reduces_its_shard_from_the_others_memory() {
    for n in 2..=4 {
        // Shards across the 64 KiB chunks, odd counts, and fewer rows than ranks.
        for rows in [1usize, 3, 1001, 50_003] {
            check_dtype!(
                f32,
                DType::F32,
                n,
                rows,
                ReduceOp::Sum,
                1.0,
                |a: f32, b: f32| a + b
            );
            check_dtype!(
                f64,
                DType::F64,
                n,
                rows,
                ReduceOp::Average,
                0.5,
                |a: f64, b: f64| a + b
            );
            check_dtype!(
                i32,
                DType::I32,
                n,
                rows,
                ReduceOp::Max,
                1.0,
                |a: i32, b: i32| a.max(b)
            );
            check_dtype!(
                i64,
                DType::I64,
                n,
                rows,
                ReduceOp::Min,
                1.0,
                |a: i64, b: i64| a.min(b)
            );
        }
    }
}

#[test]
fn bad_ranges_and_reductions_are_refused() {
    let errors = on_host(2, 64, |_, mem, _| {
        [
            engine::reduce_shard_in_host_memory(
                &mem,
                2..6,
                Reduction::new(DType::F32, ReduceOp::Sum),
            ),
            engine::reduce_shard_in_host_memory(
                &mem,
                0..6,
                Reduction::new(DType::F32, ReduceOp::Sum),
            ),
            engine::reduce_shard_in_host_memory(
                &mem,
                0..68,
                Reduction::new(DType::F32, ReduceOp::Sum),
            ),
            engine::reduce_shard_in_host_memory(
                &mem,
                0..8,
                Reduction::new(DType::Bool, ReduceOp::Sum),
            ),
        ]
        .map(|r| r.unwrap_err().to_string())
    });
    for e in &errors {
        assert!(e[0].contains("whole float32"), "{}", e[0]);
        assert!(e[1].contains("whole float32"), "{}", e[1]);
        assert!(e[2].contains("64-byte segment"), "{}", e[2]);
        assert!(e[3].contains("bool"), "{}", e[3]);
    }
}

#[test]
fn every_rank_copies_the_others_shards_from_their_owners() {
    for n in 2..=4 {
        for len in [1usize, 7, 4096, 200_001] {
            let got = on_host(n, len, move |r, mem, barrier| {
                let shards: Vec<_> = (0..n)
                    .map(|q| {
                        let (lo, count) = split(len, n, q);
                        lo..lo + count
                    })
                    .collect();
                // Each rank's own shard holds its mark; the rest is what a reduction left.
                mem.with_range(0..len, |own, _| {
                    own.fill(0xEE);
                    own[shards[r].clone()].fill(r as u8 + 1);
                    Ok(())
                })
                .unwrap();
                barrier.wait(); // every shard final
                engine::gather_shards_in_host_memory(&mem, &shards).unwrap();
                barrier.wait(); // nobody writes what another reads
                mem.with_range(0..len, |own, _| Ok(own.to_vec())).unwrap()
            });
            for (r, bytes) in got.iter().enumerate() {
                for (i, &b) in bytes.iter().enumerate() {
                    let owner = (0..n)
                        .find(|&q| {
                            let (lo, count) = split(len, n, q);
                            (lo..lo + count).contains(&i)
                        })
                        .unwrap();
                    assert_eq!(
                        b,
                        owner as u8 + 1,
                        "{n} ranks, {len} bytes: rank {r} byte {i} is not rank {owner}'s"
                    );
                }
            }
        }
    }
}

#[test]
fn a_shard_list_of_the_wrong_length_is_refused() {
    let errors = on_host(3, 64, |_, mem, _| {
        engine::gather_shards_in_host_memory(&mem, &[0..32, 32..64])
            .unwrap_err()
            .to_string()
    });
    for e in &errors {
        assert!(e.contains("2 shards for 3 ranks"), "{e}");
    }
}
