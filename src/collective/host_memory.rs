//! Collectives over peers' memory: each rank reads the others' inputs where they lie (a
//! [`PeersMemory`]: the fast path's boards, or host memory's segments) instead of receiving
//! them through a ring. Each function is one rank's part; the ranks' meetings before and after
//! (every input final before anyone reads, nobody writing an input until everyone has read
//! it) are the caller's protocol.
//!
//! Every reduction here folds in one order, [`reduce_in_rank_order`]'s, so each rank that
//! reduces the same bytes gets the same bits, and with two ranks the ring's bits.

use std::ops::Range;

use super::element_chunk;
use super::reduce::{check_reducible, reduce_into, scale};
use crate::error::{Error, Result};
use crate::sys::copy::{copy, extend};
use crate::transport::PeersMemory;
use crate::types::Reduction;

/// Bytes reduced at a time by [`reduce_in_rank_order`]: the destination's chunk and the
/// inputs' stay in cache for the scaling that follows the last fold.
const CHUNK_BYTES: usize = 64 << 10;

/// `dst` = bytes `at..at + dst.len()` of every rank's input, reduced as `red` says. With `held: None` the ranks fold in rank order; with `held: Some(h)`, `dst`
/// already holds rank `h`'s bytes (an in-place reduction: its input is the destination), which
/// fold first, then the others in rank order.
pub fn reduce_in_rank_order(
    peers: &(impl PeersMemory + ?Sized),
    held: Option<usize>,
    at: usize,
    Reduction { dtype, op, factor }: Reduction,
    dst: &mut [u8],
) -> Result<()> {
    check_reducible(dtype, op)?;
    let esize = dtype.size();
    if at % esize != 0 || dst.len() % esize != 0 {
        return Err(Error::InvalidArgument(format!(
            "reduction over peers' memory: bytes {at}..{} are not whole {} elements",
            at + dst.len(),
            dtype.name()
        )));
    }
    let n = peers.size();
    let first = held.unwrap_or(0);
    let chunk = element_chunk(CHUNK_BYTES, esize);
    for (i, out) in dst.chunks_mut(chunk).enumerate() {
        let bytes = at + i * chunk..at + i * chunk + out.len();
        let src = |r: usize| peers.bytes(r, bytes.clone());
        if held.is_none() {
            copy(out, src(first));
        }
        for r in (0..n).filter(|&r| r != first) {
            reduce_into(dtype, op, out, src(r))?;
        }
        scale(dtype, out, factor)?;
    }
    Ok(())
}

/// `dst` = the first `dst.len()` bytes of rank `root`'s input.
pub fn broadcast_from(peers: &(impl PeersMemory + ?Sized), root: usize, dst: &mut [u8]) {
    copy(dst, peers.bytes(root, 0..dst.len()));
}

/// Appends to `dst` the first `lens[r]` bytes of every rank `r`'s input, in rank order (a
/// new result is written once, not zeroed first).
pub fn gather_in_rank_order(
    peers: &(impl PeersMemory + ?Sized),
    lens: &[usize],
    dst: &mut Vec<u8>,
) {
    dst.reserve(lens.iter().sum());
    for (r, &len) in lens.iter().enumerate() {
        extend(dst, peers.bytes(r, 0..len));
    }
}

/// An even alltoall: appends to `dst` block `rank` of every rank's input (`block` bytes each),
/// in rank order.
pub fn alltoall_even(
    peers: &(impl PeersMemory + ?Sized),
    rank: usize,
    block: usize,
    dst: &mut Vec<u8>,
) {
    let n = peers.size();
    dst.reserve(n * block);
    for r in 0..n {
        extend(dst, peers.bytes(r, rank * block..(rank + 1) * block));
    }
}

