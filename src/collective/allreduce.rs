//! Flat allreduce: direct exchange or recursive doubling for small payloads, ring
//! reduce-scatter + ring allgather for large ones. [`super::hierarchical`] composes these for
//! sets that span hosts; [`super::allreduce`] chooses between the two.
//!
//! Every rank must end with **bitwise identical** results: floats are not associative, and
//! replicas whose parameters differ by one ulp drift apart over training. Each algorithm fixes
//! the order of every reduction independently of which rank computes it:
//! - direct: every rank folds all inputs in rank order `0, 1, …, n-1`;
//! - recursive doubling: both partners compute `op(lower half's value, upper half's value)`,
//!   the same operands in the same order, so they agree after every step;
//! - ring: every segment is reduced at one place along one chain and then copied everywhere;
//! - hierarchical: these, composed inside and across hosts (see its module doc).

use super::allgather::ring_allgather_from;
use super::reduce::{check_reducible, reduce_into, scale};
use super::reducescatter::{ring_reduce_scatter_and_share, ring_reduce_scatter_and_share_from};
use super::{even_segments, same_len, split_blocks, with_scratch};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::sys::copy::copy;
use crate::transport::Xfer;
use crate::types::{DType, ReduceOp, Reduction};

/// Up to this many ranks the small path sends every buffer to every rank (one round trip)
/// instead of recursive doubling (`log2 n` round trips).
const DIRECT_MAX_RANKS: usize = 3;

/// [`small`] or [`ring`] by size, whatever the hosts, the result multiplied by `red.factor`.
pub fn flat(comm: &mut Communicator<'_>, buf: &mut [u8], red: Reduction) -> Result<()> {
    if buf.len() <= comm.tuning.small_allreduce_bytes {
        small(comm, buf, red.dtype, red.op)?;
        scale(red.dtype, buf, red.factor)
    } else {
        ring(comm, buf, red)
    }
}

pub(crate) fn check(buf: &[u8], dtype: DType, op: ReduceOp) -> Result<()> {
    check_reducible(dtype, op)?;
    if buf.len() % dtype.size() != 0 {
        return Err(Error::InvalidArgument(format!(
            "allreduce: {} bytes is not a whole number of {} elements",
            buf.len(),
            dtype.name()
        )));
    }
    Ok(())
}

/// [`flat`] of `input` into `output` (as long: the caller checked; any contents): the ring
/// reads `input` where it lies ([`ring_into`]); the small path, which reads its buffer more
/// than once, gets a copy.
pub fn flat_into(
    comm: &mut Communicator<'_>,
    input: &[u8],
    output: &mut [u8],
    red: Reduction,
) -> Result<()> {
    if output.len() <= comm.tuning.small_allreduce_bytes {
        copy(output, input);
        flat(comm, output, red)
    } else {
        ring_into(comm, input, output, red)
    }
}

/// Latency-optimal allreduce.
///
/// - `n ≤ 3`: one exchange in which every rank sends `buf` to every other rank, then each rank
///   folds the `n` buffers in rank order. One round trip; bytes sent per rank `(n-1)·B`.
/// - otherwise recursive doubling over `p = 2^⌊log2 n⌋` ranks: first the `n-p` "extra" pairs
///   fold (rank `2i` sends `B` to `2i+1`, which reduces), then `log2 p` steps in which partners
///   at distance `2^k` swap `B` and reduce, then the folded ranks get the result back.
///   Bytes sent per rank: `log2(p)·B`, plus `B` for the ranks in a fold pair.
pub fn small(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    check(buf, dtype, op)?;
    if comm.size() == 1 || buf.is_empty() {
        return Ok(());
    }
    if comm.size() <= DIRECT_MAX_RANKS {
        direct(comm, buf, dtype, op)
    } else {
        recursive_doubling(comm, buf, dtype, op)
    }
}

fn direct(comm: &mut Communicator<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (n, b) = (comm.size(), buf.len());
    with_scratch((n - 1) * b, |others| {
        direct_into(comm, buf, dtype, op, others)
    })
}

/// [`direct`] with `others` ((n-1)·B bytes, any contents) as the landing area: the other ranks'
/// buffers in rank order. The fold starts from rank 0's buffer: rank 0 folds into its own
/// `buf` and copies nothing; the others fold into rank 0's received copy and copy the result
/// once into `buf` (copying `buf` into a full n·B area first cost two more passes over it).
fn direct_into(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    others: &mut [u8],
) -> Result<()> {
    let (n, r, b) = (comm.size(), comm.rank(), buf.len());
    let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
    {
        let ranges: Vec<_> = (0..n - 1).map(|i| i * b..(i + 1) * b).collect();
        let slots = split_blocks(others, &ranges);
        let mut xfers = Vec::with_capacity(2 * (n - 1));
        for (&p, slot) in peers.iter().zip(slots) {
            xfers.push(Xfer::Send {
                peer: p,
                buf: &*buf,
            });
            xfers.push(Xfer::Recv { peer: p, buf: slot });
        }
        comm.exchange(&mut xfers)?;
    }
    if r == 0 {
        for src in others.chunks_exact(b) {
            reduce_into(dtype, op, buf, src)?;
        }
        return Ok(());
    }
    // Rank p (not this one) is at slot p - (p > r) of `others`; rank 0 at slot 0, the fold.
    let (acc, rest) = others.split_at_mut(b);
    for p in 1..n {
        let src = if p == r {
            &*buf
        } else {
            let i = p - usize::from(p > r) - 1;
            &rest[i * b..(i + 1) * b]
        };
        reduce_into(dtype, op, acc, src)?;
    }
    copy(buf, acc);
    Ok(())
}

