//! The engine's one entry for ops: every adapter's op (NumPy, torch, TensorFlow, host or CUDA)
//! comes in through [`Door::run`], which decides its way in — the fast path for an op whose
//! caller waits at once (offered, reduced there or declined, its slot spent or not), else the
//! engine's queue — so that no binding or adapter holds a copy of that decision. Device ops
//! take the queue; the engine routes them at execution (`device.rs`).
//!
//! A `Door` is a cheap clone of the engine's shared state: a caller waits in the fast path's
//! offer holding it, not the engine, so other threads (and `shutdown`) are never held up.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::transport::messenger::{Message, Payload, ANY_PEER};
use crate::types::OpKind;

use super::fast::Outcome;
use super::handle::{Handle, Output};
use super::progress::Progress;
use super::tensor::TensorBuf;
use super::{Command, OpSpec, Shared, TensorSpec};
use crate::control::names::NameClaim;

/// What became of an op given to [`Door::run`].
pub enum Ran {
    /// Reduced on the fast path: the output its handle would have handed back.
    Done(Output),
    /// Queued in the engine; the second field says what the fast path made of it
    /// (`Ineligible` when it was not offered).
    Queued(Handle, Outcome),
}

/// The engine's entry for ops (see the module doc).
#[derive(Clone)]
pub struct Door {
    shared: Arc<Shared>,
    progress: Progress,
}

impl Door {
    pub(super) fn new(shared: Arc<Shared>, progress: Progress) -> Door {
        Door { shared, progress }
    }

    /// What a caller waiting for one of its ops uses (see [`super::progress`]).
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }

    /// Runs `op`. `now`: the caller waits for it at once, so it is first offered to the fast
    /// path (waiting there for the other ranks' offers, asking `now` between sleeps whether
    /// to give up) and queued unless reduced there; `None`: queued. Fails at once, queuing
    /// nothing, when an op under the same name is still in flight in its process set.
    pub fn run(&self, mut op: OpSpec, now: Option<&dyn Fn() -> bool>) -> Result<Ran> {
        let claim = self.claim(&op)?;
        give_outputs(&mut op)?;
        let outcome = match now {
            Some(stop) => self.shared.fast.offer_or(&mut op, stop)?,
            None => Outcome::Ineligible,
        };
        if outcome == Outcome::Done {
            return Ok(Ran::Done(fast_output(op, self.shared.fast.size())));
        }
        let slotted = outcome != Outcome::Declined;
        let handle = self.queue(op.set_id, claim, slotted, |h| Command::Op(Box::new(op), h));
        Ok(Ran::Queued(handle, outcome))
    }

    /// Runs `op` for a caller that waits for it at once ([`Door::run`] with `now`), waiting
    /// for it in the engine when the fast path did not reduce it: its output. `stop` is asked
    /// between waits whether to give up (an `Interrupted` error then).
    pub fn run_and_wait(&self, op: OpSpec, stop: &dyn Fn() -> bool) -> Result<Output> {
        match self.run(op, Some(stop))? {
            Ran::Done(out) => Ok(out),
            Ran::Queued(handle, _) => self
                .progress
                .wait_or(&handle, stop)
                .expect("a handle no one else holds is waited for once"),
        }
    }

    /// Queues an op; the handle completes when it is done ([`Door::run`] without `now`).
    pub fn submit(&self, op: OpSpec) -> Result<Handle> {
        match self.run(op, None)? {
            Ran::Queued(h, _) => Ok(h),
            Ran::Done(_) => unreachable!("an op not offered is queued"),
        }
    }

    /// Takes part in the negotiation of an op this rank refuses (arguments it cannot describe
    /// to the engine: an unknown reduction, an unsupported dtype...), so that every member of
    /// the set fails it with `reason` instead of waiting for it. `op` holds what is known of
    /// it (its tensors may be empty). The handle completes with that error once every member
    /// has submitted the name.
    pub fn reject(&self, op: OpSpec, reason: String) -> Result<Handle> {
        let claim = self.claim(&op)?;
        Ok(self.queue(op.set_id, claim, true, |h| {
            Command::Reject(Box::new(op), reason, h)
        }))
    }

    /// Sends `t`'s tensor to `t.peer`: a point-to-point message, which takes no part in the
    /// collectives' negotiation (see [`crate::transport::messenger`]). The handle completes
    /// once the peer's receive has taken it, or with why not (the receive disagreed, the peer
    /// left, the timeout passed, the job failed).
    pub fn send(&self, t: Transfer) -> Result<Handle> {
        self.transfer(t, true)
    }

    /// Receives `t.peer`'s message of `t.name` (with no peer, the first of that name from any
    /// rank) into `t`'s tensor; the handle completes once it has arrived, its output's
    /// `source` saying who sent it, or with why not.
    pub fn recv(&self, t: Transfer) -> Result<Handle> {
        self.transfer(t, false)
    }

    fn transfer(&self, t: Transfer, sending: bool) -> Result<Handle> {
        let Some(messenger) = &self.shared.messenger else {
            return Err(Error::InvalidArgument(format!(
                "'{}': a job of one rank has no other rank to message",
                t.name
            )));
        };
        if t.tensor.input.cuda().is_some() {
            return Err(Error::InvalidArgument(format!(
                "'{}': point-to-point messages carry host memory; the adapter stages device \
                 tensors through it",
                t.name
            )));
        }
        let peer = match t.peer {
            Some(p) => p,
            None if !sending => ANY_PEER,
            None => {
                return Err(Error::InvalidArgument(format!(
                    "'{}': a send names the rank it goes to",
                    t.name
                )))
            }
        };
        let meta = &t.tensor.meta;
        let desc = format!("{} {:?}", meta.dtype.name(), meta.shape);
        let h = Handle::new();
        let done = h.clone();
        let m = Message {
            peer,
            name: t.name,
            desc,
            payload: Box::new(t.tensor.input),
            timeout: t.timeout,
            done: Box::new(move |r| {
                done.complete(r.map(|peer| Output {
                    source: Some(peer),
                    ..Output::default()
                }))
            }),
        };
        if sending {
            messenger.send(m);
        } else {
            messenger.recv(m);
        }
        Ok(h)
    }

    /// Claims the name of `op` until the claim drops or moves into its handle (see
    /// [`crate::control::names`]).
    fn claim(&self, op: &OpSpec) -> Result<NameClaim> {
        self.shared.in_flight.claim(op.set_id, &op.name, op.kind)
    }

    /// Queues the command `make` builds around the handle of an op of set `set_id` whose
    /// name `claim` holds, taking its fast-path slot first when `slotted` (see
    /// [`super::fast`]).
    fn queue(
        &self,
        set_id: u32,
        claim: NameClaim,
        slotted: bool,
        make: impl FnOnce(Handle) -> Command,
    ) -> Handle {
        if slotted && set_id == 0 {
            self.shared.fast.decline();
        }
        let h = Handle::counted(self.shared.fast.outstanding()).hold(claim);
        self.push(make(h.clone()));
        h
    }

    pub(super) fn push(&self, cmd: Command) {
        self.shared.queue.lock().push(cmd);
        // A caller holding the lease drains the queue itself, and an engine thread waiting out
        // the lease wakes when it ends: no wake-up is lost by skipping it then. An engine
        // thread in its long idle poll is woken regardless (it publishes `polling` and then
        // looks at the queue; the fences pair with its own).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.shared.lease.remaining().is_none()
            || self
                .shared
                .polling
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.shared.waker.wake();
        }
    }
}

