//! The engine's dispatch of CUDA tensors, on a machine without a GPU: N engines (one per
//! thread, as in `tests/engine.rs`) negotiate ops whose tensors are described as CUDA device
//! memory. The addresses are never dereferenced: what is tested is that ranks disagreeing on
//! host vs CUDA get a mismatch naming the tensor and the ranks, that CUDA ops fail promptly and
//! alike on every rank where CUDA cannot be used (never a hang, never a panic), that what the
//! NCCL path cannot run is refused before it is negotiated, and that host ops keep working
//! afterwards. The collectives themselves need a GPU (tests/nccl_backend.rs runs them there).

use std::time::{Duration, Instant};

use _core::engine::{Engine, Handle, OpSpec, TensorBuf, TensorMeta, TensorSpec};
use _core::{DType, Error, OpKind, ReduceOp};

mod common;

use common::jobs::TIMEOUT_S;

const SECRET: &[u8] = b"device-dispatch-secret-0123456789";

/// Runs `f(rank, engine)` on `n` engines at once and returns the results in rank order.
fn job<R: Send>(n: usize, f: impl Fn(usize, &mut Engine) -> R + Sync) -> Vec<R> {
    common::jobs::job(n, &[], SECRET, f)
}

/// A made-up device address: never dereferenced (no GPU here, and no op gets that far).
const FAKE_DEVICE_PTR: usize = 0x7f00_0000_0000;

/// A CUDA tensor of `count` f32 on device 0 (in place: the output is the input).
fn cuda_tensor(count: usize) -> TensorSpec {
    let len = count * 4;
    // SAFETY: the memory is never accessed: these tests run where CUDA cannot be used, and
    // the engine refuses such ops before any device call.
    let (input, output) = unsafe {
        (
            TensorBuf::device(FAKE_DEVICE_PTR, len, 0, 0),
            TensorBuf::device(FAKE_DEVICE_PTR, len, 0, 0),
        )
    };
    TensorSpec {
        meta: TensorMeta {
            dtype: DType::F32,
            shape: vec![count],
        },
        input,
        output: Some(output),
    }
}

fn host_tensor(data: &[f32]) -> TensorSpec {
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    TensorSpec {
        meta: TensorMeta {
            dtype: DType::F32,
            shape: vec![data.len()],
        },
        output: Some(TensorBuf::Owned(vec![0; bytes.len()])),
        input: TensorBuf::Owned(bytes),
    }
}

fn op(name: &str, kind: OpKind, tensors: Vec<TensorSpec>) -> OpSpec {
    OpSpec {
        set_id: 0,
        name: name.into(),
        base_at: 0,
        kind,
        op: ReduceOp::Sum,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        tensors,
        splits: vec![],
    }
}

