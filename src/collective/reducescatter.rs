//! Reduce-scatter: the ring algorithm, also the first half of the large allreduce.

use std::ops::Range;

use super::reduce::{check_reducible, reduce_into, reduce_pair, scale};
use super::{
    blocks, check_segments, chunk_count, chunk_of, element_chunk, same_len, split_pair,
    with_scratch,
};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::sys::copy::copy;
use crate::types::{DType, Reduction};

/// Reduces `input` across ranks and writes this rank's segment (`byte_counts[rank]` bytes,
/// segments in rank order), multiplied by `red.factor`, into `output`. `input` is only read, so
/// the caller's tensor needs no copy; `scratch` (as long as `input`) holds the partial sums
/// of the segments that pass through this rank, and is untouched with two ranks or fewer.
///
/// Steps: [`ring_reduce_scatter_into`] (`n-1` ring steps). Bytes sent per rank: `B - B_rank`,
/// where `B` is the whole tensor. Segments may have any size, including zero.
pub fn reducescatter(
    comm: &mut Communicator<'_>,
    input: &[u8],
    scratch: &mut [u8],
    byte_counts: &[usize],
    red: Reduction,
    output: &mut [u8],
) -> Result<()> {
    let n = comm.size();
    let segs = segments(n, byte_counts, input.len(), red)?;
    // The output's and scratch's lengths are checked where the ring starts, before any byte
    // moves.
    ring_reduce_scatter_into(comm, input, scratch, &segs, red, output)
}

/// [`reducescatter`] in place: `buf` is reduced across ranks and this rank's segment of it
/// (`byte_counts[rank]` bytes, segments in rank order) ends multiplied by `red.factor`; the other
/// segments are left with partial sums. No input to keep, so no scratch: the ring reduces
/// into `buf` itself ([`ring_reduce_scatter`]), which is how a sharded optimizer reduces its
/// flat gradient buffer and finds its shard where its update reads it.
pub fn reducescatter_in_place(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    byte_counts: &[usize],
    red: Reduction,
) -> Result<()> {
    let segs = segments(comm.size(), byte_counts, buf.len(), red)?;
    ring_reduce_scatter(comm, buf, &segs, red)
}

/// The segments of a reducescatter's `len`-byte buffer, checking the reduction and that
/// every segment holds whole elements (both forms of [`reducescatter`]).
fn segments(
    n: usize,
    byte_counts: &[usize],
    len: usize,
    Reduction { dtype, op, .. }: Reduction,
) -> Result<Vec<Range<usize>>> {
    check_reducible(dtype, op)?;
    let segs = blocks(byte_counts, n, len, "reducescatter")?;
    if let Some(bad) = byte_counts.iter().find(|&&c| c % dtype.size() != 0) {
        return Err(Error::InvalidArgument(format!(
            "reducescatter: segment of {bad} bytes does not hold whole {} elements",
            dtype.name()
        )));
    }
    Ok(segs)
}

/// The ring of [`ring_reduce_scatter`], reading the rank's own contribution from `input`
/// instead of reducing in place: each received chunk is reduced with the matching chunk of
/// `input` into `scratch` (a segment that travels on) or, at the last step, into `output`
/// (this rank's segment, `segs[rank].len()` bytes), where it is also multiplied by `red.factor`.
/// A segment first leaves a rank straight from `input`. Every element sees the same operands
/// in the same order as in the in-place ring, so the bits are the same; with two ranks the
/// only step sends from `input` and lands in `output`, and `scratch` is not used (it may be
/// empty); with more, it is at least as long as `input`.
pub fn ring_reduce_scatter_into(
    comm: &mut Communicator<'_>,
    input: &[u8],
    scratch: &mut [u8],
    segs: &[Range<usize>],
    red: Reduction,
    output: &mut [u8],
) -> Result<()> {
    let n = comm.size();
    check_segments(segs, n, input.len(), red.dtype.size())?;
    let mine = segs[comm.rank()].clone();
    if output.len() != mine.len() {
        return Err(Error::InvalidArgument(format!(
            "reduce-scatter: output holds {} bytes, this rank's segment {}",
            output.len(),
            mine.len()
        )));
    }
    if n > 2 && scratch.len() < input.len() {
        return Err(Error::InvalidArgument(format!(
            "reduce-scatter: scratch holds {} bytes, the input {}",
            scratch.len(),
            input.len()
        )));
    }
    let place = Place {
        input: Some(input),
        sums: scratch,
        output: Some(output),
    };
    reduce_scatter_steps(comm, place, segs, red, false)
}