/// The allgather half of an allreduce in place: `own[shards[q]]` becomes a copy of rank `q`'s
/// `shards[q]`, for every rank `q` but `rank` (each shard as its owner reduced it, so every
/// rank ends with the same bits). `own` and the peers' inputs share offsets.
pub fn gather_shards(
    peers: &(impl PeersMemory + ?Sized),
    rank: usize,
    shards: &[Range<usize>],
    own: &mut [u8],
) -> Result<()> {
    let n = peers.size();
    if shards.len() != n {
        return Err(Error::InvalidArgument(format!(
            "allgather over peers' memory: {} shards for {n} ranks",
            shards.len()
        )));
    }
    if let Some(bad) = shards.iter().find(|s| s.start > s.end || s.end > own.len()) {
        return Err(Error::InvalidArgument(format!(
            "allgather over peers' memory: shard {bad:?} of {} bytes",
            own.len()
        )));
    }
    for (q, shard) in shards.iter().enumerate().filter(|&(q, _)| q != rank) {
        copy(&mut own[shard.clone()], peers.bytes(q, shard.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{DType, ReduceOp};

    /// Every rank's input in a vector of its own.
    struct Inputs(Vec<Vec<u8>>);

    impl PeersMemory for Inputs {
        fn size(&self) -> usize {
            self.0.len()
        }
        fn bytes(&self, r: usize, range: Range<usize>) -> &[u8] {
            &self.0[r][range]
        }
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// Three ranks' inputs whose sum depends on the order of the folds.
    fn ordered() -> Inputs {
        Inputs(vec![
            f32s(&[1e8, 1.0, 3.0, 0.5]),
            f32s(&[1.0, 2.0, -3.0, 0.25]),
            f32s(&[-1e8, 4.0, 5.0, 8.0]),
        ])
    }

    #[test]
    fn reduces_in_rank_order_with_the_factor() {
        let peers = ordered();
        let mut dst = vec![0u8; 12];
        reduce_in_rank_order(
            &peers,
            None,
            4,
            Reduction::new(DType::F32, ReduceOp::Sum).scaled(0.5),
            &mut dst,
        )
        .unwrap();
        assert_eq!(floats(&dst), [3.5, 2.5, 4.375]);
        let mut dst = vec![0u8; 16];
        reduce_in_rank_order(
            &peers,
            None,
            0,
            Reduction::new(DType::F32, ReduceOp::Sum),
            &mut dst,
        )
        .unwrap();
        assert_eq!(floats(&dst)[0], (1e8f32 + 1.0) + -1e8);
    }

    #[test]
    fn a_held_input_folds_first() {
        let peers = ordered();
        let mut dst = f32s(&[-1e8, 4.0, 5.0, 8.0]);
        reduce_in_rank_order(
            &peers,
            Some(2),
            0,
            Reduction::new(DType::F32, ReduceOp::Max),
            &mut dst,
        )
        .unwrap();
        assert_eq!(floats(&dst), [1e8, 4.0, 5.0, 8.0]);
        let mut dst = f32s(&[-1e8, 4.0, 5.0, 8.0]);
        reduce_in_rank_order(
            &peers,
            Some(2),
            0,
            Reduction::new(DType::F32, ReduceOp::Sum),
            &mut dst,
        )
        .unwrap();
        assert_eq!(floats(&dst)[0], (-1e8f32 + 1e8) + 1.0);
    }

    #[test]
    fn refuses_partial_elements_and_unreducible_types() {
        let peers = ordered();
        let mut dst = vec![0u8; 4];
        assert!(reduce_in_rank_order(
            &peers,
            None,
            2,
            Reduction::new(DType::F32, ReduceOp::Sum),
            &mut dst
        )
        .is_err());
        assert!(reduce_in_rank_order(
            &peers,
            None,
            0,
            Reduction::new(DType::Bool, ReduceOp::Sum),
            &mut dst
        )
        .is_err());
    }

    #[test]
    fn copies_gathers_and_exchanges_blocks() {
        let peers = Inputs(vec![
            vec![0, 1, 2, 3, 4, 5],
            vec![10, 11, 12, 13, 14, 15],
            vec![20, 21, 22, 23, 24, 25],
        ]);
        let mut dst = vec![0; 4];
        broadcast_from(&peers, 1, &mut dst);
        assert_eq!(dst, [10, 11, 12, 13]);
        let mut dst = vec![7];
        gather_in_rank_order(&peers, &[1, 0, 5], &mut dst);
        assert_eq!(dst, [7, 0, 20, 21, 22, 23, 24]);
        let mut dst = Vec::new();
        alltoall_even(&peers, 2, 2, &mut dst);
        assert_eq!(dst, [4, 5, 14, 15, 24, 25]);
    }

    #[test]
    fn gathers_every_other_shard_and_checks_the_shards() {
        let peers = Inputs(vec![vec![1; 6], vec![2; 6], vec![3; 6]]);
        let mut own = vec![9; 6];
        gather_shards(&peers, 1, &[0..2, 2..4, 4..6], &mut own).unwrap();
        assert_eq!(own, [1, 1, 9, 9, 3, 3]);
        assert!(gather_shards(&peers, 1, &[0..2, 2..4], &mut own).is_err());
        assert!(gather_shards(&peers, 1, &[0..2, 2..4, 4..7], &mut own).is_err());
    }
}
