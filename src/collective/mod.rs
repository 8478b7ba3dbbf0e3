//! Collective algorithms over a [`Communicator`]. Buffers are raw bytes of whole elements;
//! ranks and roots are *set* ranks.
//!
//! One file per collective; the functions here are the entry points the engine calls, and they
//! pick the algorithm (latency-optimal for small payloads, bandwidth-optimal for large ones, as
//! set by [`crate::comm::Tuning`]). Every algorithm moves bytes only through
//! [`Communicator::exchange`] and its `send`/`recv`/`sendrecv` shorthands, and is written so that
//! all ranks run the same sequence of exchanges with matching partners ("lockstep"): with a
//! transport that progresses the sends and receives of one exchange concurrently, no size or
//! rank count can deadlock. The exception is [`host_memory`], whose algorithms read the other
//! ranks' inputs where they lie (a [`crate::transport::PeersMemory`]: the fast path's boards,
//! host memory's segments); the engine calls them directly, and keeps their protocol.
//!
//! | collective | algorithm | bytes sent per rank (payload `B`, `n` ranks) |
//! |---|---|---|
//! | allreduce, small | direct (n ≤ 3) / recursive doubling | `(n-1)·B` / `log2(n)·B` (+`B` fold) |
//! | allreduce, large | ring reduce-scatter + ring allgather | `2·(n-1)/n·B` |
//! | allreduce, across hosts | hierarchical: inside host, across, inside | across hosts `2·(H-1)/H·B` per host |
//! | allgatherv | direct (small) / ring | own block `·(n-1)` / everyone else's blocks |
//! | broadcast | pipelined binomial tree | `B` per child |
//! | alltoallv | direct (small) / pairwise exchange | what this rank sends |
//! | reducescatter | ring | `B - B_r` |
//! | barrier | dissemination | `ceil(log2 n)` bytes |
//! | allreduce in host memory ([`host_memory`]) | each rank reduces its shard from the others' segments, then copies theirs | none: peers' memory is read in place |
//! | the fast path's five ops ([`host_memory`]) | each rank reads every offer from the boards | none: the offers are read in place |

pub mod adasum;
pub mod allgather;
pub mod allreduce;
pub mod alltoall;
pub mod barrier;
pub mod broadcast;
pub mod hierarchical;
pub mod host_memory;
pub mod reduce;
pub mod reducescatter;

use std::ops::Range;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::sys::copy::copy;
use crate::types::{ReduceOp, Reduction};

/// In-place allreduce of `buf`, every element of the result multiplied by `red.factor` (the
/// engine's post-scale, 1/n for Average). `red.op` is Sum/Min/Max/Product/Adasum (`Average`
/// reduces as Sum). Every rank ends with bitwise-identical results.
///
/// [`adasum::allreduce`] for Adasum; else [`hierarchical::allreduce`] when
/// `comm.tuning.hierarchical` asks for it on this size and the set spans hosts with more than
/// one member on some host, else [`allreduce::flat`]: payloads up to
/// `comm.tuning.small_allreduce_bytes` [`allreduce::small`] (direct exchange or recursive
/// doubling), larger ones [`allreduce::ring`]. On the ring path each rank scales the segment
/// it reduced while that is still in cache, instead of in one more pass over the whole buffer
/// (16 MiB on 2 ranks: 1.7 ms summed, 2.8 ms summed then scaled). Bool and buffers of partial
/// elements are `InvalidArgument` on every size (every path validates, and short-circuits a
/// single rank, itself).
pub fn allreduce(comm: &mut Communicator<'_>, buf: &mut [u8], red: Reduction) -> Result<()> {
    if red.op == ReduceOp::Adasum {
        adasum::allreduce(comm, buf, red.dtype, red.factor)
    } else if hierarchical::wanted(comm, buf.len()) {
        hierarchical::allreduce(comm, buf, red)
    } else {
        allreduce::flat(comm, buf, red)
    }
}