/// The schedule both reduce-scatter rings follow: for `step` in `0..n-1`, rank `r` sends
/// segment `r-step-1` to `r+1` while receiving segment `r-step-2` from `r-1` (mod `n`), each
/// step cut into the same number of chunks on every rank (set by the longest segment).
struct Ring {
    rank: usize,
    size: usize,
    next: usize,
    prev: usize,
    chunk: usize,
    nchunks: usize,
    /// Bytes of the receive buffer one chunk needs.
    tmp_len: usize,
}

/// One chunk's exchange: the byte ranges sent and received, at step `step`, chunk `chunk`.
struct Exchange {
    step: usize,
    chunk: usize,
    send: Range<usize>,
    recv: Range<usize>,
}

impl Ring {
    /// The ring of `comm` (two ranks or more) over `segs`, chunked by its tuning.
    fn new(comm: &Communicator<'_>, segs: &[Range<usize>], dtype: DType) -> Ring {
        let (r, n) = (comm.rank(), comm.size());
        let chunk = element_chunk(comm.tuning.chunk_bytes, dtype.size());
        let longest = segs.iter().map(|s| s.len()).max().unwrap_or(0);
        Ring {
            rank: r,
            size: n,
            next: (r + 1) % n,
            prev: (r + n - 1) % n,
            chunk,
            nchunks: chunk_count(segs, chunk),
            tmp_len: chunk.min(longest),
        }
    }

    fn exchanges<'a>(&'a self, segs: &'a [Range<usize>]) -> impl Iterator<Item = Exchange> + 'a {
        let (r, n) = (self.rank, self.size);
        (0..n - 1).flat_map(move |step| {
            let send_seg = &segs[(r + 2 * n - step - 1) % n];
            let recv_seg = &segs[(r + 2 * n - step - 2) % n];
            (0..self.nchunks).map(move |c| Exchange {
                step,
                chunk: c,
                send: chunk_of(send_seg, c, self.chunk),
                recv: chunk_of(recv_seg, c, self.chunk),
            })
        })
    }
}

/// Ring reduce-scatter in place: afterwards `buf[segs[rank]]` holds the reduction of that
/// segment over all ranks (other segments hold partial sums). `segs` has one range per rank,
/// ascending and disjoint, on element boundaries (else `InvalidArgument`); gaps are left alone.
///
/// Steps: for `s` in `0..n-1`, rank `r` sends segment `r-s-1` to `r+1` while receiving segment
/// `r-s-2` from `r-1`, and reduces what it received into its own copy (mod `n`). Each step is
/// cut into chunks of `comm.tuning.chunk_bytes` (whole elements) so scratch stays small and the
/// peer's next chunk streams into socket buffers while this one is reduced; the number of chunks
/// per step is the same on every rank (set by the longest segment), which keeps the ring in
/// lockstep. Bytes sent per rank: the sum of all segments but its own.
///
/// Every segment is reduced in exactly one place along one chain, so the result is the same
/// whichever rank later reads it. Each chunk of this rank's own segment is multiplied by
/// `red.factor` right after its last reduction, while it is in cache (1.0: left alone); with one
/// rank, the whole segment.
pub fn ring_reduce_scatter(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    segs: &[Range<usize>],
    red: Reduction,
) -> Result<()> {
    reduce_scatter_steps(comm, Place::in_place(buf), segs, red, false)
}

/// [`ring_reduce_scatter`] fused with the first step of [`super::allgather::ring_allgather`]:
/// each chunk of this rank's own segment goes to the next rank as soon as it is final (reduced
/// and scaled), while it is still in cache, and the matching chunk of the previous rank's
/// segment comes in, instead of a second pass that reads the whole segment back from memory.
/// On return `buf[segs[rank]]` and `buf[segs[rank - 1]]` hold their final values; the
/// allgather goes on from its second step ([`super::allgather::ring_allgather_from`]). Same
/// bytes, same order of reductions, so the same bits as the two halves run one after the
/// other.
pub fn ring_reduce_scatter_and_share(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    segs: &[Range<usize>],
    red: Reduction,
) -> Result<()> {
    reduce_scatter_steps(comm, Place::in_place(buf), segs, red, true)
}

