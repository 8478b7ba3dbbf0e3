//! The collectives a communicator enqueues: allreduce (one tensor, or a fused buffer packed
//! and unpacked on the communicator's stream), allgather, broadcast, reducescatter and
//! alltoall (with splits, as grouped point-to-point sends and receives).

use super::{byte_len, plan_reduction, too_big, DeviceComm};
use crate::error::{Error, Result};
use crate::gpu::cuda::{DeviceBuf, Stream};
use crate::types::{DType, Reduction};

impl DeviceComm {
    /// Sum, average, min, max or product of `count` elements across ranks, `send` into `recv`
    /// (the same buffer for in place), on `stream`. Scaling: see the module doc.
    pub fn allreduce(
        &mut self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        count: usize,
        red: Reduction,
        prescale: f64,
        stream: Stream,
    ) -> Result<()> {
        let bytes = byte_len(count, red.dtype.size())?;
        send.fits(bytes, "send")?;
        recv.fits(bytes, "receive")?;
        let plan = plan_reduction(red.dtype, red.op, prescale, red.factor, self.size)?;
        let (nd, nop) = self.operator(plan)?;
        let rc = self
            .live()?
            .all_reduce(send, recv, (count, red.dtype.size()), nd, nop, stream)?;
        self.after_reduction(rc, "ncclAllReduce", plan, nop)
    }

    /// Several allreduces of one dtype, op and scaling as one NCCL call: each `(send, recv)`
    /// pair's bytes are copied into the fusion buffer, reduced there in place, and copied
    /// out, all on `stream` (a fused response of many small gradients costs one collective's
    /// fixed cost, not one per tensor). Not inside a group: a group would launch the
    /// collective at its end, after the copies out enqueued before it.
    pub fn allreduce_fused(
        &mut self,
        parts: &[(DeviceBuf, DeviceBuf)],
        red: Reduction,
        prescale: f64,
        stream: Stream,
    ) -> Result<()> {
        let total: usize = parts.iter().map(|(send, _)| send.len()).sum();
        let dtype = red.dtype;
        if total % dtype.size() != 0 {
            return Err(Error::InvalidArgument(format!(
                "fused allreduce of {total} bytes is not a whole number of {dtype:?} elements"
            )));
        }
        let fused = self.scratch(total)?;
        self.pack(parts, &fused, stream)?;
        let whole = fused.slice(0, total)?;
        self.allreduce(&whole, &whole, total / dtype.size(), red, prescale, stream)?;
        self.unpack(&fused, parts, stream)
    }

    /// Enqueues on `stream` copies of every `(send, _)` pair's bytes into `buf`, one after
    /// another from its start (a fused response's layout in a device buffer).
    pub fn pack(
        &self,
        parts: &[(DeviceBuf, DeviceBuf)],
        buf: &DeviceBuf,
        stream: Stream,
    ) -> Result<()> {
        let mut at = 0;
        for (send, _) in parts {
            self.device
                .copy_async(send, &buf.slice(at, send.len())?, stream)?;
            at += send.len();
        }
        Ok(())
    }

    /// The reverse of [`DeviceComm::pack`]: each pair's share of `buf` into its `recv`.
    pub fn unpack(
        &self,
        buf: &DeviceBuf,
        parts: &[(DeviceBuf, DeviceBuf)],
        stream: Stream,
    ) -> Result<()> {
        let mut at = 0;
        for (send, recv) in parts {
            self.device
                .copy_async(&buf.slice(at, send.len())?, recv, stream)?;
            at += send.len();
        }
        Ok(())
    }

    /// Every rank's `count` elements of `send`, concatenated in rank order into `recv`.
    pub fn allgather(
        &mut self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        count: usize,
        dtype: DType,
        stream: Stream,
    ) -> Result<()> {
        let bytes = byte_len(count, dtype.size())?;
        let rc = self
            .live()?
            .all_gather(send, recv, (bytes, self.size), stream)?;
        self.settle(rc, "ncclAllGather")
    }

