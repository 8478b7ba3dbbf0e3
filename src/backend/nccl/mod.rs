//! NCCL collectives on CUDA device memory, with NCCL and the CUDA driver found at run time.
//!
//! Nothing here runs before [`crate::gpu::loader`] has accepted a library: [`Nccl::open`]
//! takes the probe's answer and opens exactly the file it accepted (checking that it reports
//! the same version), and [`DeviceComm::init`] asks [`crate::gpu::loader::probe_cuda`] before
//! it touches the driver. Every function is resolved from those handles (see [`crate::gpu`]
//! for why not through cudarc's loader), so a missing or foreign library is an [`Error`],
//! never a panic.
//!
//! Communicators are non-blocking (`ncclConfig_t.blocking = 0`): creation and every enqueue
//! return at once, and the backend polls `ncclCommGetAsyncError` (and, for completion, a CUDA
//! event) against the communicator's timeout. A peer that died leaves that poll pending; at
//! the timeout the communicator is aborted (`ncclCommAbort`, which also stops its kernels) and
//! the caller gets `Error::Timeout`. An asynchronous NCCL error aborts it at once.
//!
//! Scaling: NCCL has a pre-multiplied sum (`ncclRedOpCreatePreMulSum`) but no post-multiply.
//! For SUM and AVERAGE the pre- and post-scale factors (and AVERAGE's 1/n) are folded into one
//! pre-multiplication — sum(x·a)·b = sum(x·a·b), equal up to rounding, and how NCCL itself
//! implements AVERAGE for floats. Integer tensors take only an integer pre-scale; MIN, MAX and
//! PRODUCT take no scaling. Anything else is `InvalidArgument` (the engine stages those
//! through host memory). A [`Reduction`]'s factor is the caller's post-scale here, AVERAGE's
//! 1/n not in it: NCCL divides (`ncclAvg`, or in the pre-multiplication).
//!
//! This file holds the communicator's life (creation, streams and events, polling, failure);
//! `calls.rs` the collectives it enqueues. Every call into NCCL and CUDA goes through the safe
//! types of [`crate::gpu`] ([`RawComm`], [`Device`]).

mod calls;

use std::ffi::{c_int, c_uint};
use std::time::{Duration, Instant};

use cudarc::nccl::sys as nc;

use crate::error::{Error, Result};
use crate::gpu::cuda::{Device, DeviceBuf, DeviceMem, Event, OwnedStream, Stream};
pub use crate::gpu::nccl::{unique_id_key, Nccl, UniqueId};
use crate::gpu::nccl::{RawComm, IN_PROGRESS, SUCCESS};
use crate::types::{DType, OpKind, ReduceOp, Reduction};

/// The `ncclDataType_t` a reduction of `dtype` uses.
pub fn nccl_reduce_dtype(dtype: DType) -> Result<u32> {
    use nc::ncclDataType_t as T;
    Ok(match dtype {
        DType::U8 => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::I16 | DType::Bool => {
            return Err(Error::InvalidArgument(format!(
                "NCCL cannot reduce {} tensors (it has no such type)",
                dtype.name()
            )))
        }
    } as u32)
}

