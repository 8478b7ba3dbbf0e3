//! CUDA tensors on the NCCL backend ([`crate::backend::nccl`]): the checks a submission of
//! device memory gets, and the execution of a response whose tensors live on a GPU.
//!
//! One [`DeviceComm`] per process set, created on the set's first CUDA response. Every member
//! executes responses in the one global order the coordinator sets, so every member reaches
//! that response at the same point and the creation (a collective of its own) matches up. The
//! set's first rank makes the NCCL unique id and hands it over through the job's rendezvous
//! store. A creation that fails (no CUDA driver, no usable NCCL, a peer that never came) is
//! kept: that op and every later CUDA op of the set fail with its error, on every member, and
//! host ops go on as before. Nothing is looked for before the first CUDA op: a CPU job never
//! loads `libnccl` or `libcuda`.
//!
//! Ordering: the communicator runs on a stream of its own. At execution an event is recorded
//! on each stream the submitters named (the framework's current stream at submission), the
//! communicator's stream waits on it, the response's collectives run as one NCCL group, and
//! the handles complete once an event recorded after them has completed — a bounded wait that
//! aborts the communicator when a peer never joins. Results are in the caller's memory when
//! `synchronize` returns, so later framework work on any stream sees them.
//!
//! Fused responses (several allreduces) are one NCCL group of per-tensor calls, not a copy
//! into a device fusion buffer (that would need device allocations of the engine's own).

use std::collections::HashMap;
use std::time::Duration;

use crate::backend::cuda::{cuda_ready, DeviceBuf, Stream};
use crate::backend::nccl::{check_device_op, unique_id_key, DeviceComm, Nccl};
use crate::bootstrap::tcp_store::TcpStore;
use crate::error::{Error, Result};
use crate::types::OpKind;

use super::message::{DeviceKind, Response};
use super::tensor::TensorBuf;
use super::worker::Entry;
use super::OpSpec;

/// Where a communicator's unique id is exchanged, and the limits of the waits.
pub(super) struct DeviceState {
    /// The job's rendezvous store (address, secret); `None` for a one-rank job without one.
    rendezvous: Option<(String, Vec<u8>)>,
    /// The engine's `init()` count, which keys the store entries.
    generation: u64,
    /// Bounds the unique-id wait, the communicator's creation and every collective.
    timeout: Duration,
    /// Bounds connecting to the store.
    connect_timeout: Duration,
    /// Per process set: its communicator, or why it could not be made.
    comms: HashMap<u32, std::result::Result<DeviceComm, Error>>,
}

impl DeviceState {
    pub(super) fn new(
        rendezvous: Option<(String, Vec<u8>)>,
        generation: u64,
        timeout: Duration,
        connect_timeout: Duration,
    ) -> DeviceState {
        DeviceState {
            rendezvous,
            generation,
            timeout,
            connect_timeout,
            comms: HashMap::new(),
        }
    }

    /// Runs the collectives of a CUDA response (`entries` line up with its items). The
    /// caller completes the handles with the result.
    pub(super) fn execute(
        &mut self,
        rank: usize,
        members: &[usize],
        resp: &Response,
        entries: &mut [Option<Entry>],
    ) -> Result<()> {
        let ordinal = device_of(entries)?;
        let comm = self.comm(resp.set_id, members, rank, ordinal)?;
        if comm.device() != ordinal as usize {
            // The other members go on into the collective; leaving the communicator live here
            // would only make them wait longer. Aborted, every later op of the set fails too.
            let e = Error::InvalidArgument(format!(
                "process set {}'s NCCL communicator is on CUDA device {}, but tensor '{}' is on \
                 device {ordinal}: use one GPU per process",
                resp.set_id,
                comm.device(),
                resp.items[0].request.name
            ));
            comm.abort();
            return Err(e);
        }
        let nccl_stream = comm.stream()?;
        let mut waited: Vec<usize> = Vec::new();
        for e in entries.iter().flatten() {
            for t in &e.spec.tensors {
                let (_, s) = t.input.cuda().expect("checked by device_of");
                if !waited.contains(&s) {
                    // SAFETY: the submitter named this stream of the tensor's device, live
                    // until the op completes (TensorBuf::device's contract).
                    let user = unsafe { Stream::from_raw(s) };
                    let ready = comm.record(user)?;
                    comm.stream_wait(nccl_stream, &ready)?;
                    waited.push(s);
                }
            }
        }
        comm.group_start()?;
        let enqueued = enqueue(comm, members, resp.kind, entries, nccl_stream);
        // Closed even after a failed enqueue: NCCL's group state is per thread.
        let closed = comm.group_end();
        enqueued.and(closed)?;
        let done = comm.record(nccl_stream)?;
        comm.wait(&done)
    }

