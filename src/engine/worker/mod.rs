//! The worker: drain submissions → send them to the coordinator → execute the responses in
//! the order they arrive → complete handles. [`Worker::step`] is one turn of that; who turns
//! it, and how idle waits work, is [`super::progress`].
//!
//! Its state is private to this module: running a response ([`execute`]) is a child module
//! so that it can reach the transport, pending ops and fusion buffer, while the rest of the
//! engine only builds a worker and turns it through the methods [`super::progress`] needs.
//! Its control connection is [`control`]'s, its failures [`failure`]'s.

mod control;
mod execute;
mod failure;

use std::collections::{hash_map, HashMap, VecDeque};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::comm::Tuning;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::transport::Transport;
use crate::types::{OpKind, ReduceOp};

use super::entry::Entry;
use super::handle::Handle;
use super::{Command, OpSpec, SetScope, Shared};
use crate::control::connection::{FrameConn, OUTPUT_RETRY};
use crate::control::message::{DeviceKind, Request, Submit, ToCoordinator};
use crate::device::{op_device, DeviceState};
use crate::timeline::{self, Timeline};
use std::os::fd::RawFd;

pub(super) struct Worker {
    rank: usize,
    transport: Box<dyn Transport>,
    control: FrameConn,
    shared: Arc<Shared>,
    pending: HashMap<(u32, String), Entry>,
    /// (set, shared base name) of this rank's op at the coordinator under that base (see
    /// [`Op::base`](crate::control::message::Op::base)) → the submissions of later ops under
    /// it, sent one at a time as each op before them completes.
    bases: HashMap<(u32, String), VecDeque<Submit>>,
    /// Rank-side response cache: (set, name) → (id, request it stands for).
    cache: HashMap<(u32, String), (u64, Request)>,
    cache_capacity: usize,
    join: Option<Handle>,
    set_waiters: VecDeque<SetWaiter>,
    sets: HashMap<u32, Vec<usize>>,
    /// Host index of every global rank, for hierarchical collectives.
    hosts: Vec<u32>,
    /// Allreduce fusion buffer: empty until first needed, then of a fixed size.
    fusion: Vec<u8>,
    timeout: Duration,
    tuning: Tuning,
    failed: Option<Error>,
    coordinator_left: bool,
    /// Why the control path above this rank's node closed, when a relay said so.
    path_closed: Option<Error>,
    control_open: bool,
    /// Rank 0's timeline, when one is being written.
    timeline: Option<Timeline>,
    /// `shutdown()` was called; the loop leaves after the current message.
    shutdown_requested: bool,
    /// The shutdown has been carried out; nothing runs any more.
    finished: bool,
    /// NCCL communicators for CUDA tensors (see [`crate::device`]).
    device: DeviceState,
}

/// What one [`Worker::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Something was sent, received or executed.
    Busy,
    /// Nothing to do until a submission or a control message arrives.
    Idle,
    /// The worker has shut down.
    Finished,
}

/// A caller waiting for a process-set change, by what it asked: answers are matched to it by
/// the set's ranks (or id), since sets its members register alone may be answered in another
/// order than this rank asked (torch.distributed's point-to-point pairs register from threads
/// of their own).
enum SetWaiter {
    /// The set's ranks and its limit as sent (milliseconds, 0: none).
    Add(Vec<usize>, u64, mpsc::Sender<Result<u32>>),
    Remove(u32, mpsc::Sender<Result<bool>>),
}

