//! The fast path's data step: once every rank has offered the same op, each reads the
//! peers' offers where they lie and computes its result (a split allreduce with one more
//! meeting). The slots and the board decide *whether* an op is fast; this file is *what* a
//! fast op does with the offers, the one part of the fast path that knows each collective.

use std::ops::Range;
use std::sync::atomic::Ordering;

use crate::collective::host_memory as peers;
use crate::collective::split_rows;
use crate::error::{Error, Result};
use crate::transport::offers::{BoardWord, OfferRecords, OFFER_DATA_BYTES};
use crate::transport::PeersMemory;
use crate::types::{OpKind, Reduction};

use super::{offers_a_copy, FastPath, Outcome, Scratch};
use crate::engine::tensor::TensorBuf;
use crate::engine::OpSpec;

/// An allreduce whose inputs add up to this many bytes (its size times the ranks) is split:
/// each rank reduces one segment of every input, leaves it in its offer record, and copies
/// the others' segments, reading each input once between them (about twice the tensor per
/// rank) instead of every rank reading every input (the ranks times the tensor per rank:
/// 4 MiB per rank for 64 KiB on 64 ranks), for one more meeting.
pub(super) const SPLIT_READ_BYTES: usize = 256 << 10;

/// Every rank's offer of the slot being reduced, read where it lies: this rank's own input,
/// each peer's payload in its offer record (lent until this rank publishes its `Done`).
struct Offers<'a> {
    rank: usize,
    size: usize,
    slot: u64,
    own: &'a [u8],
    records: Option<&'a OfferRecords>,
}

impl PeersMemory for Offers<'_> {
    fn size(&self) -> usize {
        self.size
    }

    fn bytes(&self, r: usize, range: Range<usize>) -> &[u8] {
        if r == self.rank {
            &self.own[range]
        } else {
            self.records
                .expect("peers' records when there are peers")
                .data(r, self.slot, range)
        }
    }
}

impl FastPath {
    pub(super) fn decide_and_reduce(
        &self,
        op: &mut OpSpec,
        slot: u64,
        sc: &mut Scratch,
        stop: &dyn Fn() -> bool,
    ) -> Result<Outcome> {
        for r in self.peers() {
            self.wait(r, &op.name, stop, |b| {
                b.theirs(r, BoardWord::Posted).load(Ordering::Acquire) > slot
            })?;
            // A peer that offered this slot and has since closed (it finished the op and
            // shut down) still offered: its record stays until every reader is done.
            let records = self.peer_records();
            let fast =
                records.offered(r, slot) && records.same_desc(r, slot, &sc.desc, &mut sc.peer_desc);
            if !fast {
                return Ok(Outcome::Declined);
            }
        }
        let copied = offers_a_copy(op);
        let t = &mut op.tensors[0];
        let offers = Offers {
            rank: self.rank,
            size: self.size,
            slot,
            own: if copied { &sc.own } else { t.input.as_slice() },
            records: self.records.as_ref(),
        };
        let dtype = t.meta.dtype;
        let red = Reduction::over(dtype, op.op, op.postscale, self.size);
        let row_bytes = t.meta.row_elems() * dtype.size();
        match op.kind {
            OpKind::Allreduce | OpKind::Broadcast => {
                let out = t
                    .output
                    .as_mut()
                    .expect("checked by eligible")
                    .as_mut_slice();
                if op.kind == OpKind::Broadcast {
                    peers::broadcast_from(&offers, op.root, out);
                } else if self.size > 2 && out.len().saturating_mul(self.size) >= SPLIT_READ_BYTES {
                    self.split_allreduce(&offers, &op.name, red, out, stop)?;
                } else {
                    peers::reduce_in_rank_order(&offers, None, 0, red, out)?;
                }
            }
            OpKind::Allgather => {
                let rows = self.gathered_rows(&op.name, slot, t.meta.shape[0], row_bytes)?;
                let lens: Vec<usize> = rows.iter().map(|&n| n * row_bytes).collect();
                let mut out = Vec::new();
                peers::gather_in_rank_order(&offers, &lens, &mut out);
                t.meta.shape[0] = rows.iter().sum();
                t.output = Some(TensorBuf::Owned(out));
            }
            OpKind::Reducescatter => {
                // Horovod's split: the lowest `rows % n` ranks get one more row.
                let (first, mine) = split_rows(t.meta.shape[0], self.size, self.rank);
                let mut out = vec![0u8; mine * row_bytes];
                let at = first * row_bytes;
                peers::reduce_in_rank_order(&offers, None, at, red, &mut out)?;
                t.meta.shape[0] = mine;
                t.output = Some(TensorBuf::Owned(out));
            }
            OpKind::Alltoall => {
                let mut out = Vec::new();
                let block = t.meta.nbytes() / self.size;
                peers::alltoall_even(&offers, self.rank, block, &mut out);
                t.output = Some(TensorBuf::Owned(out));
            }
            _ => unreachable!("checked by eligible"),
        }
        Ok(Outcome::Done)
    }

