//! A rank without Python for the scale benchmark (`benchmarks/scale.py --worker rust`): the
//! engine as the Python adapters drive it, in a process of a few MB that starts in
//! milliseconds, so that hundreds of ranks fit on one small machine.
//!
//! Started by `ferrovodrun` (or any launcher `init()` understands), it forms the job, times
//! loops of 4-byte and 64 KiB float32 sum allreduces through the engine's one entry (blocking,
//! as `allreduce_` is: the fast path where it applies), and rank 0 prints one line,
//! `SCALE_RESULT {json}`, with the slowest rank's figures: start-up, microseconds per op, the
//! control frames each rank sent and received per op (rank 0's and the others'), file
//! descriptors, threads and resident memory.
//!
//! With `kill`, the last rank then SIGKILLs itself while the others are blocked in a 4-byte
//! allreduce, and each rank prints `SCALE_KILL {json}`: the last rank the wall-clock time just
//! before its kill, every other rank the time its allreduce failed and the error's class, so
//! the harness can say how long the others took to learn of the dead rank.
//!
//! Usage: scale_worker [ITERS] [kill]

use std::time::{Duration, Instant};

use _core::config::Config;
use _core::control::connection::{frame_bytes, frames};
use _core::engine::{Engine, OpSpec, Ran, TensorBuf, TensorMeta, TensorSpec};
use _core::{DType, OpKind, ReduceOp};

fn spec(name: &str, dtype: DType, bytes: Vec<u8>, op: ReduceOp) -> OpSpec {
    let elems = bytes.len() / dtype.size();
    OpSpec {
        set_id: 0,
        name: name.into(),
        base_at: 0,
        kind: OpKind::Allreduce,
        op,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        tensors: vec![TensorSpec {
            meta: TensorMeta {
                dtype,
                shape: vec![elems],
            },
            output: Some(TensorBuf::Owned(vec![0; bytes.len()])),
            input: TensorBuf::Owned(bytes),
        }],
        splits: vec![],
    }
}

/// A blocking allreduce through the engine's entry; the output bytes.
fn run(e: &Engine, s: OpSpec) -> Vec<u8> {
    let out = match e.run(s, Some(&|| false)).expect("allreduce") {
        Ran::Done(out) => out,
        Ran::Queued(h, _) => h.wait(Duration::ZERO).expect("wait").expect("op"),
    };
    out.tensors[0].0.as_slice().to_vec()
}

/// Every rank's `mine`, in rank order (a sum of vectors each rank fills its own row of).
fn gather(e: &Engine, name: &str, rank: usize, size: usize, mine: &[f64]) -> Vec<Vec<f64>> {
    let k = mine.len();
    let mut all = vec![0f64; size * k];
    all[rank * k..(rank + 1) * k].copy_from_slice(mine);
    let bytes: Vec<u8> = all.iter().flat_map(|x| x.to_le_bytes()).collect();
    let got = run(e, spec(name, DType::F64, bytes, ReduceOp::Sum));
    let vals: Vec<f64> = got
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    vals.chunks(k).map(<[f64]>::to_vec).collect()
}

fn count(dir: &str) -> f64 {
    std::fs::read_dir(dir).map_or(0.0, |d| d.count() as f64)
}

fn rss_kib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn epoch_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The last rank SIGKILLs itself once the others have entered a 4-byte allreduce it never
/// joins; the others report when and how theirs failed.
fn kill_last(e: &Engine, rank: usize, size: usize) {
    use std::io::Write;
    // Everyone is here, so the others are about to block in the next op.
    run(e, spec("kill.meet", DType::F32, vec![0; 4], ReduceOp::Sum));
    if rank + 1 == size {
        std::thread::sleep(Duration::from_millis(200));
        println!(
            "SCALE_KILL {{\"rank\": {rank}, \"killed_at\": {:.6}}}",
            epoch_s()
        );
        let _ = std::io::stdout().flush();
        // SAFETY: kill(2) on this process's own id; nothing is touched after it.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        unreachable!("SIGKILL is not caught");
    }
    let got = e.run(
        spec("kill.wait", DType::F32, vec![0; 4], ReduceOp::Sum),
        Some(&|| false),
    );
    let got = match got {
        Ok(Ran::Queued(h, _)) => h.wait(Duration::ZERO).map_or(Ok(()), |r| r.map(|_| ())),
        Ok(Ran::Done(_)) => Ok(()),
        Err(err) => Err(err),
    };
    let what = match got {
        Ok(()) => "succeeded".to_string(),
        Err(err) => format!("{err:?}")
            .split(['(', ' ', '{'])
            .next()
            .unwrap_or("?")
            .to_string(),
    };
    println!(
        "SCALE_KILL {{\"rank\": {rank}, \"failed_at\": {:.6}, \"error\": \"{what}\"}}",
        epoch_s()
    );
    let _ = std::io::stdout().flush();
}