    /// `root`'s `count` elements (its `send`) into every rank's `recv` (the same buffer for
    /// in place; `send` is read on the root only).
    pub fn broadcast(
        &mut self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        count: usize,
        dtype: DType,
        root: usize,
        stream: Stream,
    ) -> Result<()> {
        if root >= self.size {
            return Err(Error::InvalidArgument(format!(
                "broadcast root {root} is not a rank of this {}-rank communicator",
                self.size
            )));
        }
        let bytes = byte_len(count, dtype.size())?;
        let is_root = root == self.rank;
        let rc = self
            .live()?
            .broadcast(send, recv, bytes, (root, is_root), stream)?;
        self.settle(rc, "ncclBroadcast")
    }

    /// Reduces `recv_count * size` elements of `send` across ranks; rank r receives block r
    /// (`recv_count` elements) in `recv`. Ops and scaling as in [`DeviceComm::allreduce`].
    pub fn reducescatter(
        &mut self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        recv_count: usize,
        red: Reduction,
        prescale: f64,
        stream: Stream,
    ) -> Result<()> {
        let bytes = byte_len(recv_count, red.dtype.size())?;
        send.fits(byte_len(bytes, self.size)?, "send")?;
        recv.fits(bytes, "receive")?;
        let plan = plan_reduction(red.dtype, red.op, prescale, red.factor, self.size)?;
        let (nd, nop) = self.operator(plan)?;
        let shape = (recv_count, red.dtype.size(), self.size);
        let rc = self
            .live()?
            .reduce_scatter(send, recv, shape, nd, nop, stream)?;
        self.after_reduction(rc, "ncclReduceScatter", plan, nop)
    }

    /// Sends `send_counts[r]` elements to rank r (consecutive blocks of `send`) and receives
    /// `recv_counts[r]` from rank r (consecutive blocks of `recv`), as one NCCL group of
    /// send/receive pairs.
    pub fn alltoall(
        &mut self,
        send: &DeviceBuf,
        send_counts: &[usize],
        recv: &DeviceBuf,
        recv_counts: &[usize],
        dtype: DType,
        stream: Stream,
    ) -> Result<()> {
        if send_counts.len() != self.size || recv_counts.len() != self.size {
            return Err(Error::InvalidArgument(format!(
                "alltoall needs one send and one receive count per rank ({}), got {} and {}",
                self.size,
                send_counts.len(),
                recv_counts.len()
            )));
        }
        let es = dtype.size();
        let total = |counts: &[usize]| {
            counts.iter().try_fold(0usize, |acc, &c| {
                acc.checked_add(byte_len(c, es)?).ok_or_else(too_big)
            })
        };
        send.fits(total(send_counts)?, "send")?;
        recv.fits(total(recv_counts)?, "receive")?;
        self.group_start()?;
        let result = self.alltoall_pairs(send, send_counts, recv, recv_counts, es, stream);
        // The group is closed even after a failed enqueue: NCCL's group state is per thread.
        let end = self.group_end();
        result.and(end)
    }

    fn alltoall_pairs(
        &mut self,
        send: &DeviceBuf,
        send_counts: &[usize],
        recv: &DeviceBuf,
        recv_counts: &[usize],
        es: usize,
        stream: Stream,
    ) -> Result<()> {
        let (mut s_off, mut r_off) = (0usize, 0usize);
        for peer in 0..self.size {
            let (sb, rb) = (send_counts[peer] * es, recv_counts[peer] * es);
            if peer == self.rank {
                // A copy on the stream: NCCL's send to self costs a proxy round trip.
                if sb != rb {
                    return Err(Error::InvalidArgument(format!(
                        "alltoall: rank {peer} sends itself {sb} bytes but expects {rb}"
                    )));
                }
                let src = send.slice(s_off, sb)?;
                self.device
                    .copy_async(&src, &recv.slice(r_off, rb)?, stream)?;
            } else if sb > 0 {
                let block = send.slice(s_off, sb)?;
                let rc = self.live()?.send(&block, peer, stream)?;
                self.settle(rc, "ncclSend")?;
            }
            if rb > 0 && peer != self.rank {
                let block = recv.slice(r_off, rb)?;
                let rc = self.live()?.recv(&block, peer, stream)?;
                self.settle(rc, "ncclRecv")?;
            }
            s_off += sb;
            r_off += rb;
        }
        Ok(())
    }
}
