//! [`RawComm`], an NCCL communicator whose every call is a safe method: what each call hands
//! NCCL, checked.

use std::ffi::{c_int, c_uint};

use cudarc::nccl::sys as nc;

use super::{Comm, CommFns, SUCCESS};
use crate::error::{Error, Result};
use crate::gpu::cuda::{DeviceBuf, Stream};

/// A communicator NCCL made (never NULL), with the functions that use it: every NCCL call a
/// communicator makes is a method here, safe because the handle is live for as long as this
/// value exists (`abort` and `destroy` consume it) and each method passes NCCL only memory it
/// has checked. The return codes are NCCL's, for the owner to settle (a non-blocking
/// communicator returns `IN_PROGRESS`).
pub struct RawComm {
    pub(super) fns: CommFns,
    pub(super) comm: Comm,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time; `RawComm` is not
// `Sync` (its pointer field is not), so one owner calls it at a time.
unsafe impl Send for RawComm {}

impl RawComm {
    /// `ncclCommGetAsyncError`: the call's code and the communicator's state.
    pub(crate) fn async_error(&self) -> (c_int, c_int) {
        let mut state: c_int = SUCCESS;
        // SAFETY: a live communicator; writes one int.
        let rc = unsafe { (self.fns.get_async_error)(self.comm, &mut state) };
        (rc, state)
    }

    /// `ncclGroupStart`: collectives enqueued until the matching [`RawComm::group_end`] launch
    /// together (on this thread: NCCL's group state is per thread).
    pub(crate) fn group_start(&self) -> c_int {
        // SAFETY: no arguments.
        unsafe { (self.fns.group_start)() }
    }

    /// `ncclGroupEnd`: closes the innermost group.
    pub(crate) fn group_end(&self) -> c_int {
        // SAFETY: no arguments; NCCL checks that a group is open.
        unsafe { (self.fns.group_end)() }
    }

    /// `ncclCommFinalize`: flushes pending work and waits (non-blocking: polled) for peers.
    pub(crate) fn finalize(&self) -> c_int {
        // SAFETY: a live communicator.
        unsafe { (self.fns.finalize)(self.comm) }
    }

    /// `ncclCommDestroy`: frees the communicator (after a clean finalize).
    pub(crate) fn destroy(self) -> c_int {
        // SAFETY: a live communicator, freed once: `self` is consumed.
        unsafe { (self.fns.destroy)(self.comm) }
    }

    /// `ncclCommAbort`: cancels pending work and frees the communicator.
    pub(crate) fn abort(self) -> c_int {
        // SAFETY: a live communicator, freed once: `self` is consumed.
        unsafe { (self.fns.abort)(self.comm) }
    }

    /// `ncclRedOpCreatePreMulSum`: a sum that first multiplies by `scalar` (the factor in
    /// `dtype`'s type, little-endian, read during the call). The code and the new operator.
    pub(crate) fn pre_mul_sum(&self, scalar: &mut [u8; 8], dtype: c_uint) -> (c_int, c_uint) {
        let mut op: c_uint = 0;
        // SAFETY: `scalar` holds eight bytes, enough for any dtype's factor, and is read during
        // the call (ncclScalarHostImmediate); `op` receives the new operator.
        let rc = unsafe {
            (self.fns.red_op_create_pre_mul_sum)(
                &mut op,
                scalar.as_mut_ptr().cast(),
                dtype,
                nc::ncclScalarResidence_t::ncclScalarHostImmediate as c_uint,
                self.comm,
            )
        };
        (rc, op)
    }

    /// `ncclRedOpDestroy` of an operator [`RawComm::pre_mul_sum`] made on this communicator.
    pub(crate) fn red_op_destroy(&self, op: c_uint) -> c_int {
        // SAFETY: a live communicator; NCCL checks that the operator is one of its own.
        unsafe { (self.fns.red_op_destroy)(op, self.comm) }
    }