/// [`allreduce`] of `input` into `output` (as long, else `InvalidArgument`; any contents),
/// `input` only read.
/// The flat algorithms read `input` where it lies ([`allreduce::flat_into`]); Adasum and the
/// hierarchical allreduce (when the set spans hosts: on one host it is the flat one) reduce a
/// copy.
pub fn allreduce_into(
    comm: &mut Communicator<'_>,
    input: &[u8],
    output: &mut [u8],
    red: Reduction,
) -> Result<()> {
    same_len("allreduce", input, output)?;
    let layered = || hierarchical::Layout::of(comm).is_some();
    if red.op == ReduceOp::Adasum || (hierarchical::wanted(comm, output.len()) && layered()) {
        copy(output, input);
        allreduce(comm, output, red)
    } else {
        allreduce::flat_into(comm, input, output, red)
    }
}

/// `InvalidArgument` unless an op's `input` and `output` hold as many bytes.
pub(crate) fn same_len(what: &str, input: &[u8], output: &[u8]) -> Result<()> {
    if input.len() != output.len() {
        return Err(Error::InvalidArgument(format!(
            "{what}: {} bytes of input for {} of output",
            input.len(),
            output.len()
        )));
    }
    Ok(())
}

/// Gathers every rank's `input` into `output`, concatenated in rank order; `byte_counts[r]` is
/// rank r's input length (`byte_counts[comm.rank()] == input.len()`, `output.len()` = sum).
///
/// See [`allgather::allgatherv`] for the algorithm.
pub fn allgatherv(
    comm: &mut Communicator<'_>,
    input: &[u8],
    output: &mut [u8],
    byte_counts: &[usize],
) -> Result<()> {
    allgather::allgatherv(comm, input, output, byte_counts)
}

/// [`allgatherv`] in place: `buf` holds the whole result, this rank's block already in it.
///
/// See [`allgather::allgatherv_in_place`] for the algorithm.
pub fn allgatherv_in_place(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    byte_counts: &[usize],
) -> Result<()> {
    allgather::allgatherv_in_place(comm, buf, byte_counts)
}

/// Copies `root`'s `buf` into every rank's `buf` (same length everywhere).
///
/// See [`broadcast::broadcast`] for the algorithm.
pub fn broadcast(comm: &mut Communicator<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    broadcast::broadcast(comm, buf, root)
}

/// Sends `input[displ(send_counts, r)..][..send_counts[r]]` to rank r and receives rank r's
/// part into `output` at offset `displ(recv_counts, r)` (displacements are prefix sums).
///
/// See [`alltoall::alltoallv`] for the algorithm.
pub fn alltoallv(
    comm: &mut Communicator<'_>,
    input: &[u8],
    send_counts: &[usize],
    output: &mut [u8],
    recv_counts: &[usize],
) -> Result<()> {
    alltoall::alltoallv(comm, input, send_counts, output, recv_counts)
}

/// Reduces `input` across ranks and writes this rank's segment, multiplied by `red.factor`, into
/// `output`. Segment r has `byte_counts[r]` bytes, segments laid out in rank order; `scratch`
/// (as long as `input`; unused with two ranks or fewer) holds partial sums in transit.
///
/// See [`reducescatter::reducescatter`] for the algorithm.
pub fn reducescatter(
    comm: &mut Communicator<'_>,
    input: &[u8],
    scratch: &mut [u8],
    byte_counts: &[usize],
    red: Reduction,
    output: &mut [u8],
) -> Result<()> {
    reducescatter::reducescatter(comm, input, scratch, byte_counts, red, output)
}

/// [`reducescatter`] in place: this rank's segment of `buf` ends reduced and multiplied by
/// `red.factor`; the other segments are left with partial sums.
///
/// See [`reducescatter::reducescatter_in_place`] for the algorithm.
pub fn reducescatter_in_place(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    byte_counts: &[usize],
    red: Reduction,
) -> Result<()> {
    reducescatter::reducescatter_in_place(comm, buf, byte_counts, red)
}