fn result_f32(h: &Handle) -> Result<Vec<f32>, Error> {
    let out = h.wait(Duration::ZERO).expect("first wait")?;
    Ok(out.tensors[0]
        .0
        .as_slice()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

fn wait_err(h: &Handle) -> Error {
    match h.wait(Duration::ZERO).expect("first wait") {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

/// A host allreduce after the device ops: every rank contributes `rank*10 + i`.
fn host_sum_works(rank: usize, n: usize, e: &Engine, name: &str) {
    let data: Vec<f32> = (0..7).map(|i| (rank * 10 + i) as f32).collect();
    let got = result_f32(
        &e.submit(op(name, OpKind::Allreduce, vec![host_tensor(&data)]))
            .unwrap(),
    )
    .unwrap_or_else(|err| panic!("rank {rank}: host allreduce {name} failed: {err}"));
    let want: Vec<f32> = (0..7)
        .map(|i| (0..n).map(|r| (r * 10 + i) as f32).sum())
        .collect();
    assert_eq!(got, want, "rank {rank}: {name}");
}

#[test]
fn host_vs_cuda_disagreement_is_a_mismatch_on_every_rank_naming_who_sent_what() {
    let n = 3;
    let errs = job(n, |rank, e| {
        let t = if rank == 1 {
            cuda_tensor(4)
        } else {
            host_tensor(&[1.0; 4])
        };
        let err = wait_err(&e.submit(op("grad.w", OpKind::Allreduce, vec![t])).unwrap());
        host_sum_works(rank, n, e, "after_mismatch");
        err
    });
    for (rank, err) in errs.into_iter().enumerate() {
        match err {
            Error::Mismatch { name, message } => {
                assert_eq!(name, "grad.w", "rank {rank}");
                assert!(
                    message.contains("Mismatched devices")
                        && message.contains("ranks [0, 2] sent CPU")
                        && message.contains("rank 1 sent CUDA"),
                    "rank {rank}: {message}"
                );
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn cuda_ops_fail_promptly_and_alike_where_cuda_cannot_be_used_and_host_ops_go_on() {
    let n = 3;
    let results = job(n, |rank, e| {
        let start = Instant::now();
        // A lone allreduce, then two fused ones and a broadcast: the first creates (tries to
        // create) the communicator, the later ones get the same verdict.
        let first = wait_err(
            &e.submit(op("a", OpKind::Allreduce, vec![cuda_tensor(8)]))
                .unwrap(),
        );
        let hs: Vec<Handle> = ["b", "c"]
            .iter()
            .map(|name| {
                e.submit(op(name, OpKind::Allreduce, vec![cuda_tensor(3)]))
                    .unwrap()
            })
            .collect();
        let mut bcast = op("d", OpKind::Broadcast, vec![cuda_tensor(5)]);
        bcast.root = 2;
        let hb = e.submit(bcast).unwrap();
        let later: Vec<Error> = hs.iter().chain([&hb]).map(wait_err).collect();
        let elapsed = start.elapsed();
        host_sum_works(rank, n, e, "after_cuda");
        (first, later, elapsed)
    });
    for (rank, (first, later, elapsed)) in results.into_iter().enumerate() {
        for err in std::iter::once(&first).chain(&later) {
            match err {
                Error::InvalidArgument(m) => assert!(
                    m.contains("CUDA cannot be used") && m.contains("CUDA driver"),
                    "rank {rank}: {m}"
                ),
                other => panic!("rank {rank}: expected InvalidArgument, got {other:?}"),
            }
        }
        assert!(
            elapsed < Duration::from_secs(TIMEOUT_S / 2),
            "rank {rank}: the CUDA ops took {elapsed:?} to fail (timeout {TIMEOUT_S} s)"
        );
    }
}

#[test]
fn what_the_nccl_path_cannot_run_is_refused_before_negotiation() {
    let n = 2;
    let results = job(n, |rank, e| {
        let mut errs = Vec::new();
        // Host input, CUDA output.
        let mut mixed = host_tensor(&[1.0; 4]);
        mixed.output = cuda_tensor(4).output;
        errs.push((
            "mixed",
            e.submit(op("m", OpKind::Allreduce, vec![mixed])).unwrap(),
        ));
        // Allgather's output is sized by the other ranks' rows, which the caller learns
        // first: the engine allocates no device memory.
        let mut gather = cuda_tensor(4);
        gather.output = None;
        errs.push((
            "allgather",
            e.submit(op("g", OpKind::Allgather, vec![gather])).unwrap(),
        ));
        // 5 rows do not split evenly over 2 ranks.
        let mut rs = cuda_tensor(5);
        rs.output = cuda_tensor(2).output;
        errs.push((
            "uneven",
            e.submit(op("r", OpKind::Reducescatter, vec![rs])).unwrap(),
        ));
        // NCCL has no int16.
        let mut i16s = cuda_tensor(4);
        i16s.meta = TensorMeta {
            dtype: DType::I16,
            shape: vec![8],
        };
        errs.push((
            "int16",
            e.submit(op("i", OpKind::Allreduce, vec![i16s])).unwrap(),
        ));
        // The engine allocates no device memory.
        let mut no_out = cuda_tensor(4);
        no_out.output = None;
        errs.push((
            "no output",
            e.submit(op("o", OpKind::Allreduce, vec![no_out])).unwrap(),
        ));
        // Two devices in one op.
        let mut two = cuda_tensor(4);
        // SAFETY: never accessed (see cuda_tensor).
        two.output = Some(unsafe { TensorBuf::device(FAKE_DEVICE_PTR, 16, 1, 0) });
        errs.push((
            "two devices",
            e.submit(op("t", OpKind::Allreduce, vec![two])).unwrap(),
        ));
        let errs: Vec<(&str, Error)> = errs.into_iter().map(|(w, h)| (w, wait_err(&h))).collect();
        host_sum_works(rank, n, e, "after_refusals");
        errs
    });
    let expect = [
        ("mixed", "in host memory or all on one CUDA device"),
        ("allgather", "must be allocated by the caller"),
        (
            "uneven",
            "first dimension of 5 does not divide over 2 ranks",
        ),
        ("int16", "NCCL cannot reduce int16"),
        ("no output", "must be allocated by the caller"),
        ("two devices", "CUDA devices 0 and 1"),
    ];
    for (rank, errs) in results.into_iter().enumerate() {
        for ((what, err), (want_what, needle)) in errs.iter().zip(expect) {
            assert_eq!(*what, want_what);
            match err {
                Error::InvalidArgument(m) => assert!(m.contains(needle), "rank {rank} {what}: {m}"),
                other => panic!("rank {rank} {what}: expected InvalidArgument, got {other:?}"),
            }
        }
    }
}
