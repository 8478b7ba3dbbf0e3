//! Hierarchical allreduce: ranks as threads over the engine's transport (shared memory between
//! ranks of one simulated host, TCP on loopback between hosts), with host labels handed to the
//! communicator as the engine does. Layouts 2×2, 3×2, 2×3 (contiguous and interleaved host
//! labels), uneven hosts (the leader variant) and a single host (the flat path, unchanged);
//! every reducible float/int dtype that matters, every op, sizes from 0 to a few MiB around the
//! small-payload threshold. Results are checked against a fold in rank order computed here
//! (exact integers, f64) and for bitwise identity on every rank; a byte-counting transport
//! checks which algorithm ran and that less crosses hosts.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use _core::collective;
use _core::comm::{Communicator, Hierarchical, Tuning};
use _core::error::Result;
use _core::transport::hybrid::HybridTransport;
use _core::transport::{Transport, Xfer};
use _core::{DType, ReduceOp, Reduction};

mod common;
use common::*;

const IDLE: Duration = Duration::from_secs(20);
const DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I32,
    DType::I64,
    DType::U8,
];
const OPS: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];
/// Shared-memory ring per pair: small, so that large payloads wrap it many times.
const RING: usize = 64 << 10;

/// (name, host label of each global rank).
const LAYOUTS: [(&str, &[u32]); 9] = [
    ("2x2", &[0, 0, 1, 1]),
    ("2x2 interleaved", &[0, 1, 0, 1]),
    ("3x2", &[0, 0, 1, 1, 2, 2]),
    ("3x2 interleaved", &[2, 0, 1, 2, 0, 1]),
    ("2x3", &[0, 0, 0, 1, 1, 1]),
    ("2x3 interleaved", &[1, 0, 1, 0, 0, 1]),
    ("2+1+2", &[0, 0, 1, 2, 2]),
    ("2+2+1 interleaved", &[0, 1, 2, 1, 0]),
    ("1x4", &[3, 3, 3, 3]),
];

fn tuning(mode: Hierarchical, small: usize, chunk: usize) -> Tuning {
    Tuning {
        small_allreduce_bytes: small,
        chunk_bytes: chunk,
        hierarchical: mode,
    }
}

/// Counts the bytes each rank sends to each peer (`sent[from * n + to]`).
struct Counting<'a> {
    inner: &'a mut HybridTransport,
    sent: &'a [AtomicUsize],
}

impl Transport for Counting<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn exchange(&mut self, xfers: &mut [Xfer<'_>], idle: Duration) -> Result<()> {
        let (me, n) = (self.inner.rank(), self.inner.size());
        for x in xfers.iter() {
            if let Xfer::Send { peer, buf } = x {
                self.sent[me * n + peer].fetch_add(buf.len(), Ordering::Relaxed);
            }
        }
        self.inner.exchange(xfers, idle)
    }
    fn abort(&mut self) {
        self.inner.abort()
    }
}

