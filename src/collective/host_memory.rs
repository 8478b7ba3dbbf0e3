//! Collectives over peers' memory: the ranks of one host map each other's segments
//! ([`HostMemory`]), and an algorithm reads the others' bytes where they lie instead of
//! receiving them through a ring. Each step here is one rank's part; the ranks' meetings
//! between steps are the caller's (the engine's `Door::allreduce_in_host_memory`).

use std::ops::Range;

use super::element_chunk;
use super::reduce::{check_reducible, reduce_into, scale};
use crate::error::{Error, Result};
use crate::transport::host_memory::HostMemory;
use crate::types::{DType, ReduceOp};

/// Bytes reduced at a time by [`reduce_shard_in_host_memory`]: this rank's chunk and the
/// others' stay in cache for the scaling that follows the last reduction.
const HOST_CHUNK_BYTES: usize = 64 << 10;

/// This rank's shard of a reduce-scatter whose inputs already lie in host memory, each rank's
/// in its own segment at the same offsets: `range` of this rank's segment becomes the
/// reduction of `range` over every rank's segment, multiplied by `factor`, read straight from
/// the other ranks' memory (no copy through a ring). Folds this rank's bytes first and then
/// the others' in rank order; with two ranks that is the ring's sum, bit for bit. Only a
/// protocol the caller keeps makes it right: every rank's input is final before any rank
/// starts, and no rank writes its `range` (or this rank's) until every rank has finished.
pub fn reduce_shard_in_host_memory(
    mem: &HostMemory,
    range: Range<usize>,
    dtype: DType,
    op: ReduceOp,
    factor: f64,
) -> Result<()> {
    check_reducible(dtype, op)?;
    let esize = dtype.size();
    if range.start % esize != 0 || range.len() % esize != 0 {
        return Err(Error::InvalidArgument(format!(
            "reduce-scatter in host memory: bytes {range:?} are not whole {} elements",
            dtype.name()
        )));
    }
    let chunk = element_chunk(HOST_CHUNK_BYTES, esize);
    mem.with_range(range, |own, others| {
        for (i, dst) in own.chunks_mut(chunk).enumerate() {
            let at = i * chunk..i * chunk + dst.len();
            for src in others {
                reduce_into(dtype, op, dst, &src[at.clone()])?;
            }
            scale(dtype, dst, factor)?;
        }
        Ok(())
    })
}

/// The allgather half of an allreduce in host memory: `shards[q]` of this rank's segment
/// becomes a copy of `shards[q]` of rank `q`'s, for every other rank `q` (each shard as its
/// owner reduced it, so every rank ends with the same bits). Only a protocol the caller keeps
/// makes it right: every owner has finished its shard before any rank starts, and no rank
/// writes its segment until every rank has finished.
pub fn gather_shards_in_host_memory(mem: &HostMemory, shards: &[Range<usize>]) -> Result<()> {
    let n = mem.mapped().len();
    if shards.len() != n {
        return Err(Error::InvalidArgument(format!(
            "allgather in host memory: {} shards for {n} ranks",
            shards.len()
        )));
    }
    if let Some(bad) = shards.iter().find(|r| r.start > r.end) {
        return Err(Error::InvalidArgument(format!(
            "allgather in host memory: shard {bad:?} ends before it starts"
        )));
    }
    let lo = shards.iter().map(|r| r.start).min().unwrap_or(0);
    let hi = shards.iter().map(|r| r.end).max().unwrap_or(0);
    let me = mem.rank();
    mem.with_range(lo..hi, |own, others| {
        // `others` lists the ranks other than this one in rank order.
        for (src, q) in others.iter().zip((0..n).filter(|&q| q != me)) {
            let at = shards[q].start - lo..shards[q].end - lo;
            own[at.clone()].copy_from_slice(&src[at]);
        }
        Ok(())
    })
}
