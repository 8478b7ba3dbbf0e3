//! The allreduce of buffers that already lie in host memory every rank of a process set maps
//! (the torch optimizer's flat gradients): each rank reduces its shard straight from the
//! others' segments, the ranks meet, each copies the others' shards from their owners, and
//! they meet again. The memory steps are the collective layer's (`collective::host_memory`,
//! over the segments as a `PeersMemory`); the meetings are ops through the engine's door, so
//! that they take the fast path where the ranks share one, and a rank that dies or leaves
//! fails them as it fails any op.

use std::ops::Range;

use crate::collective::host_memory as peers;
use crate::collective::split_rows;
use crate::error::{Error, Result};
use crate::transport::host_memory::HostMemory;
use crate::types::{DType, OpKind, ReduceOp, Reduction};

use super::door::Door;
use super::tensor::TensorBuf;
use super::{OpSpec, TensorSpec};
use crate::control::message::TensorMeta;

impl Door {
    /// Returns once every rank of set `set_id` has met under `name`: a one-element
    /// allreduce, which the fast path agrees through its board when the ranks share one.
    /// `stop`: asked between waits whether to give up (an `Interrupted` error then).
    pub fn meet(&self, set_id: u32, name: &str, stop: &dyn Fn() -> bool) -> Result<()> {
        let spec = one_int(set_id, name, ReduceOp::Sum, 0);
        self.run_and_wait(spec, stop).map(|_| ())
    }

    /// Whether every rank of set `set_id` says `yes`, agreed under `name`: a one-element Min
    /// allreduce (through the fast path's board where the ranks share one), so also a
    /// meeting: every rank has called it when it returns. `stop` as for [`Door::meet`].
    pub fn agree(
        &self,
        set_id: u32,
        name: &str,
        yes: bool,
        stop: &dyn Fn() -> bool,
    ) -> Result<bool> {
        let spec = one_int(set_id, name, ReduceOp::Min, i32::from(yes));
        let out = self.run_and_wait(spec, stop)?;
        match out.tensors.first() {
            Some((buf, _)) => Ok(buf.as_slice() == 1i32.to_ne_bytes()),
            None => Err(Error::Io(format!(
                "internal error: the agreement '{name}' returned no result"
            ))),
        }
    }

    /// The reduction of a sharded update in host memory, one call for its whole protocol: the
    /// ranks agree under `name` whether every one is `ready` to reduce in its segment
    /// ([`Door::agree`], after which every rank's bytes are final), and if all are, `shard` of
    /// this rank's segment becomes the reduction of `shard` over every rank's segment as `red`
    /// says ([`reduce_shard_in_host_memory`]). `(set_id, name, stop)`: where the ranks agree,
    /// and what a waiting rank asks between waits whether to give up. Returns the agreement;
    /// nothing is reduced without it. No rank may write its `shard` (or read another's)
    /// until the ranks meet again: the caller's next meeting.
    pub fn reduce_shard_if_all_ready(
        &self,
        mem: &HostMemory,
        shard: Range<usize>,
        red: Reduction,
        ready: bool,
        (set_id, name, stop): (u32, &str, &dyn Fn() -> bool),
    ) -> Result<bool> {
        let all = self.agree(set_id, name, ready, stop)?;
        if all {
            reduce_shard_in_host_memory(mem, shard, red)?;
        }
        Ok(all)
    }

    /// Reduces the first `nbytes` of every rank's segment of `mem` (elements of `red.dtype`;
    /// the segments of the ranks of set `set_id`, in set order) with `red.op` (Sum, or Average
    /// with its 1/n in the factor: [`Reduction::over`]), times `red.factor`, into every rank's; the ranks meet under `name`'s
    /// `.reduced` and `.gathered`. Every rank's bytes must be final when it calls (the
    /// caller's last meeting ensured it); on return every rank holds the same bits, and any
    /// rank may write its segment again. Each shard is reduced once, by its owner.
    pub fn allreduce_in_host_memory(
        &self,
        mem: &HostMemory,
        set_id: u32,
        name: &str,
        nbytes: usize,
        red: Reduction,
        stop: &dyn Fn() -> bool,
    ) -> Result<()> {
        let shards = shards(mem.mapped().len(), nbytes, red.dtype)?;
        let mine = shards[mem.rank()].clone();
        reduce_shard_in_host_memory(mem, mine, red)?;
        self.meet(set_id, &format!("{name}.reduced"), stop)?;
        gather_shards_in_host_memory(mem, &shards)?;
        self.meet(set_id, &format!("{name}.gathered"), stop)
    }
}

/// A one-element i32 allreduce of `value` under `name` in set `set_id`, into a result the
/// engine allocates: the meetings and agreements above.
fn one_int(set_id: u32, name: &str, op: ReduceOp, value: i32) -> OpSpec {
    OpSpec {
        set_id,
        name: name.to_string(),
        base_at: 0,
        kind: OpKind::Allreduce,
        op,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        tensors: vec![TensorSpec {
            meta: TensorMeta {
                dtype: DType::I32,
                shape: vec![1],
            },
            input: TensorBuf::Owned(value.to_ne_bytes().to_vec()),
            output: None,
        }],
        splits: Vec::new(),
    }
}

/// This rank's shard of a reduce-scatter whose inputs already lie in host memory, each rank's
/// in its own segment at the same offsets: `range` of this rank's segment becomes the
/// reduction of `range` over every rank's segment, as `red` says, read straight from the other
/// ranks' memory (this rank's bytes fold first, then the others' in rank order). Only a
/// protocol the caller keeps makes it right: every rank's input is final before any rank
/// starts, and no rank writes its `range` (or this rank's) until every rank has finished.
pub fn reduce_shard_in_host_memory(
    mem: &HostMemory,
    range: Range<usize>,
    red: Reduction,
) -> Result<()> {
    let rank = mem.rank();
    if range.start > range.end {
        return Err(Error::InvalidArgument(format!(
            "host memory: bytes {range:?} end before they start"
        )));
    }
    mem.with_range(0..range.end, |own, others| {
        let at = range.start;
        peers::reduce_in_rank_order(others, Some(rank), at, red, &mut own[range])
    })
}

/// The allgather half of an allreduce in host memory: `shards[q]` of this rank's segment
/// becomes a copy of `shards[q]` of rank `q`'s, for every other rank `q`. Only a protocol the
/// caller keeps makes it right: every owner has finished its shard before any rank starts, and
/// no rank writes its segment until every rank has finished.
pub fn gather_shards_in_host_memory(mem: &HostMemory, shards: &[Range<usize>]) -> Result<()> {
    let hi = shards.iter().map(|s| s.end).max().unwrap_or(0);
    let rank = mem.rank();
    mem.with_range(0..hi, |own, others| {
        peers::gather_shards(others, rank, shards, own)
    })
}

/// Each of `n` ranks' bytes of a buffer of `nbytes` bytes of `dtype`: Horovod's reducescatter
/// split of its elements, the lowest ranks one element more.
fn shards(n: usize, nbytes: usize, dtype: DType) -> Result<Vec<Range<usize>>> {
    let esize = dtype.size();
    if nbytes % esize != 0 {
        return Err(Error::InvalidArgument(format!(
            "allreduce in host memory: {nbytes} bytes are not whole {} elements",
            dtype.name()
        )));
    }
    Ok((0..n)
        .map(|q| {
            let (lo, count) = split_rows(nbytes / esize, n, q);
            lo * esize..(lo + count) * esize
        })
        .collect())
}
