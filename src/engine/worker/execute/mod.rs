//! Executing a response: fusion, scaling and output allocation happen here once, for every
//! collective; the algorithms in [`crate::collective`] see only contiguous byte buffers.
//!
//! This file takes a response from the coordinator to completed handles: errors, joined
//! ranks, the device's route, the timeline, and who gets which output. The collectives'
//! own steps are apart: [`fusion`] the fused allreduce, [`unfused`] the ops of one entry.

mod fusion;
mod unfused;

use crate::collective;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::OpKind;

use crate::control::message::{DeviceKind, Item, Response};
use crate::engine::entry::Entry;
use crate::engine::handle::Output;
use crate::engine::tensor::TensorBuf;
use crate::timeline::{json_string, transfer_activity, Timeline};

use super::Worker;
use fusion::allreduce;
use unfused::{allgather, alltoall, broadcast, reducescatter};

impl Worker {
    /// Runs one response and completes the handles of its entries.
    pub(super) fn execute(&mut self, resp: Response) {
        if resp.kind == OpKind::Join {
            if let Some(h) = self.join.take() {
                h.complete(match &resp.error {
                    Some((code, msg)) => Err(Error::from_code(*code, msg, "join")),
                    None => Ok(Output {
                        last_joined: Some(resp.last_joined),
                        ..Output::default()
                    }),
                });
            }
            return;
        }
        for item in &resp.items {
            if let Some(id) = item.cache_id {
                self.remember(&item.request, id);
            }
        }
        let mut entries: Vec<Option<Entry>> = resp
            .items
            .iter()
            .map(|i| {
                self.pending
                    .remove(&(i.request.set_id, i.request.name.clone()))
            })
            .collect();
        for (item, entry) in resp.items.iter().zip(&entries) {
            if entry.is_some() {
                self.next_under_base(&item.request);
            }
        }
        if let Some((code, msg)) = &resp.error {
            if let Some(t) = &self.timeline {
                let args = format!("{{\"error\":{}}}", json_string(msg));
                resp.items
                    .iter()
                    .for_each(|i| t.end(&i.request.name, Some(args.clone())));
            }
            let err = Error::from_code(*code, msg, &resp.items[0].request.name);
            for e in entries.into_iter().flatten() {
                e.handle.complete(Err(err.clone()));
            }
            return;
        }
        let joined_here = resp.joined.contains(&self.rank);
        if entries.iter().any(Option::is_none) && !(joined_here && resp.kind == OpKind::Allreduce) {
            let err = Error::Io(format!(
                "internal error: rank {} got a {} response for a tensor it never submitted",
                self.rank,
                resp.kind.name()
            ));
            self.fail(err);
            return;
        }
        let Some(members) = self.sets.get(&resp.set_id).cloned() else {
            let err = Error::InvalidArgument(format!("process set {} was removed", resp.set_id));
            for e in entries.into_iter().flatten() {
                e.handle.complete(Err(err.clone()));
            }
            return;
        };
        let trace = Trace {
            timeline: self.timeline.as_ref(),
            names: resp.items.iter().map(|i| i.request.name.as_str()).collect(),
        };
        trace.end(); // negotiation
        trace.begin(resp.kind.name());
        let on_device = resp.items[0].request.device == DeviceKind::Cuda;
        let mut staging = None;
        if on_device
            || entries
                .iter()
                .flatten()
                .any(|e| e.request.device != DeviceKind::Host)
        {
            // Only CUDA ops fail on the device path's errors: the host path is unharmed.
            let staged = if on_device {
                self.device.stage(self.rank, &members, &resp, &mut entries)
            } else {
                Err(Error::Io(
                    "internal error: a host response for CUDA tensors".into(),
                ))
            };
            match staged {
                // A staged set's tensors now lie in host memory: the host collectives below
                // run them, and their results go back to the device before the handles
                // complete.
                Ok(Some(s)) => staging = Some(s),
                Ok(None) | Err(_) => {
                    trace.begin(device_activity(resp.kind));
                    let (transport, timeout) = (&mut *self.transport, self.timeout);
                    let tuning = &self.tuning;
                    // A layered set's step across hosts: the host collectives, flat.
                    let mut cross = |group: &[usize], buf: &mut [u8], red| {
                        let mut comm =
                            Communicator::new(&mut *transport, group, timeout, tuning.clone());
                        collective::allreduce(&mut comm, buf, red)
                    };
                    let result = staged.and_then(|_| {
                        self.device
                            .execute(self.rank, &members, &resp, &mut entries, &mut cross)
                    });
                    trace.end();
                    trace.end_op(&resp.items);
                    for e in entries.into_iter().flatten() {
                        e.handle
                            .complete(result.clone().map(|()| Output::default()));
                    }
                    return;
                }
            }
        }
        let mut comm = Communicator::new(
            &mut *self.transport,
            &members,
            self.timeout,
            self.tuning.clone(),
        )
        .with_hosts(&self.hosts);
        let transfer = transfer_activity(resp.kind);
        let result: Result<Vec<Output>> = match resp.kind {
            OpKind::Allreduce => allreduce(
                &mut comm,
                &mut self.fusion,
                &resp.items,
                &mut entries,
                &trace,
            )
            .map(|()| {
                entries
                    .iter_mut()
                    .map(|e| e.as_mut().map(owned_outputs).unwrap_or_default())
                    .collect()
            }),
            _ => {
                let entry = entries[0].as_mut().expect("checked above");
                let item = &resp.items[0];
                trace.begin(transfer);
                let out = match resp.kind {
                    OpKind::Allgather => allgather(&mut comm, item, entry),
                    OpKind::Broadcast => {
                        broadcast(&mut comm, &members, entry).map(|()| owned_outputs(entry))
                    }
                    OpKind::Alltoall => alltoall(&mut comm, item, entry),
                    OpKind::Reducescatter => reducescatter(&mut comm, entry),
                    OpKind::Barrier => collective::barrier(&mut comm).map(|()| Output::default()),
                    OpKind::Allreduce | OpKind::Join => unreachable!("handled above"),
                };
                trace.end();
                out.map(|o| vec![o])
            }
        };
        trace.end_op(&resp.items);
        drop(trace);
        let result = match staging {
            Some(s) => result.and_then(|outs| self.device.unstage(resp.set_id, s).map(|()| outs)),
            None => result,
        };
        match result {
            Ok(outputs) => {
                for (e, out) in entries.into_iter().zip(outputs) {
                    if let Some(e) = e {
                        e.handle.complete(Ok(out));
                    }
                }
            }
            Err(err) => {
                let err = self.diagnose(err);
                // The entries in flight were taken out of `pending`: fail them here, then
                // everything else.
                for e in entries.into_iter().flatten() {
                    e.handle.complete(Err(err.clone()));
                }
                self.fail(err);
            }
        }
    }
}