/// One point-to-point message ([`Door::send`], [`Door::recv`]).
pub struct Transfer {
    /// The global rank it goes to or comes from (`None`: a receive from any rank).
    pub peer: Option<usize>,
    /// The name both sides give it.
    pub name: String,
    /// The tensor sent from, or received into, `input` (host memory).
    pub tensor: TensorSpec,
    /// How long it may wait for its other side.
    pub timeout: Duration,
}

impl Payload for TensorBuf {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// An allreduce or broadcast of host memory whose caller gave no output gets engine memory of
/// its input's size, handed back through the op's `Output` as the other kinds' results are.
/// Every way through then finds an output; and a large one comes from the page pool, where
/// it is already faulted in and page-aligned (TensorFlow copies a host op's output that is
/// not 64-byte aligned, which NumPy's own large arrays are not).
fn give_outputs(op: &mut OpSpec) -> Result<()> {
    if matches!(op.kind, OpKind::Allreduce | OpKind::Broadcast) {
        for t in op.tensors.iter_mut() {
            if t.output.is_none() && t.input.cuda().is_none() {
                t.output = Some(TensorBuf::engine(t.input.len())?);
            }
        }
    }
    Ok(())
}

/// What the handle of an op the fast path reduced would have handed back: an output the fast
/// path allocated (allgather, reducescatter, alltoall); an (even) alltoall's received splits,
/// one block from each of the `n` ranks.
fn fast_output(op: OpSpec, n: usize) -> Output {
    let mut out = Output::default();
    if op.kind == OpKind::Alltoall {
        let rows = op.tensors[0].meta.shape[0];
        out.received_splits = vec![rows / n; n];
    }
    for t in op.tensors {
        if let Some(buf @ (TensorBuf::Owned(_) | TensorBuf::Pages(_))) = t.output {
            out.tensors.push((buf, t.meta.shape));
        }
    }
    out
}