/// [`ring_reduce_scatter_and_share`] of `input` (only read) into `buf` (as long; its bytes on
/// entry do not matter). The ring reads every byte of its own contribution at the one place
/// it needs it, where the in-place ring reads its copy: the segment sent first goes out of
/// `input`, and each received chunk lands in `buf` reduced with `input`'s. The copy of
/// `input` into `buf` that an allreduce into new memory needed first, two passes over the
/// whole tensor, is gone; the operands and their order are the in-place ring's, so the bits
/// are too. On return `buf` holds what the in-place ring leaves there, for the segments the
/// allgather goes on with.
pub fn ring_reduce_scatter_and_share_from(
    comm: &mut Communicator<'_>,
    input: &[u8],
    buf: &mut [u8],
    segs: &[Range<usize>],
    red: Reduction,
) -> Result<()> {
    same_len("reduce-scatter", input, buf)?;
    let place = Place {
        input: Some(input),
        sums: buf,
        output: None,
    };
    reduce_scatter_steps(comm, place, segs, red, true)
}

/// Where a reduce-scatter ring reads this rank's contribution and writes its sums.
struct Place<'a> {
    /// This rank's contribution, when it is not in `sums` already.
    input: Option<&'a [u8]>,
    /// As long as the tensor, indexed like it: the partial sums of the segments that pass
    /// through this rank, and this rank's final segment unless `output` takes it.
    sums: &'a mut [u8],
    /// This rank's final segment, `segs[rank].len()` bytes, when it goes elsewhere.
    output: Option<&'a mut [u8]>,
}

impl<'a> Place<'a> {
    fn in_place(buf: &'a mut [u8]) -> Place<'a> {
        Place {
            input: None,
            sums: buf,
            output: None,
        }
    }
}

/// The steps of every reduce-scatter ring, over `place` (in place, from an input into a
/// full-length buffer, or from an input into this rank's segment alone), reducing and scaling
/// this rank's segment as `red` says. `share`: also the allgather's first step,
/// chunk by chunk (see [`ring_reduce_scatter_and_share`]); it needs the final segment in
/// `sums`, where the previous rank's lands beside it.
fn reduce_scatter_steps(
    comm: &mut Communicator<'_>,
    place: Place<'_>,
    segs: &[Range<usize>],
    Reduction { dtype, op, factor }: Reduction,
    share: bool,
) -> Result<()> {
    let Place {
        input,
        sums,
        mut output,
    } = place;
    debug_assert!(
        !(share && output.is_some()),
        "sharing needs the segment in `sums`"
    );
    let n = comm.size();
    check_reducible(dtype, op)?;
    check_segments(segs, n, input.map_or(sums.len(), <[u8]>::len), dtype.size())?;
    let own = segs[comm.rank()].clone();
    if n == 1 {
        let dst = match output {
            Some(out) => out,
            None => &mut sums[own.clone()],
        };
        if let Some(input) = input {
            copy(dst, &input[own]);
        }
        return scale(dtype, dst, factor);
    }
    let ring = Ring::new(comm, segs, dtype);
    with_scratch(ring.tmp_len, |scratch| {
        for Exchange {
            step,
            chunk,
            send,
            recv,
        } in ring.exchanges(segs)
        {
            let tmp = &mut scratch[..recv.len()];
            let last = step == n - 2;
            // Each segment is received once, so `recv` still holds (in place) or is still
            // owed (from `input`) this rank's own bytes; only step 0 sends an unreduced one.
            let out = match input {
                Some(input) if step == 0 => &input[send],
                _ => &sums[send],
            };
            comm.sendrecv(ring.next, out, ring.prev, tmp)?;
            let dst = match output.as_deref_mut() {
                Some(out) if last => &mut out[recv.start - own.start..recv.end - own.start],
                _ => &mut sums[recv.clone()],
            };
            match input {
                Some(input) => reduce_pair(dtype, op, dst, &input[recv.clone()], tmp)?,
                None => reduce_into(dtype, op, dst, tmp)?,
            }
            if last {
                // The last step reduces this rank's own segment: it is final now.
                scale(dtype, dst, factor)?;
                if share {
                    // The previous rank's chunk lands where, with two ranks, `send` was
                    // read from: that send completed in the exchange above.
                    let pr = chunk_of(&segs[ring.prev], chunk, ring.chunk);
                    let (mine, theirs) = split_pair(sums, recv, pr);
                    comm.sendrecv(ring.next, mine, ring.prev, theirs)?;
                }
            }
        }
        Ok(())
    })
}