    /// `ncclAllReduce` of `count` elements of `dtype` (`esize` bytes each) with operator `op`,
    /// `send` into `recv` (the same buffer for in place), on `stream`.
    #[allow(clippy::too_many_arguments)] // NCCL's arguments, each checked here
    pub(crate) fn all_reduce(
        &self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        (count, esize): (usize, usize),
        dtype: c_uint,
        op: c_uint,
        stream: Stream,
    ) -> Result<c_int> {
        let bytes = count.checked_mul(esize).ok_or_else(overflow)?;
        send.fits(bytes, "send")?;
        recv.fits(bytes, "receive")?;
        // SAFETY: both buffers hold `count` elements (checked; that the memory is the device's
        // is DeviceBuf's contract), the stream is Stream's contract, the communicator is live.
        Ok(unsafe {
            (self.fns.all_reduce)(
                send.src(),
                recv.dst(),
                count,
                dtype,
                op,
                self.comm,
                stream.nccl(),
            )
        })
    }

    /// `ncclAllGather` of `bytes` bytes from every one of `size` ranks, as bytes.
    pub(crate) fn all_gather(
        &self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        (bytes, size): (usize, usize),
        stream: Stream,
    ) -> Result<c_int> {
        send.fits(bytes, "send")?;
        recv.fits(bytes.checked_mul(size).ok_or_else(overflow)?, "receive")?;
        // SAFETY: as in all_reduce; moved as bytes (any dtype).
        Ok(unsafe {
            (self.fns.all_gather)(
                send.src(),
                recv.dst(),
                bytes,
                BYTE,
                self.comm,
                stream.nccl(),
            )
        })
    }

    /// `ncclBroadcast` of `bytes` bytes from `root` (whose `send` is read; `is_root`: this
    /// rank is the root) into every rank's `recv`.
    pub(crate) fn broadcast(
        &self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        bytes: usize,
        (root, is_root): (usize, bool),
        stream: Stream,
    ) -> Result<c_int> {
        if is_root {
            send.fits(bytes, "send")?;
        }
        recv.fits(bytes, "receive")?;
        let root = c_int::try_from(root).map_err(|_| overflow())?;
        // SAFETY: as in all_gather; `send` is read on the root only.
        Ok(unsafe {
            (self.fns.broadcast)(
                send.src(),
                recv.dst(),
                bytes,
                BYTE,
                root,
                self.comm,
                stream.nccl(),
            )
        })
    }

    /// `ncclReduceScatter`: `recv_count * size` elements of `send` reduced, block r to rank r's
    /// `recv` (`recv_count` elements of `esize` bytes).
    #[allow(clippy::too_many_arguments)] // NCCL's arguments, each checked here
    pub(crate) fn reduce_scatter(
        &self,
        send: &DeviceBuf,
        recv: &DeviceBuf,
        (recv_count, esize, size): (usize, usize, usize),
        dtype: c_uint,
        op: c_uint,
        stream: Stream,
    ) -> Result<c_int> {
        let bytes = recv_count.checked_mul(esize).ok_or_else(overflow)?;
        send.fits(bytes.checked_mul(size).ok_or_else(overflow)?, "send")?;
        recv.fits(bytes, "receive")?;
        // SAFETY: as in all_reduce.
        Ok(unsafe {
            (self.fns.reduce_scatter)(
                send.src(),
                recv.dst(),
                recv_count,
                dtype,
                op,
                self.comm,
                stream.nccl(),
            )
        })
    }

    /// `ncclSend` of all of `buf`, as bytes, to rank `peer` (inside a group).
    pub(crate) fn send(&self, buf: &DeviceBuf, peer: usize, stream: Stream) -> Result<c_int> {
        let peer = c_int::try_from(peer).map_err(|_| overflow())?;
        // SAFETY: the whole buffer, whose memory is DeviceBuf's contract; see all_reduce.
        Ok(unsafe { (self.fns.send)(buf.src(), buf.len(), BYTE, peer, self.comm, stream.nccl()) })
    }

    /// `ncclRecv` into all of `buf`, as bytes, from rank `peer` (inside a group).
    pub(crate) fn recv(&self, buf: &DeviceBuf, peer: usize, stream: Stream) -> Result<c_int> {
        let peer = c_int::try_from(peer).map_err(|_| overflow())?;
        // SAFETY: as in send.
        Ok(unsafe { (self.fns.recv)(buf.dst(), buf.len(), BYTE, peer, self.comm, stream.nccl()) })
    }
}

/// Data-movement collectives carry bytes: any dtype (bool and int16 included) moves as
/// `ncclUint8`.
const BYTE: c_uint = nc::ncclDataType_t::ncclUint8 as c_uint;

fn overflow() -> Error {
    Error::InvalidArgument("the collective's byte count overflows".into())
}