/// Whether the device path can run this op on CUDA tensors as they are (`Ok`), or why not
/// (`InvalidArgument`): allreduce and reducescatter where NCCL can do the reduction and its
/// scaling (see the module doc) — reducescatter only when the first dimension splits evenly
/// over the `size` ranks —, broadcast, and allgather and alltoall of tensors with a first
/// dimension (their outputs are sized from the other ranks' first dimensions and splits,
/// which the caller learns before it allocates them). Every argument is the same on every
/// rank once the negotiation has validated the op, so every rank decides alike.
pub fn check_device_op(
    kind: OpKind,
    red: Reduction,
    prescale: f64,
    size: usize,
    shape: &[usize],
) -> Result<()> {
    let Reduction {
        dtype,
        op,
        factor: postscale,
    } = red;
    match kind {
        OpKind::Broadcast => Ok(()),
        OpKind::Allgather | OpKind::Alltoall if shape.is_empty() => {
            Err(Error::InvalidArgument(format!(
                "a 0-d tensor has no first dimension to {}",
                if kind == OpKind::Allgather {
                    "gather"
                } else {
                    "split"
                }
            )))
        }
        OpKind::Allgather | OpKind::Alltoall => Ok(()),
        OpKind::Allreduce => {
            plan_reduction(dtype, op, prescale, postscale, size.max(1)).map(|_| ())
        }
        OpKind::Reducescatter => {
            let Some(&rows) = shape.first() else {
                return Err(Error::InvalidArgument(
                    "a 0-d tensor has no first dimension to scatter".into(),
                ));
            };
            if size == 0 || rows % size != 0 {
                return Err(Error::InvalidArgument(format!(
                    "NCCL's reducescatter splits evenly: a first dimension of {rows} does not \
                     divide over {size} ranks"
                )));
            }
            plan_reduction(dtype, op, prescale, postscale, size).map(|_| ())
        }
        other => Err(Error::InvalidArgument(format!(
            "the NCCL path runs allreduce, allgather, broadcast, alltoall and reducescatter, \
             not {}",
            other.name()
        ))),
    }
}

/// How a reduction runs: one of NCCL's operators, or a pre-multiplied sum by `scalar` (the
/// factor in the tensor's own type, little-endian bytes).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Plan {
    Builtin { dtype: u32, op: u32 },
    PreMulSum { dtype: u32, scalar: [u8; 8] },
}

/// Chooses the NCCL operator for `op` on `dtype` over `size` ranks with the given scale
/// factors (see the module doc), or says why NCCL cannot do it.
fn plan_reduction(
    dtype: DType,
    op: ReduceOp,
    prescale: f64,
    postscale: f64,
    size: usize,
) -> Result<Plan> {
    use nc::ncclRedOp_t as O;
    let nd = nccl_reduce_dtype(dtype)?;
    let scaled = prescale != 1.0 || postscale != 1.0;
    let builtin = |o: O| {
        Ok(Plan::Builtin {
            dtype: nd,
            op: o as u32,
        })
    };
    match op {
        ReduceOp::Adasum => Err(Error::InvalidArgument(
            "ADASUM is not implemented by the NCCL backend".into(),
        )),
        ReduceOp::Min | ReduceOp::Max | ReduceOp::Product if scaled => {
            Err(Error::InvalidArgument(format!(
                "NCCL can scale only SUM and AVERAGE, not {} (prescale {prescale}, postscale \
                 {postscale})",
                op.name()
            )))
        }
        ReduceOp::Min => builtin(O::ncclMin),
        ReduceOp::Max => builtin(O::ncclMax),
        ReduceOp::Product => builtin(O::ncclProd),
        ReduceOp::Sum if !scaled => builtin(O::ncclSum),
        // The average over one rank is its values: no division for NCCL's one-rank kernel to
        // get wrong (below).
        ReduceOp::Average if !scaled && size == 1 => builtin(O::ncclSum),
        ReduceOp::Average if !scaled => builtin(O::ncclAvg),
        // NCCL 2.28.9's one-rank pre-multiplied sum, run on an H200, left the last element of
        // a 4097-element float32 tensor unscaled or garbled (4096 and 65536 elements, and
        // float16 and float64, came out right): a scaled reduction over one rank is staged.
        ReduceOp::Sum | ReduceOp::Average if size == 1 => Err(Error::InvalidArgument(
            "a scaled reduction over one rank is staged through host memory (NCCL's one-rank \
             pre-multiplied sum garbled a float32 element on GPU hardware)"
                .into(),
        )),
        ReduceOp::Sum | ReduceOp::Average => {
            let mut factor = prescale * postscale;
            if op == ReduceOp::Average {
                factor /= size as f64;
            }
            let mut scalar = [0u8; 8];
            let int = |v: f64, lo: f64, hi: f64| -> Result<i64> {
                if op == ReduceOp::Sum && postscale == 1.0 && v.fract() == 0.0 && v >= lo && v <= hi
                {
                    Ok(v as i64)
                } else {
                    Err(Error::InvalidArgument(format!(
                        "NCCL can scale an integer SUM only by a whole pre-scale factor within \
                         the type's range and no post-scale: a {} {} with prescale {prescale} \
                         and postscale {postscale} cannot run on the device",
                        dtype.name(),
                        op.name()
                    )))
                }
            };
            match dtype {
                DType::F32 => scalar[..4].copy_from_slice(&(factor as f32).to_le_bytes()),
                DType::F64 => scalar.copy_from_slice(&factor.to_le_bytes()),
                DType::F16 => {
                    scalar[..2].copy_from_slice(&half::f16::from_f64(factor).to_le_bytes())
                }
                DType::BF16 => {
                    scalar[..2].copy_from_slice(&half::bf16::from_f64(factor).to_le_bytes())
                }
                DType::U8 => scalar[0] = int(factor, 0.0, 255.0)? as u8,
                DType::I8 => scalar[0] = int(factor, -128.0, 127.0)? as i8 as u8,
                DType::I32 => scalar[..4].copy_from_slice(
                    &(int(factor, i32::MIN as f64, i32::MAX as f64)? as i32).to_le_bytes(),
                ),
                DType::I64 => scalar.copy_from_slice(
                    &int(factor, -(2f64.powi(63)), 2f64.powi(63) - 1024.0)?.to_le_bytes(),
                ),
                DType::I16 | DType::Bool => unreachable!("rejected by nccl_reduce_dtype"),
            }
            Ok(Plan::PreMulSum { dtype: nd, scalar })
        }
    }
}