/// Rank `r`'s rows of a reducescatter over `n` ranks, as (first row, row count): Horovod's
/// split, the lowest `rows % n` ranks get one extra row.
pub fn split_rows(rows: usize, n: usize, r: usize) -> (usize, usize) {
    (
        r * (rows / n) + r.min(rows % n),
        rows / n + usize::from(r < rows % n),
    )
}

/// Returns once every rank of the set has entered.
///
/// See [`barrier::barrier`] for the algorithm.
pub fn barrier(comm: &mut Communicator<'_>) -> Result<()> {
    barrier::barrier(comm)
}

// ---- helpers shared by the algorithm files ----

/// Byte ranges of `n` consecutive blocks with the given sizes (prefix sums), checking that one
/// entry per rank was given and that the total equals `total`.
pub(crate) fn blocks(
    counts: &[usize],
    n: usize,
    total: usize,
    what: &str,
) -> Result<Vec<Range<usize>>> {
    if counts.len() != n {
        return Err(Error::InvalidArgument(format!(
            "{what}: {} counts given for {n} ranks",
            counts.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    let mut at = 0usize;
    for &c in counts {
        let end = at
            .checked_add(c)
            .ok_or_else(|| Error::InvalidArgument(format!("{what}: counts overflow")))?;
        out.push(at..end);
        at = end;
    }
    if at != total {
        return Err(Error::InvalidArgument(format!(
            "{what}: counts add up to {at} bytes but the buffer holds {total}"
        )));
    }
    Ok(out)
}

/// Byte ranges of `n` segments splitting `count` elements of `esize` bytes as evenly as
/// possible; the lowest `count % n` segments get one extra element (Horovod's reducescatter
/// rule). With `count < n` the last segments are empty.
pub(crate) fn even_segments(count: usize, n: usize, esize: usize) -> Vec<Range<usize>> {
    let (base, extra) = (count / n, count % n);
    let mut at = 0;
    (0..n)
        .map(|r| {
            let len = (base + usize::from(r < extra)) * esize;
            let range = at..at + len;
            at += len;
            range
        })
        .collect()
}

/// The `c`-th piece of `chunk` bytes of `seg` (empty past its end).
pub(crate) fn chunk_of(seg: &Range<usize>, c: usize, chunk: usize) -> Range<usize> {
    let start = seg
        .start
        .saturating_add(c.saturating_mul(chunk))
        .min(seg.end);
    start..start.saturating_add(chunk).min(seg.end)
}

/// Number of `chunk`-byte pieces the longest of `segs` needs; every rank computes the same
/// value, so all ranks run the same number of exchanges per step.
pub(crate) fn chunk_count(segs: &[Range<usize>], chunk: usize) -> usize {
    segs.iter()
        .map(|s| s.len().div_ceil(chunk))
        .max()
        .unwrap_or(0)
}

/// Borrows two disjoint ranges of `buf`: one to send from, one to receive into.
pub(crate) fn split_pair(
    buf: &mut [u8],
    send: Range<usize>,
    recv: Range<usize>,
) -> (&[u8], &mut [u8]) {
    if send.is_empty() {
        return (&[], &mut buf[recv]);
    }
    if recv.is_empty() {
        return (&buf[send], &mut []);
    }
    debug_assert!(
        send.end <= recv.start || recv.end <= send.start,
        "overlapping ranges"
    );
    if send.start < recv.start {
        let (lo, hi) = buf.split_at_mut(recv.start);
        (&lo[send], &mut hi[..recv.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(send.start);
        (&hi[..send.len()], &mut lo[recv])
    }
}

/// Splits `buf` into one mutable slice per range (ranges consecutive from 0, as from [`blocks`]).
pub(crate) fn split_blocks<'b>(
    mut buf: &'b mut [u8],
    ranges: &[Range<usize>],
) -> Vec<&'b mut [u8]> {
    let mut out = Vec::with_capacity(ranges.len());
    for r in ranges {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(r.len());
        out.push(head);
        buf = tail;
    }
    out
}

/// Checks segments handed to the public ring building blocks: one per rank, in ascending
/// order without overlap, inside a buffer of `len` bytes, on `esize`-byte element boundaries.
pub(crate) fn check_segments(
    segs: &[Range<usize>],
    n: usize,
    len: usize,
    esize: usize,
) -> Result<()> {
    let mut at = 0;
    for s in segs {
        if s.start < at
            || s.end < s.start
            || s.end > len
            || s.start % esize != 0
            || s.len() % esize != 0
        {
            return Err(Error::InvalidArgument(format!(
                "segment {s:?} is out of order, out of the {len}-byte buffer or not on {esize}-byte elements"
            )));
        }
        at = s.end;
    }
    if segs.len() != n {
        return Err(Error::InvalidArgument(format!(
            "{} segments given for {n} ranks",
            segs.len()
        )));
    }
    Ok(())
}

/// Checks a root or peer argument against the set size.
/// Scratch buffers larger than this are allocated per call rather than kept per thread.
const SCRATCH_KEEP: usize = 8 << 20;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` bytes of scratch whose contents are whatever an earlier call left there:
/// algorithms only read scratch bytes they have written. The buffer is kept per thread, so the
/// hot path neither allocates nor zeroes — a fresh zeroed 1 MiB chunk buffer cost a memset of
/// 1 MiB per large allreduce, and the small allreduce's n·B landing area one per small op. A
/// nested call (or one above [`SCRATCH_KEEP`]) gets a fresh buffer instead.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    if len > SCRATCH_KEEP {
        return f(&mut vec![0u8; len]);
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut kept) => {
            if kept.len() < len {
                kept.resize(len, 0);
            }
            f(&mut kept[..len])
        }
        Err(_) => f(&mut vec![0u8; len]),
    })
}

pub(crate) fn check_rank(r: usize, n: usize, what: &str) -> Result<()> {
    if r >= n {
        return Err(Error::InvalidArgument(format!(
            "{what} {r} is not a rank of this set of {n}"
        )));
    }
    Ok(())
}

/// Chunk length in bytes for pipelined steps: `chunk_bytes` rounded down to whole elements,
/// at least one element.
pub(crate) fn element_chunk(chunk_bytes: usize, esize: usize) -> usize {
    (chunk_bytes / esize).max(1) * esize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_segments_cover_and_balance() {
        for n in 1..7 {
            for count in [0, 1, 2, 5, 6, 7, 100] {
                let segs = even_segments(count, n, 4);
                assert_eq!(segs.len(), n);
                assert_eq!(segs[0].start, 0);
                assert_eq!(segs[n - 1].end, count * 4);
                for w in segs.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len());
                    assert!(w[0].len() - w[1].len() <= 4);
                }
            }
        }
    }

    #[test]
    fn chunks_tile_a_segment() {
        let seg = 10..33;
        let n = chunk_count(std::slice::from_ref(&seg), 8);
        assert_eq!(n, 3);
        let pieces: Vec<_> = (0..n + 1).map(|c| chunk_of(&seg, c, 8)).collect();
        assert_eq!(pieces, vec![10..18, 18..26, 26..33, 33..33]);
    }

    #[test]
    fn split_pair_either_order() {
        let mut b: Vec<u8> = (0..10).collect();
        let (s, r) = split_pair(&mut b, 6..9, 1..3);
        assert_eq!(s, &[6, 7, 8]);
        r.copy_from_slice(&[0, 0]);
        let (s, r) = split_pair(&mut b, 0..2, 4..5);
        assert_eq!(s, &[0, 0]);
        assert_eq!(r, &[4]);
    }

    #[test]
    fn blocks_validate_totals() {
        assert_eq!(
            blocks(&[2, 0, 3], 3, 5, "t").unwrap(),
            vec![0..2, 2..2, 2..5]
        );
        assert!(blocks(&[2, 0], 3, 2, "t").is_err());
        assert!(blocks(&[2, 0, 3], 3, 6, "t").is_err());
        assert!(blocks(&[usize::MAX, 1, 0], 3, 0, "t").is_err());
    }
}