/// Runs `body` on every rank of a job whose ranks sit on `hosts` (all ranks in one set);
/// returns each rank's result in rank order and the bytes sent between each pair.
fn run<R: Send>(
    hosts: &[u32],
    tuning: &Tuning,
    body: impl Fn(&mut Communicator<'_>) -> R + Sync,
) -> (Vec<R>, Vec<usize>) {
    let n = hosts.len();
    let labels: Vec<usize> = hosts.iter().map(|&h| h as usize).collect();
    let mut mesh = _core::testing::hybrid_mesh(&labels, RING, b"secret").expect("mesh");
    let sent: Vec<AtomicUsize> = (0..n * n).map(|_| AtomicUsize::new(0)).collect();
    let members: Vec<usize> = (0..n).collect();
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = mesh
            .iter_mut()
            .map(|t| {
                let (body, tuning, members, sent) = (&body, tuning.clone(), &members, &sent);
                s.spawn(move || {
                    let mut t = Counting { inner: t, sent };
                    let mut c = Communicator::new(&mut t, members, IDLE, tuning).with_hosts(hosts);
                    body(&mut c)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    });
    let sent = sent.into_iter().map(AtomicUsize::into_inner).collect();
    (out, sent)
}

/// Bytes sent between ranks on different hosts.
fn cross_bytes(hosts: &[u32], sent: &[usize]) -> usize {
    let n = hosts.len();
    (0..n * n)
        .filter(|&k| hosts[k / n] != hosts[k % n])
        .map(|k| sent[k])
        .sum()
}

/// Element counts: empty, one, odd, and around the small-payload threshold (`small` bytes),
/// so both hierarchical shapes (leaders below it, 2-D above on even hosts) run.
fn counts(dtype: DType, small: usize) -> Vec<usize> {
    let at = small / dtype.size();
    vec![0, 1, 7, 61, at - 1, at, at + 1, 1001]
}

/// The whole dtype × op × size matrix on every layout, hierarchical forced on, with chunks of
/// an odd byte count that splits elements (rounded down to whole ones).
#[test]
fn every_layout_dtype_op_and_size_matches_the_reference_bitwise_on_every_rank() {
    let small = 256;
    let t = tuning(Hierarchical::Always, small, 100);
    for (name, hosts) in LAYOUTS {
        let (results, _) = run(hosts, &t, |c| {
            let mut out = Vec::new();
            for dtype in DTYPES {
                for op in OPS {
                    for count in counts(dtype, small) {
                        out.push(allreduce_one(c, dtype, op, count));
                    }
                }
            }
            out
        });
        let mut k = 0;
        for dtype in DTYPES {
            for op in OPS {
                for count in counts(dtype, small) {
                    let per_rank: Vec<Vec<u8>> = results.iter().map(|r| r[k].clone()).collect();
                    let what = format!("{name} {} {} count={count}", dtype.name(), op.name());
                    check_allreduce(dtype, op, count, &per_rank, &what);
                    k += 1;
                }
            }
        }
    }
}

/// The post-scale folded into the step across hosts (both shapes and the flat fallback) gives
/// the same bits as scaling after the allreduce.
#[test]
fn folded_scale_equals_scaling_after_on_every_layout() {
    let small = 256;
    let t = tuning(Hierarchical::Always, small, 100);
    let cases = scale_cases(&[0, 1, 61, 1001]);
    for (name, hosts) in LAYOUTS {
        let (results, _) = run(hosts, &t, |c| scaled_and_after(c, &cases));
        check_scaled(&results, &cases, name);
    }
}

/// Float inputs whose sums depend on the order of addition (wide magnitudes, signed zeros):
/// every rank must still hold the same bits, on both shapes and the flat path.
#[test]
fn order_sensitive_floats_are_bitwise_identical_on_every_rank() {
    let t = tuning(Hierarchical::Always, 512, 160);
    for (name, hosts) in LAYOUTS {
        for count in [33, 257, 4099] {
            let (results, _) = run(hosts, &t, |c| messy_allreduces(c, count));
            check_messy(&results, &format!("{name} count={count}"));
        }
    }
}

/// A few MiB with the default tuning (1 MiB chunks, 64 KiB threshold): the automatic choice
/// goes hierarchical, and the 2-D shape's segments wrap the shared-memory rings many times.
#[test]
fn several_mib_with_default_tuning() {
    let t = Tuning::default();
    let cases = [
        (DType::F32, ReduceOp::Sum, (3 << 20) / 4 + 3),
        (DType::I64, ReduceOp::Max, (2 << 20) / 8 + 1),
        (DType::BF16, ReduceOp::Sum, (1 << 20) + 5),
    ];
    for (name, hosts) in [LAYOUTS[1], LAYOUTS[4], LAYOUTS[6]] {
        let (results, _) = run(hosts, &t, |c| {
            cases.map(|(dtype, op, count)| allreduce_one(c, dtype, op, count))
        });
        for (k, (dtype, op, count)) in cases.iter().enumerate() {
            let per_rank: Vec<Vec<u8>> = results.iter().map(|r| r[k].clone()).collect();
            let what = format!("{name} {} {} large", dtype.name(), op.name());
            check_allreduce(*dtype, *op, *count, &per_rank, &what);
        }
    }
}

/// Bytes across hosts per mode for an f32 sum of `len` bytes on `hosts`: (never, auto, always).
fn cross_by_mode(hosts: &[u32], small: usize, len: usize) -> [usize; 3] {
    let n = hosts.len();
    [
        Hierarchical::Never,
        Hierarchical::Auto,
        Hierarchical::Always,
    ]
    .map(|mode| {
        let (_, sent) = run(hosts, &tuning(mode, small, 4096), |c| {
            let mut buf: Vec<u8> = (0..len / 4).flat_map(|_| 1f32.to_ne_bytes()).collect();
            collective::allreduce(c, &mut buf, Reduction::new(DType::F32, ReduceOp::Sum)).unwrap();
            assert!(buf.chunks_exact(4).all(|x| x == (n as f32).to_ne_bytes()));
        });
        cross_bytes(hosts, &sent)
    })
}

/// What a flat ring of `hosts.len()` ranks sends over its cross-host edges: rank r sends
/// every segment but its own, then every block but r+1's.
fn flat_ring_cross(hosts: &[u32], len: usize) -> usize {
    let n = hosts.len();
    let (base, extra) = (len / 4 / n, len / 4 % n);
    let seg = |r: usize| (base + usize::from(r < extra)) * 4;
    (0..n)
        .filter(|&r| hosts[r] != hosts[(r + 1) % n])
        .map(|r| 2 * len - seg(r) - seg((r + 1) % n))
        .sum()
}

/// Which algorithm ran, seen from the bytes that crossed hosts. Above the threshold, auto and
/// always send `2·(H-1)·B` across hosts in all (2-D: each column's ring), never is the flat
/// ring; below it, auto stays flat and always goes through the leaders (`H·(H-1)·B`, direct
/// exchange). A single host never changes algorithm, and neither does a communicator without
/// host labels.
#[test]
fn the_mode_picks_the_algorithm_and_less_crosses_hosts() {
    let small = 1024;
    let b = 64 * 1024;
    for (name, hosts) in [LAYOUTS[0], LAYOUTS[1], LAYOUTS[2], LAYOUTS[4], LAYOUTS[5]] {
        let h = 1 + *hosts.iter().max().unwrap() as usize;
        let [never, auto, always] = cross_by_mode(hosts, small, b);
        assert_eq!(never, flat_ring_cross(hosts, b), "{name}: never");
        assert_eq!(auto, 2 * (h - 1) * b, "{name}: auto above the threshold");
        assert_eq!(always, auto, "{name}: always above the threshold");
        assert!(
            auto < never,
            "{name}: hierarchical {auto} not below flat {never}"
        );
        let [never, auto, always] = cross_by_mode(hosts, small, 512);
        assert_eq!(auto, never, "{name}: auto below the threshold");
        assert_eq!(
            always,
            h * (h - 1) * 512,
            "{name}: always below the threshold"
        );
    }
    // Uneven hosts: the 3 leaders' ring is all that crosses: 2·(3-1)·B in all.
    let (name, hosts) = LAYOUTS[6];
    let [never, auto, always] = cross_by_mode(hosts, small, b);
    assert_eq!(never, flat_ring_cross(hosts, b), "{name}: never");
    assert_eq!((auto, always), (4 * b, 4 * b), "{name}");
    let [never, auto, always] = cross_by_mode(hosts, small, 512);
    assert_eq!(
        (auto, always),
        (never, 6 * 512),
        "{name}: below the threshold"
    );
    // One host: same bytes between the same pairs in every mode.
    let (name, hosts) = LAYOUTS[8];
    let per_pair = |mode| {
        run(hosts, &tuning(mode, small, 4096), |c| {
            let mut buf = vec![0u8; b];
            collective::allreduce(c, &mut buf, Reduction::new(DType::F32, ReduceOp::Sum)).unwrap();
        })
        .1
    };
    let never = per_pair(Hierarchical::Never);
    assert_eq!(per_pair(Hierarchical::Always), never, "{name}");
    assert_eq!(per_pair(Hierarchical::Auto), never, "{name}");
    // No host labels: flat whatever the mode.
    let hosts = [0usize, 0, 1, 1];
    let mut mesh = _core::testing::hybrid_mesh(&hosts, RING, b"secret").unwrap();
    let sent: Vec<AtomicUsize> = (0..16).map(|_| AtomicUsize::new(0)).collect();
    let members = [0, 1, 2, 3];
    std::thread::scope(|s| {
        for t in mesh.iter_mut() {
            let (sent, members) = (&sent, &members);
            s.spawn(move || {
                let mut t = Counting { inner: t, sent };
                let tn = tuning(Hierarchical::Always, small, 4096);
                let mut c = Communicator::new(&mut t, members, IDLE, tn);
                let mut buf = vec![0u8; b];
                collective::allreduce(&mut c, &mut buf, Reduction::new(DType::F32, ReduceOp::Sum))
                    .unwrap();
            });
        }
    });
    let sent: Vec<usize> = sent.into_iter().map(AtomicUsize::into_inner).collect();
    assert_eq!(
        cross_bytes(&[0, 0, 1, 1], &sent),
        flat_ring_cross(&[0, 0, 1, 1], b)
    );
}

/// A sub-set of the job: set ranks are not global ranks, and host labels are looked up by
/// global rank. Global ranks 1, 2, 4, 5 of a 6-rank job on hosts [0, 0, 1, 1, 0, 1]: the set
/// has two members on each host.
#[test]
fn subsets_use_global_host_labels() {
    let hosts: &[u32] = &[0, 0, 1, 1, 0, 1];
    let set = [1usize, 2, 4, 5];
    let labels: Vec<usize> = hosts.iter().map(|&h| h as usize).collect();
    let mut mesh = _core::testing::hybrid_mesh(&labels, RING, b"secret").unwrap();
    let sent: Vec<AtomicUsize> = (0..36).map(|_| AtomicUsize::new(0)).collect();
    let (dtype, op, count) = (DType::F32, ReduceOp::Sum, 3001);
    let t = tuning(Hierarchical::Always, 256, 1000);
    let results: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = mesh
            .iter_mut()
            .enumerate()
            .filter(|(g, _)| set.contains(g))
            .map(|(_, tr)| {
                let (sent, set, t) = (&sent, &set, t.clone());
                s.spawn(move || {
                    let mut tr = Counting { inner: tr, sent };
                    let mut c = Communicator::new(&mut tr, set, IDLE, t).with_hosts(hosts);
                    allreduce_one(&mut c, dtype, op, count)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    check_allreduce(dtype, op, count, &results, "subset");
    let sent: Vec<usize> = sent.into_iter().map(AtomicUsize::into_inner).collect();
    // 2-D: columns are (1, 2) and (4, 5), each across hosts; nothing else crosses.
    for from in 0..6 {
        for to in 0..6 {
            let column = matches!((from, to), (1, 2) | (2, 1) | (4, 5) | (5, 4));
            let across = hosts[from] != hosts[to];
            if across && !column {
                assert_eq!(sent[from * 6 + to], 0, "{from} -> {to}");
            }
            if column {
                assert!(sent[from * 6 + to] > 0, "{from} -> {to}");
            }
        }
    }
}