/// One rank's NCCL communicator on one GPU. Not thread-safe (NCCL's rule): `&mut self`
/// everywhere, `Send` but not `Sync`.
pub struct DeviceComm {
    nccl: Nccl,
    /// The communicator's own stream ([`DeviceComm::stream`]), created on first use. Declared
    /// before `device`: fields drop in order, and the stream goes before its context.
    stream: Option<OwnedStream>,
    /// The fusion buffer of [`DeviceComm::allreduce_fused`], grown to the largest fused
    /// response. Declared before `device`, like `stream`.
    fusion: Option<DeviceMem>,
    device: Device,
    /// `None` once destroyed or aborted.
    comm: Option<RawComm>,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// The error that aborted the communicator; every later call repeats it.
    failed: Option<Error>,
    group_depth: usize,
    /// Pre-multiplied-sum operators to destroy when the open group ends.
    pending_ops: Vec<c_uint>,
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device.ordinal)
            .field("failed", &self.failed)
            .finish()
    }
}

impl DeviceComm {
    /// Joins the communicator `id` names as `rank` of `size` on CUDA device `device`. Fails
    /// (without touching NCCL) when CUDA cannot be used. `timeout` bounds creation and every
    /// later wait; past it the communicator is aborted.
    pub fn init(
        nccl: &Nccl,
        id: &UniqueId,
        rank: usize,
        size: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<DeviceComm> {
        if size == 0 || rank >= size || size > c_int::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of {size} is not a valid NCCL communicator rank"
            )));
        }
        let device = Device::open(device)?;
        let (rc, comm) = nccl.init_comm(id, rank, size)?;
        let mut c = DeviceComm {
            nccl: nccl.clone(),
            stream: None,
            fusion: None,
            device,
            comm: Some(comm),
            rank,
            size,
            timeout,
            failed: None,
            group_depth: 0,
            pending_ops: Vec::new(),
        };
        c.settle(rc, "ncclCommInitRankConfig")?;
        Ok(c)
    }

    /// This rank's position in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.device.ordinal
    }

    /// A stream of the communicator's own (created on first use, destroyed with it), for
    /// running collectives beside the framework's work: order it after the framework's stream
    /// with [`DeviceComm::record`] and [`DeviceComm::stream_wait`].
    pub fn stream(&mut self) -> Result<Stream> {
        self.live()?;
        if self.stream.is_none() {
            self.stream = Some(self.device.create_stream()?);
        }
        Ok(self.stream.as_ref().expect("created above").handle())
    }

    /// The communicator's fusion buffer, at least `bytes` long: device memory that lives as
    /// long as the communicator, grown (its contents lost) when asked for more. Work on it
    /// belongs on [`DeviceComm::stream`], which orders every user of the buffer.
    pub fn scratch(&mut self, bytes: usize) -> Result<DeviceBuf> {
        if self.fusion.as_ref().map_or(true, |f| f.buf().len() < bytes) {
            self.fusion = None; // the old one is freed before the larger one is taken
            self.fusion = Some(self.device.alloc(bytes)?);
        }
        Ok(self.fusion.as_ref().expect("allocated above").buf())
    }

    /// The GPU the communicator runs on, for copies around its collectives.
    pub fn gpu(&self) -> &Device {
        &self.device
    }

    /// Opens an NCCL group: collectives enqueued until the matching [`DeviceComm::group_end`]
    /// launch together (e.g. a fused set of reductions). Groups nest.
    pub fn group_start(&mut self) -> Result<()> {
        let rc = self.live()?.group_start();
        self.settle(rc, "ncclGroupStart")?;
        self.group_depth += 1;
        Ok(())
    }

    /// Closes the innermost group; the outermost one launches its operations.
    pub fn group_end(&mut self) -> Result<()> {
        if self.group_depth == 0 {
            return Err(Error::InvalidArgument(
                "group_end without group_start".into(),
            ));
        }
        self.group_depth -= 1;
        let rc = self.live()?.group_end();
        let r = self.settle(rc, "ncclGroupEnd");
        if self.group_depth == 0 {
            for op in std::mem::take(&mut self.pending_ops) {
                self.destroy_operator(op);
            }
        }
        r
    }

    /// Records an event on `stream` after the work enqueued so far.
    pub fn record(&mut self, stream: Stream) -> Result<Event> {
        self.device.record(stream)
    }

    /// Makes `stream` wait (on the device, the host does not block) for `event`: how work
    /// on the communicator's stream is ordered after the framework's.
    pub fn stream_wait(&mut self, stream: Stream, event: &Event) -> Result<()> {
        self.device.stream_wait(stream, event)
    }

    /// Waits until `event` completes, watching for NCCL errors; past the timeout the
    /// communicator is aborted (a dead peer never lets the collective finish).
    pub fn wait(&mut self, event: &Event) -> Result<()> {
        self.poll_until("collective to complete", |_| event.is_complete())
    }

    /// One look at the communicator's asynchronous error state (for a watchdog): `Ok` while
    /// healthy; an error aborts it.
    pub fn check(&mut self) -> Result<()> {
        let state = self.async_state()?;
        if state != SUCCESS && state != IN_PROGRESS {
            return Err(self.fail_with(state, "asynchronous operation"));
        }
        Ok(())
    }

    /// Aborts the communicator now (its pending work is cancelled); later calls fail.
    pub fn abort(&mut self) {
        self.fail(Error::Shutdown("the NCCL communicator was aborted".into()));
    }

    fn live(&self) -> Result<&RawComm> {
        match (&self.failed, &self.comm) {
            (Some(e), _) => Err(e.clone()),
            (None, Some(c)) => Ok(c),
            (None, None) => Err(Error::Shutdown(
                "the NCCL communicator was destroyed".into(),
            )),
        }
    }

    fn async_state(&mut self) -> Result<c_int> {
        let (rc, state) = self.live()?.async_error();
        if rc != SUCCESS {
            return Err(self.fail_with(rc, "ncclCommGetAsyncError"));
        }
        Ok(state)
    }

    /// Aborts the communicator for NCCL's code `rc` from `what`, with NCCL's words for it.
    fn fail_with(&mut self, rc: c_int, what: &str) -> Error {
        let e = self.nccl.error(rc, what, self.comm.as_ref());
        self.fail(e)
    }

    /// Finishes a call on the non-blocking communicator: `IN_PROGRESS` is polled to an end.
    fn settle(&mut self, rc: c_int, what: &str) -> Result<()> {
        match rc {
            SUCCESS => Ok(()),
            IN_PROGRESS => self.poll_until(what, |state| Ok(state == SUCCESS)),
            _ => Err(self.fail_with(rc, what)),
        }
    }

    /// Polls the asynchronous state until `done(state)` (with the state not an error), an
    /// error (aborts), or the timeout (aborts). Sleeps grow from 10 µs to 1 ms.
    fn poll_until(
        &mut self,
        what: &str,
        mut done: impl FnMut(c_int) -> Result<bool>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(10);
        let mut spin = crate::spin::Spin::new(crate::gpu::cuda::SPIN);
        loop {
            let state = self.async_state()?;
            if state != SUCCESS && state != IN_PROGRESS {
                return Err(self.fail_with(state, what));
            }
            if done(state)? {
                return Ok(());
            }
            if start.elapsed() >= self.timeout {
                let e = Error::Timeout {
                    what: format!(
                        "waiting for NCCL {what} on rank {} of {} (CUDA device {}): a peer may \
                         have died; the communicator was aborted",
                        self.rank, self.size, self.device.ordinal
                    ),
                    after: self.timeout,
                };
                return Err(self.fail(e));
            }
            if !spin.yield_core() {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// Aborts the communicator (once) and remembers why; returns the error.
    fn fail(&mut self, e: Error) -> Error {
        if let Some(comm) = self.comm.take() {
            comm.abort();
            self.pending_ops.clear(); // freed with the communicator
        }
        if self.failed.is_none() {
            self.failed = Some(e.clone());
        }
        e
    }

    /// The (dtype, operator) pair for a plan, creating the pre-multiplied sum when needed.
    fn operator(&mut self, plan: Plan) -> Result<(c_uint, c_uint)> {
        match plan {
            Plan::Builtin { dtype, op } => Ok((dtype, op)),
            Plan::PreMulSum { dtype, mut scalar } => {
                let (rc, op) = self.live()?.pre_mul_sum(&mut scalar, dtype);
                self.settle(rc, "ncclRedOpCreatePreMulSum")?;
                Ok((dtype, op))
            }
        }
    }

    /// Settles a reduction's call and releases its operator: at once, or (inside a group,
    /// where the launch happens at group end) when the group ends.
    fn after_reduction(&mut self, rc: c_int, what: &str, plan: Plan, op: c_uint) -> Result<()> {
        let r = self.settle(rc, what);
        if matches!(plan, Plan::PreMulSum { .. }) {
            if self.group_depth > 0 {
                self.pending_ops.push(op);
            } else {
                self.destroy_operator(op);
            }
        }
        r
    }

    fn destroy_operator(&mut self, op: c_uint) {
        if let Ok(comm) = self.live() {
            let rc = comm.red_op_destroy(op);
            let _ = self.settle(rc, "ncclRedOpDestroy");
        }
    }
}

/// `count * size` bytes, or an error when that overflows.
fn byte_len(count: usize, size: usize) -> Result<usize> {
    count.checked_mul(size).ok_or_else(too_big)
}

fn too_big() -> Error {
    Error::InvalidArgument("the collective's byte count overflows".into())
}

impl Drop for DeviceComm {
    fn drop(&mut self) {
        if self.comm.is_none() {
            return;
        }
        while self.group_depth > 0 {
            let _ = self.group_end();
        }
        // Finalize flushes pending work and waits (bounded) for peers; destroy then frees.
        // Anything but a clean finalize aborts instead: a dead peer must not hang the drop.
        let Some(rc) = self.comm.as_ref().map(RawComm::finalize) else {
            return;
        };
        if self.settle(rc, "ncclCommFinalize").is_ok() {
            if let Some(comm) = self.comm.take() {
                comm.destroy();
            }
        }
    }
}

#[cfg(test)]
mod tests;