/// Combines this rank's partial `own` with a partner's `theirs` so that both partners compute
/// `op(lower, upper)` bit for bit; the result ends in `own`.
fn combine(
    dtype: DType,
    op: ReduceOp,
    own: &mut [u8],
    theirs: &mut [u8],
    own_is_lower: bool,
) -> Result<()> {
    if own_is_lower {
        reduce_into(dtype, op, own, theirs)
    } else {
        reduce_into(dtype, op, theirs, own)?;
        copy(own, theirs);
        Ok(())
    }
}

fn recursive_doubling(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    with_scratch(buf.len(), |theirs| {
        recursive_doubling_into(comm, buf, dtype, op, theirs)
    })
}

/// [`recursive_doubling`] with `theirs` (B bytes, any contents) for the partner's data.
fn recursive_doubling_into(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    theirs: &mut [u8],
) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let p = 1usize << n.ilog2();
    let extra = n - p;
    // Fold: among the first 2·extra ranks, even ones hand their data to the odd one above and
    // sit out; survivors get new ranks 0..p.
    let new_rank = if r < 2 * extra {
        if r % 2 == 0 {
            comm.send(r + 1, buf)?;
            comm.recv(r + 1, buf)?;
            return Ok(());
        }
        comm.recv(r - 1, theirs)?;
        combine(dtype, op, buf, theirs, false)?;
        r / 2
    } else {
        r - extra
    };
    let real = |nr: usize| if nr < extra { 2 * nr + 1 } else { nr + extra };
    let mut mask = 1;
    while mask < p {
        let partner = new_rank ^ mask;
        comm.sendrecv(real(partner), buf, real(partner), theirs)?;
        combine(dtype, op, buf, theirs, new_rank < partner)?;
        mask <<= 1;
    }
    if r < 2 * extra {
        comm.send(r - 1, buf)?;
    }
    Ok(())
}

/// Bandwidth-optimal allreduce: ring reduce-scatter over `n` segments of whole elements (as
/// even as possible; some empty when there are fewer elements than ranks), then ring allgather
/// of the reduced segments. `2·(n-1)` steps; bytes sent per rank `2·(n-1)/n·B`. The
/// reduce-scatter half is chunked by `comm.tuning.chunk_bytes`. Each rank multiplies its
/// reduced segment by `factor` before the allgather shares it, and shares each chunk of it as
/// soon as it is final ([`ring_reduce_scatter_and_share`]): with the allgather's first step as
/// a pass of its own, that segment went out to memory and was read back (13-26 % slower from
/// 16 MiB up on 2 ranks, the same below).
pub fn ring(comm: &mut Communicator<'_>, buf: &mut [u8], red: Reduction) -> Result<()> {
    ring_steps(comm, None, buf, red)
}

/// [`ring`] of `input` into `output` (as long, else `InvalidArgument`; any contents), `input`
/// only read: the same steps and bits, without first copying `input` into `output` (see
/// [`ring_reduce_scatter_and_share_from`]).
pub fn ring_into(
    comm: &mut Communicator<'_>,
    input: &[u8],
    output: &mut [u8],
    red: Reduction,
) -> Result<()> {
    ring_steps(comm, Some(input), output, red)
}

/// The steps of [`ring`] on `buf`; `input`: this rank's contribution when it is not in `buf`
/// already ([`ring_into`]).
fn ring_steps(
    comm: &mut Communicator<'_>,
    input: Option<&[u8]>,
    buf: &mut [u8],
    red: Reduction,
) -> Result<()> {
    if let Some(input) = input {
        same_len("allreduce", input, buf)?;
    }
    check(buf, red.dtype, red.op)?;
    if comm.size() == 1 || buf.is_empty() {
        if let Some(input) = input {
            copy(buf, input);
        }
        return scale(red.dtype, buf, red.factor);
    }
    let es = red.dtype.size();
    let segs = even_segments(buf.len() / es, comm.size(), es);
    match input {
        Some(input) => ring_reduce_scatter_and_share_from(comm, input, buf, &segs, red)?,
        None => ring_reduce_scatter_and_share(comm, buf, &segs, red)?,
    }
    ring_allgather_from(comm, buf, &segs, 1)
}