    /// The set's communicator, created now if this is its first CUDA response.
    fn comm(
        &mut self,
        set_id: u32,
        members: &[usize],
        rank: usize,
        ordinal: u32,
    ) -> Result<&mut DeviceComm> {
        if !self.comms.contains_key(&set_id) {
            let made = self.create(set_id, members, rank, ordinal);
            match &made {
                Ok(c) => log::debug!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: NCCL communicator of process set {set_id} on CUDA device \
                     {ordinal} ({} of {})",
                    c.rank(),
                    c.size()
                ),
                Err(e) => log::warn!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: no NCCL communicator for process set {set_id}: {e}; its CUDA \
                     ops fail"
                ),
            }
            self.comms.insert(set_id, made);
        }
        match self.comms.get_mut(&set_id).expect("inserted above") {
            Ok(c) => Ok(c),
            Err(e) => Err(e.clone()),
        }
    }

    fn create(
        &self,
        set_id: u32,
        members: &[usize],
        rank: usize,
        ordinal: u32,
    ) -> Result<DeviceComm> {
        // Asked before the store is touched: ranks without CUDA (and in practice all ranks of
        // a job lack it alike) fail at once instead of waiting for an id.
        cuda_ready()?;
        let nccl = Nccl::for_process(&[])?;
        let me = members.binary_search(&rank).map_err(|_| {
            Error::InvalidArgument(format!("rank {rank} is not in process set {set_id}"))
        })?;
        let id = match &self.rendezvous {
            _ if members.len() == 1 => nccl.unique_id()?,
            Some((addr, secret)) => {
                let store = TcpStore::connect(addr.as_str(), secret, self.connect_timeout)?;
                // Apart from the keys `_core.nccl_unique_id` (a diagnostic) writes.
                let key = format!("{}/engine", unique_id_key(self.generation, set_id, 0));
                nccl.exchange_unique_id(&store, &key, me, self.timeout)?
            }
            None => {
                return Err(Error::InvalidArgument(
                    "an NCCL communicator of several ranks needs the job's rendezvous store, \
                     and this job has none"
                        .into(),
                ))
            }
        };
        DeviceComm::init(
            &nccl,
            &id,
            me,
            members.len(),
            ordinal as usize,
            self.timeout,
        )
    }

    /// Aborts every communicator (all their work has completed: each op waits for its own),
    /// which unlike a finalize needs nothing from peers that may be gone already.
    pub(super) fn close(&mut self) {
        for c in self.comms.values_mut().flatten() {
            c.abort();
        }
        self.comms.clear();
    }
}

/// Enqueues one call per tensor of the response on `stream` (inside the caller's group).
fn enqueue(
    comm: &mut DeviceComm,
    members: &[usize],
    kind: OpKind,
    entries: &[Option<Entry>],
    stream: Stream,
) -> Result<()> {
    for e in entries.iter().flatten() {
        let req = &e.request;
        for t in &e.spec.tensors {
            let count = t.meta.numel();
            if count == 0 {
                // Every member has the same shape (validated), so every member skips it.
                continue;
            }
            let input = device_buf(&t.input);
            let output = t.output.as_ref().map(device_buf).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} of CUDA tensor '{}' needs its output allocated by the caller",
                    kind.name(),
                    req.name
                ))
            })?;
            let dtype = t.meta.dtype;
            match kind {
                OpKind::Allreduce => comm.allreduce(
                    &input,
                    &output,
                    count,
                    dtype,
                    req.op,
                    req.prescale,
                    req.postscale,
                    stream,
                )?,
                OpKind::Broadcast => {
                    let root = members.binary_search(&req.root).map_err(|_| {
                        Error::InvalidArgument(format!("root {} is not in the set", req.root))
                    })?;
                    comm.broadcast(&input, &output, count, dtype, root, stream)?
                }
                OpKind::Reducescatter => comm.reducescatter(
                    &input,
                    &output,
                    count / members.len(),
                    dtype,
                    req.op,
                    req.prescale,
                    req.postscale,
                    stream,
                )?,
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "{} is not run on the NCCL path",
                        other.name()
                    )))
                }
            }
        }
    }
    Ok(())
}