impl Worker {
    #[allow(clippy::too_many_arguments)] // what the engine's start hands its one worker
    pub(super) fn new(
        config: &Config,
        rank: usize,
        transport: Box<dyn Transport>,
        control: FrameConn,
        shared: Arc<Shared>,
        sets: HashMap<u32, Vec<usize>>,
        hosts: Vec<u32>,
        device: DeviceState,
    ) -> Result<Worker> {
        Ok(Worker {
            rank,
            transport,
            control,
            shared,
            pending: HashMap::new(),
            bases: HashMap::new(),
            cache: HashMap::new(),
            cache_capacity: config.cache_capacity,
            join: None,
            set_waiters: VecDeque::new(),
            sets,
            hosts,
            fusion: Vec::new(),
            timeout: config.timeout,
            tuning: config.tuning.clone(),
            failed: None,
            coordinator_left: false,
            path_closed: None,
            control_open: true,
            shutdown_requested: false,
            finished: false,
            device,
            timeline: match (&config.timeline, rank) {
                (Some(path), 0) => match Timeline::start(path, config.timeline_mark_cycles) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        log::warn!(target: crate::LOG_TARGET, "no timeline: {e}");
                        None
                    }
                },
                _ => None,
            },
        })
    }

    /// One turn of the loop: sends queued submissions to the coordinator, then handles (and
    /// executes) whatever the coordinator sent. Whoever holds the worker may call it: the
    /// engine thread, or a caller waiting for its op (see [`super::progress`]).
    pub(super) fn step(&mut self) -> Step {
        if self.finished {
            return Step::Finished;
        }
        let mut busy = self.flush_control();
        busy |= self.drain_queue();
        if self.shutdown_requested {
            // Said even after a failure elsewhere (the control connection may well be fine):
            // otherwise the coordinator reports this clean exit as a rank gone, rank 0 even
            // about itself. A failed engine waits for it only briefly.
            let wait = if self.failed.is_none() {
                self.timeout
            } else {
                self.timeout.min(Duration::from_millis(100))
            };
            if self
                .control
                .send(&ToCoordinator::Leave.encode(), wait)
                .is_ok()
            {
                // Closing drops what is still queued: the coordinator must hear that we left.
                let _ = self.control.flush_all(wait);
            }
            let healthy = self.failed.is_none();
            self.fail_all(Error::Shutdown(
                "ferrovod was shut down on this rank".into(),
            ));
            self.control.close();
            self.device.close(healthy);
            self.finished = true;
            return Step::Finished;
        }
        busy |= self.read_control();
        if busy {
            Step::Busy
        } else {
            Step::Idle
        }
    }

    /// How long an idle worker may block: short while submissions wait for the coordinator to
    /// make room (nothing wakes us when it does).
    pub(super) fn idle_timeout(&self) -> Duration {
        if self.control.has_output() {
            OUTPUT_RETRY
        } else {
            Duration::from_secs(1)
        }
    }

    /// The descriptors an idle worker waits on: the submission waker and, while open, the
    /// control connection.
    pub(super) fn idle_fds(&self) -> Vec<RawFd> {
        let mut fds = vec![self.shared.waker.fd()];
        if self.control_open {
            fds.push(self.control.fd());
        }
        fds
    }

    /// Before blocking on [`Worker::idle_fds`]: asks the coordinator to ring. False when its
    /// input is already waiting (turn again instead of blocking).
    pub(super) fn arm(&self) -> bool {
        !self.control_open || self.control.arm()
    }

    /// After waking (or deciding not to block): stops the ringing; `rang`: the control
    /// descriptor polled readable.
    pub(super) fn disarm(&mut self, rang: bool) {
        self.control.disarm(rang);
    }

    /// Takes every queued command and sends new submissions to the coordinator in one
    /// message. Called before each collective too, so that the next tensors are negotiated
    /// while the current ones are on the wire. Returns whether anything was queued.
    fn drain_queue(&mut self) -> bool {
        let cmds = std::mem::take(&mut *self.shared.queue.lock());
        if cmds.is_empty() {
            return false;
        }
        let mut submits = Vec::new();
        for cmd in cmds {
            match cmd {
                Command::Shutdown => self.shutdown_requested = true,
                cmd => self.command(cmd, &mut submits),
            }
        }
        if !submits.is_empty() {
            self.send(ToCoordinator::Submit(submits));
        }
        true
    }

    fn command(&mut self, cmd: Command, submits: &mut Vec<Submit>) {
        match cmd {
            Command::Op(spec, handle) => {
                if let Some(e) = &self.failed {
                    handle.complete(Err(e.clone()));
                    return;
                }
                let members = match self.membership(&spec) {
                    Ok(m) => m,
                    Err(e) => return handle.complete(Err(e)),
                };
                let mut spec = *spec;
                match self.check(&mut spec, &members) {
                    Ok(request) => {
                        let submit = self.submission(&request);
                        self.track(spec, handle, request, submit, submits);
                    }
                    Err(e) => self.reject(spec, e.to_string(), handle, submits),
                }
            }
            Command::Reject(spec, reason, handle) => {
                if let Some(e) = &self.failed {
                    handle.complete(Err(e.clone()));
                    return;
                }
                if let Err(e) = self.membership(&spec) {
                    return handle.complete(Err(e));
                }
                self.reject(*spec, reason, handle, submits);
            }
            Command::Join(handle) => {
                if let Some(e) = &self.failed {
                    handle.complete(Err(e.clone()));
                    return;
                }
                self.join = Some(handle);
                self.send(ToCoordinator::Join);
            }
            Command::AddSet(ranks, scope, tx) => {
                if let Some(e) = &self.failed {
                    let _ = tx.send(Err(e.clone()));
                    return;
                }
                let (msg, timeout_ms) = match scope {
                    SetScope::EveryRank => (
                        ToCoordinator::AddSet {
                            ranks: ranks.clone(),
                        },
                        0,
                    ),
                    SetScope::Members { timeout } => {
                        // At least a millisecond: 0 on the wire means no limit of the set's own.
                        let timeout_ms = timeout.map_or(0, |t| (t.as_millis() as u64).max(1));
                        let ranks = ranks.clone();
                        (
                            ToCoordinator::AddMemberSet { ranks, timeout_ms },
                            timeout_ms,
                        )
                    }
                };
                self.set_waiters
                    .push_back(SetWaiter::Add(ranks, timeout_ms, tx));
                self.send(msg);
            }
            Command::RemoveSet(id, tx) => {
                if let Some(e) = &self.failed {
                    let _ = tx.send(Err(e.clone()));
                    return;
                }
                self.set_waiters.push_back(SetWaiter::Remove(id, tx));
                self.send(ToCoordinator::RemoveSet { id });
            }
            Command::Timeline(start, tx) => {
                // Only rank 0 writes the timeline, as in Horovod.
                let result = match start {
                    Some((path, mark_cycles)) if self.rank == 0 => {
                        self.timeline = None;
                        Timeline::start(&path, mark_cycles).map(|t| self.timeline = Some(t))
                    }
                    Some(_) => Ok(()),
                    None => {
                        self.timeline = None;
                        Ok(())
                    }
                };
                let _ = tx.send(result);
            }
            Command::Shutdown => {}
        }
    }

    fn submission(&mut self, request: &Request) -> Submit {
        let key = (request.set_id, request.name.clone());
        if let Some((id, cached)) = self.cache.get(&key) {
            if cached == request {
                return Submit::Cached {
                    set_id: request.set_id,
                    id: *id,
                };
            }
        }
        Submit::Full(request.clone())
    }

    /// Sends `submit` for `request` and keeps the op until its response comes.
    fn track(
        &mut self,
        spec: OpSpec,
        handle: Handle,
        request: Request,
        submit: Submit,
        submits: &mut Vec<Submit>,
    ) {
        let key = (request.set_id, request.name.clone());
        if self.pending.contains_key(&key) {
            // The engine's name claim (`names`) keeps a second op under a pending name out.
            handle.complete(Err(Error::Io(format!(
                "internal error: a second op '{}' reached the engine while one is pending",
                request.name
            ))));
            return;
        }
        match request.base() {
            Some(base) => match self.bases.entry((request.set_id, base.to_string())) {
                hash_map::Entry::Occupied(mut later) => later.get_mut().push_back(submit),
                hash_map::Entry::Vacant(first) => {
                    first.insert(VecDeque::new());
                    submits.push(submit);
                }
            },
            None => submits.push(submit),
        }
        if let Some(t) = &self.timeline {
            t.begin(&request.name, timeline::negotiate_activity(request.kind));
        }
        self.pending.insert(
            key,
            Entry {
                spec,
                handle,
                request,
            },
        );
    }

    /// An op this rank refuses still goes to the coordinator, as a rejection: the other
    /// members wait for it otherwise, and this way all of them fail it with `reason`.
    fn reject(&mut self, spec: OpSpec, reason: String, handle: Handle, submits: &mut Vec<Submit>) {
        let request = spec.request(DeviceKind::Host);
        let submit = Submit::Rejected {
            request: request.clone(),
            reason,
        };
        self.track(spec, handle, request, submit, submits);
    }

    /// The members of the op's process set, or why this rank cannot submit to it (errors the
    /// other members do not wait on: the set does not exist, or this rank is not in it).
    fn membership(&self, spec: &OpSpec) -> Result<Vec<usize>> {
        let members = self.sets.get(&spec.set_id).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}: process set {} does not exist, or has not been registered",
                spec.kind.name(),
                spec.set_id
            ))
        })?;
        if members.binary_search(&self.rank).is_err() {
            return Err(Error::InvalidArgument(format!(
                "{}: rank {} is not a member of process set {} (ranks {:?})",
                spec.kind.name(),
                self.rank,
                spec.set_id,
                members
            )));
        }
        Ok(members.clone())
    }

    /// Checks an op locally and builds its request (an error: the op is refused, see
    /// [`Worker::reject`]).
    fn check(&self, spec: &mut OpSpec, members: &[usize]) -> Result<Request> {
        let n = members.len();
        let reducing = matches!(spec.kind, OpKind::Allreduce | OpKind::Reducescatter);
        if spec.kind == OpKind::Allreduce && spec.op == ReduceOp::Adasum {
            for t in &spec.tensors {
                crate::collective::adasum::check_op(t.meta.dtype, n)?;
            }
        }
        if spec.kind == OpKind::Reducescatter
            && !matches!(spec.op, ReduceOp::Sum | ReduceOp::Average)
        {
            return Err(Error::InvalidArgument(
                "Reducescatter currently only supports AVERAGE and SUM.".into(),
            ));
        }
        if spec.kind == OpKind::Broadcast && members.binary_search(&spec.root).is_err() {
            return Err(Error::InvalidArgument(format!(
                "broadcast received invalid root rank {}: not in process set {} (ranks {:?})",
                spec.root, spec.set_id, members
            )));
        }
        for t in &spec.tensors {
            if t.input.len() != t.meta.nbytes() {
                return Err(Error::InvalidArgument(format!(
                    "tensor '{}' has {} bytes but its shape {:?} of {} needs {}",
                    spec.name,
                    t.input.len(),
                    t.meta.shape,
                    t.meta.dtype.name(),
                    t.meta.nbytes()
                )));
            }
            if reducing && t.meta.dtype == crate::types::DType::Bool {
                return Err(Error::InvalidArgument(format!(
                    "{} of tensor '{}': bool tensors cannot be reduced",
                    spec.kind.name(),
                    spec.name
                )));
            }
            if matches!(
                spec.kind,
                OpKind::Allgather | OpKind::Alltoall | OpKind::Reducescatter
            ) && t.meta.shape.is_empty()
            {
                return Err(Error::InvalidArgument(format!(
                    "{} of tensor '{}': a 0-d (scalar) tensor has no first dimension",
                    spec.kind.name(),
                    spec.name
                )));
            }
        }
        if spec.kind == OpKind::Alltoall {
            let rows = spec.tensors[0].meta.shape[0];
            if spec.splits.is_empty() {
                if rows % n != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "alltoall of '{}': first dimension {rows} is not divisible by the {n} ranks; pass splits",
                        spec.name
                    )));
                }
                spec.splits = vec![rows / n; n];
            }
            if spec.splits.len() != n || spec.splits.iter().sum::<usize>() != rows {
                return Err(Error::InvalidArgument(format!(
                    "alltoall of '{}': splits {:?} must have one entry per rank of the set ({n}) summing to the first dimension {rows}",
                    spec.name, spec.splits
                )));
            }
        }
        let device = op_device(spec, n)?;
        Ok(spec.request(device))
    }
}