/// The timeline's name for a collective on the NCCL path (Horovod's).
fn device_activity(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Allreduce => "NCCL_ALLREDUCE",
        OpKind::Broadcast => "NCCL_BCAST",
        OpKind::Reducescatter => "NCCL_REDUCESCATTER",
        OpKind::Allgather => "NCCL_ALLGATHER",
        OpKind::Alltoall => "NCCL_ALLTOALL",
        _ => "NCCL",
    }
}

/// Timeline events for every tensor of a response (a no-op without a timeline).
struct Trace<'a> {
    timeline: Option<&'a Timeline>,
    names: Vec<&'a str>,
}

impl Trace<'_> {
    fn begin(&self, activity: &'static str) {
        if let Some(t) = self.timeline {
            self.names.iter().for_each(|n| t.begin(n, activity));
        }
    }

    fn end(&self) {
        if let Some(t) = self.timeline {
            self.names.iter().for_each(|n| t.end(n, None));
        }
    }

    /// Ends the op's outer activity, recording each tensor's dtype and shape.
    fn end_op(&self, items: &[Item]) {
        if let Some(t) = self.timeline {
            for (n, item) in self.names.iter().zip(items) {
                let meta: Vec<String> = item
                    .request
                    .tensors
                    .iter()
                    .map(|m| format!("{} {:?}", m.dtype.name(), m.shape))
                    .collect();
                let args = format!("{{\"tensors\":{}}}", json_string(&meta.join("; ")));
                t.end(n, Some(args));
            }
        }
    }
}

/// Results written into engine-owned output buffers (callers without memory of their own,
/// such as Rust users and tests) are handed back through the `Output`.
fn owned_outputs(e: &mut Entry) -> Output {
    let mut out = Output::default();
    for t in e.spec.tensors.iter_mut() {
        if matches!(t.output, Some(TensorBuf::Owned(_) | TensorBuf::Pages(_))) {
            let buf = t.output.take().expect("matched above");
            out.tensors.push((buf, t.meta.shape.clone()));
        }
    }
    out
}