/// The backend's view of a device buffer (host buffers never get here: see `device_of`).
fn device_buf(t: &TensorBuf) -> DeviceBuf {
    match t {
        // SAFETY: TensorBuf::device's contract is DeviceBuf::from_raw's: device memory of
        // `len` bytes, untouched by anything else until the op completes.
        TensorBuf::Device { ptr, len, .. } => unsafe { DeviceBuf::from_raw(*ptr, *len) },
        _ => unreachable!("device_of checked that every buffer is device memory"),
    }
}

/// The one CUDA device every tensor (input and output) of the response is on.
fn device_of(entries: &[Option<Entry>]) -> Result<u32> {
    let mut device = None;
    for e in entries {
        let e = e.as_ref().ok_or_else(|| {
            Error::Io("internal error: a CUDA response without this rank's tensor".into())
        })?;
        for t in &e.spec.tensors {
            for buf in std::iter::once(&t.input).chain(t.output.as_ref()) {
                let Some((d, _)) = buf.cuda() else {
                    return Err(Error::Io(format!(
                        "internal error: tensor '{}' of a CUDA response is in host memory",
                        e.request.name
                    )));
                };
                match device {
                    None => device = Some(d),
                    Some(prev) if prev != d => {
                        return Err(Error::InvalidArgument(format!(
                            "CUDA tensors of one response are on devices {prev} and {d}: use \
                             one GPU per process"
                        )))
                    }
                    Some(_) => {}
                }
            }
        }
    }
    device.ok_or_else(|| Error::Io("internal error: a CUDA response without tensors".into()))
}

/// Where a submitted op's tensors live, checked locally (errors every rank would hit alike):
/// all in host memory, or all on one CUDA device, with outputs the caller allocated, for an
/// op the NCCL path runs ([`check_device_op`]). `n` is the set's size.
pub(super) fn op_device(spec: &OpSpec, n: usize) -> Result<DeviceKind> {
    let bufs = spec
        .tensors
        .iter()
        .flat_map(|t| std::iter::once(&t.input).chain(t.output.as_ref()));
    let cuda: Vec<Option<(u32, usize)>> = bufs.map(TensorBuf::cuda).collect();
    if cuda.iter().all(Option::is_none) {
        return Ok(DeviceKind::Host);
    }
    let what = || format!("{} of '{}'", spec.kind.name(), spec.name);
    if cuda.iter().any(Option::is_none) {
        return Err(Error::InvalidArgument(format!(
            "{}: its tensors (inputs and outputs) must all be in host memory or all on one \
             CUDA device",
            what()
        )));
    }
    let first = cuda[0].expect("checked above").0;
    if let Some((d, _)) = cuda.iter().flatten().find(|(d, _)| *d != first) {
        return Err(Error::InvalidArgument(format!(
            "{}: its tensors are on CUDA devices {first} and {d}",
            what()
        )));
    }
    for t in &spec.tensors {
        check_device_op(
            spec.kind,
            t.meta.dtype,
            spec.op,
            spec.prescale,
            spec.postscale,
            n,
            &t.meta.shape,
        )
        .map_err(|e| Error::InvalidArgument(format!("{} on CUDA: {e}", what())))?;
        let want = match spec.kind {
            OpKind::Reducescatter => t.input.len() / n.max(1),
            _ => t.input.len(),
        };
        match &t.output {
            Some(out) if out.len() == want => {}
            Some(out) => {
                return Err(Error::InvalidArgument(format!(
                    "{}: the output holds {} bytes, the result {want}",
                    what(),
                    out.len()
                )))
            }
            None => {
                return Err(Error::InvalidArgument(format!(
                    "{}: a CUDA tensor's output must be allocated by the caller (the engine \
                     allocates no device memory)",
                    what()
                )))
            }
        }
    }
    Ok(DeviceKind::Cuda)
}