    /// A split allreduce (see [`SPLIT_READ_BYTES`]): this rank's segment of every input
    /// (Horovod's split of elements, as a reducescatter's rows) reduced in rank order into
    /// `out` and its result area, `Reduced` published, then every peer's segment copied from
    /// its result area once it has published its own. Every rank publishes before it waits,
    /// so the meeting cannot hang where the offers did not; a peer that closed before its
    /// `Reduced` (its engine failed) fails the op.
    fn split_allreduce(
        &self,
        offers: &Offers<'_>,
        name: &str,
        red: Reduction,
        out: &mut [u8],
        stop: &dyn Fn() -> bool,
    ) -> Result<()> {
        let records = self.peer_records();
        let slot = offers.slot;
        let esize = red.dtype.size();
        let elems = out.len() / esize;
        let segment = |r: usize| {
            let (first, count) = split_rows(elems, self.size, r);
            first * esize..(first + count) * esize
        };
        let mine = segment(self.rank);
        peers::reduce_in_rank_order(offers, None, mine.start, red, &mut out[mine.clone()])?;
        records.write_result(slot, mine.start, &out[mine]);
        self.publish(BoardWord::Reduced, slot + 1);
        self.ring();
        for r in self.peers() {
            let reduced =
                |b: &OfferRecords| b.theirs(r, BoardWord::Reduced).load(Ordering::Acquire) > slot;
            self.wait(r, name, stop, |b| {
                reduced(b) || b.theirs(r, BoardWord::Posted).load(Ordering::Acquire) == u64::MAX
            })?;
            if !reduced(records) {
                if let Some(e) = &*self.failed.lock() {
                    return Err(e.clone());
                }
                return Err(Error::PeerLost {
                    rank: r,
                    detail: format!("rank {r} left before reducing its part of allreduce '{name}'"),
                });
            }
            let theirs = segment(r);
            out[theirs.clone()].copy_from_slice(records.result(r, slot, theirs));
        }
        Ok(())
    }

    /// Every rank's allgather rows (of `row_bytes` each), this rank's `own_rows` and the
    /// peers' from their offer records, checked against a record's capacity before any byte
    /// is read.
    fn gathered_rows(
        &self,
        name: &str,
        slot: u64,
        own_rows: usize,
        row_bytes: usize,
    ) -> Result<Vec<usize>> {
        (0..self.size)
            .map(|r| {
                if r == self.rank {
                    return Ok(own_rows);
                }
                let n = self.peer_records().rows(r, slot);
                usize::try_from(n)
                    .ok()
                    .filter(|&n| n.saturating_mul(row_bytes) <= OFFER_DATA_BYTES)
                    .ok_or_else(|| {
                        Error::Decode(format!(
                            "rank {r} offered {n} rows of {row_bytes} bytes for allgather '{name}'"
                        ))
                    })
            })
            .collect()
    }
}