fn main() {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let kill = std::env::args().nth(2).as_deref() == Some("kill");
    let t0 = Instant::now();
    let config = Config::from_env().expect("configuration");
    let e = Engine::start(&config, &[], 0).expect("init");
    let init_s = t0.elapsed().as_secs_f64();
    let (rank, size) = (e.topology().rank, e.topology().size);
    let mut row = vec![init_s];
    let mut bytes = Vec::new();
    for (label, elems) in [("4B", 1usize), ("64KiB", 16384)] {
        let input: Vec<u8> = (0..elems)
            .flat_map(|i| ((rank + i) as f32).to_le_bytes())
            .collect();
        let name = format!("x{label}");
        let first = run(&e, spec(&name, DType::F32, input.clone(), ReduceOp::Sum));
        let want: f32 = (0..size).map(|r| r as f32).sum();
        assert_eq!(f32::from_le_bytes(first[..4].try_into().unwrap()), want);
        let mut best = f64::MAX;
        let mut frames_per_op = 0.0;
        let mut bytes_per_op = 0.0;
        for _ in 0..3 {
            let (s0, r0) = frames();
            let (bs0, br0) = frame_bytes();
            let t = Instant::now();
            for _ in 0..iters {
                run(&e, spec(&name, DType::F32, input.clone(), ReduceOp::Sum));
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
            let (s1, r1) = frames();
            let (bs1, br1) = frame_bytes();
            if us < best {
                best = us;
                frames_per_op = (s1 - s0 + r1 - r0) as f64 / iters as f64;
                bytes_per_op = (bs1 - bs0 + br1 - br0) as f64 / iters as f64;
            }
        }
        row.push(best);
        row.push(frames_per_op);
        bytes.push(bytes_per_op);
    }
    row.push(count("/proc/self/fd"));
    row.push(count("/proc/self/task"));
    row.push(rss_kib());
    row.push(bytes[0]);
    let all = gather(&e, "scale.stats", rank, size, &row);
    if rank == 0 {
        let col = |i: usize| all.iter().map(|r| r[i]).collect::<Vec<f64>>();
        let max = |v: &[f64]| v.iter().cloned().fold(f64::MIN, f64::max);
        let others = |i: usize| {
            let v = col(i);
            if v.len() > 1 {
                max(&v[1..])
            } else {
                0.0
            }
        };
        println!(
            "SCALE_RESULT {{\"ranks\": {size}, \"init_s\": {:.3}, \"us_4B\": {:.1}, \
             \"us_64KiB\": {:.1}, \"frames_4B_rank0\": {:.2}, \"frames_4B_others\": {:.2}, \
             \"frames_64KiB_rank0\": {:.2}, \"frames_64KiB_others\": {:.2}, \"fds\": {}, \
             \"fds_rank0\": {}, \"threads\": {}, \"rss_kib\": {}, \"bytes_4B_rank0\": {:.0}, \
             \"bytes_4B_others\": {:.0}}}",
            max(&col(0)),
            max(&col(1)),
            max(&col(3)),
            all[0][2],
            others(2),
            all[0][4],
            others(4),
            max(&col(5)),
            all[0][5],
            max(&col(6)),
            max(&col(7)),
            all[0][8],
            others(8),
        );
    }
    if kill && size > 1 {
        kill_last(&e, rank, size);
    }
    drop(e);
}
