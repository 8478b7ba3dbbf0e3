//! Hierarchical allreduce of CUDA tensors (`FERROVOD_HIERARCHICAL_ALLREDUCE=1` on a set that
//! spans hosts): NCCL inside each host, the engine's TCP collectives across hosts, NCCL again
//! inside each host — Horovod's NCCL hierarchical allreduce, with the host collectives in MPI's
//! place. It is for clusters whose network NCCL does not drive well (TCP-only links, or a job
//! that wants every cross-host byte on the engine's own, authenticated connections): only
//! what crosses hosts leaves the GPU, and it crosses as the host path's hierarchical
//! allreduce's cross-host step does.
//!
//! The shapes follow [`crate::collective::hierarchical`], with `L` members on this host:
//!
//! - **2-D** (every host has `L` members): the fused payload, padded to `L` equal segments in
//!   the local communicator's device buffer, is reduce-scattered by NCCL inside the host, so
//!   local index `i` holds its host's partial of segment `i`; that segment's real elements go
//!   to pinned host memory and are allreduced with the ranks of local index `i` on the other
//!   hosts; back on the device, an NCCL allgather inside the host spreads every segment.
//! - **leaders** (hosts of unequal size): NCCL allreduces inside the host, the first member
//!   of each host allreduces the whole payload with the other hosts' first members, and
//!   broadcasts it inside its host.
//!
//! The NCCL steps are unscaled; the cross-host step applies the whole factor (pre- and
//! post-scale, and an average's 1/n), so every rank gets the bits the cross-host step
//! produced: each segment is reduced at one place per host, then by a host algorithm that
//! already gives its members identical results, and only copied afterwards.

use crate::backend::nccl::DeviceComm;
use crate::collective::hierarchical::Layout;
use crate::error::Result;
use crate::gpu::cuda::{DeviceBuf, PinnedBuf, Stream};
use crate::types::{ReduceOp, Reduction};

/// The cross-host step: allreduces a host buffer among the given global ranks as the
/// reduction says (the engine's host collectives on its transport).
pub(crate) type Cross<'a> = &'a mut dyn FnMut(&[usize], &mut [u8], Reduction) -> Result<()>;

/// A layered set's communicator of this host's members and what its allreduces need.
pub(super) struct Local {
    /// This host's members of the set, in set order (local index = NCCL rank).
    pub(super) comm: DeviceComm,
    /// How the set's members sit on hosts (set positions).
    pub(super) layout: Layout,
    /// Page-locked room for the cross-host step, grown to the largest seen.
    bounce: Option<PinnedBuf>,
}

impl Local {
    pub(super) fn new(comm: DeviceComm, layout: Layout) -> Local {
        Local {
            comm,
            layout,
            bounce: None,
        }
    }

    /// Allreduces `parts` (each `(input, output)`, all of `red.dtype`) across the set whose
    /// global ranks are `members`, as the module doc says, on `stream` (the local
    /// communicator's, already ordered after the submitters' streams). `red` is the host
    /// collectives' (the whole scaling in its factor, AVERAGE's 1/n too); returns once the
    /// results are enqueued on `stream`.
    pub(super) fn allreduce(
        &mut self,
        parts: &[(DeviceBuf, DeviceBuf)],
        red: Reduction,
        members: &[usize],
        stream: Stream,
        cross: Cross<'_>,
    ) -> Result<()> {
        let dtype = red.dtype;
        let es = dtype.size();
        let total: usize = parts.iter().map(|(send, _)| send.len()).sum();
        let elems = total / es;
        let l = self.comm.size();
        let two_d = l > 1 && self.layout.uniform();
        let seg = if two_d { elems.div_ceil(l) } else { elems };
        let room = if two_d { seg * l * es } else { total };
        let buf = self.comm.scratch(room)?;
        self.comm.pack(parts, &buf, stream)?;
        // NCCL reduces inside the host unscaled; the cross-host step scales.
        let local_op = if red.op == ReduceOp::Average {
            ReduceOp::Sum
        } else {
            red.op
        };
        let local = Reduction::new(dtype, local_op);
        let me = self.layout.local;
        let hosts = &self.layout.hosts;
        let (group, lo, hi): (Option<Vec<usize>>, usize, usize) = if two_d {
            let mine = buf.slice(me * seg * es, seg * es)?;
            self.comm
                .reducescatter(&buf, &mine, seg, local, 1.0, stream)?;
            let (lo, hi) = ((me * seg).min(elems), ((me + 1) * seg).min(elems));
            let column = hosts.iter().map(|g| members[g[me]]).collect();
            (Some(column), lo, hi)
        } else {
            if l > 1 {
                self.comm.allreduce(&buf, &buf, elems, local, 1.0, stream)?;
            }
            let firsts = hosts.iter().map(|g| members[g[0]]).collect();
            (Some(firsts).filter(|_| me == 0), 0, elems)
        };
        // Every member of a cross-host group has the same range (one local index): all of
        // them skip an empty one alike.
        if let Some(group) = group.filter(|_| hi > lo) {
            let bytes = (hi - lo) * es;
            let host = &mut super::staging::grown(&mut self.bounce, self.comm.gpu(), bytes)?
                .as_mut_slice()[..bytes];
            let place = buf.slice(lo * es, bytes)?;
            self.comm.gpu().read_async(&place, host, stream)?;
            let read = self.comm.record(stream)?;
            self.comm.wait(&read)?;
            cross(&group, host, local.scaled(red.factor))?;
            self.comm.gpu().write_async(host, &place, stream)?;
        }
        if two_d {
            let mine = buf.slice(me * seg * es, seg * es)?;
            self.comm.allgather(&mine, &buf, seg, dtype, stream)?;
        } else if l > 1 {
            self.comm.broadcast(&buf, &buf, elems, dtype, 0, stream)?;
        }
        self.comm.unpack(&buf, parts, stream)
    }
}
