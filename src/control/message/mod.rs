//! Control-plane messages between each rank's engine and the coordinator, and their codec.
//! Every decode goes through [`crate::wire::Reader`], so malformed bytes become `Error::Decode`.

mod op;

pub use op::{DeviceKind, Op, Request, TensorMeta};

use crate::error::{Error, Result};
use crate::types::OpKind;
use crate::wire::{Reader, Writer};

/// A request as sent: in full, or as a response-cache id for a name seen before with the
/// same parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum Submit {
    /// First time (or parameters changed).
    Full(Request),
    /// Same as the cached request `id` of set `set_id`.
    Cached {
        /// Process set.
        set_id: u32,
        /// Cache id assigned by the coordinator.
        id: u64,
    },
    /// This rank refused the op (bad arguments, an uneven split...). It still takes part in
    /// the negotiation, so that every member fails the op with `reason` instead of waiting
    /// for it forever. `request` holds what the rank could describe (no tensors, perhaps).
    Rejected {
        /// The op as far as it is known.
        request: Request,
        /// Why this rank refused it.
        reason: String,
    },
}

/// Rank → coordinator.
#[derive(Debug, Clone, PartialEq)]
pub enum ToCoordinator {
    /// First message on a control connection.
    Hello {
        /// Sender's global rank.
        rank: usize,
    },
    /// New submissions.
    Submit(Vec<Submit>),
    /// This rank is out of data (global set).
    Join,
    /// Register a process set (every rank sends the same, in the same order).
    AddSet {
        /// Sorted global ranks.
        ranks: Vec<usize>,
    },
    /// Register a process set among its members alone: each member sends it, the others never
    /// hear of it (torch.distributed makes a group's backend on its members only). A set with
    /// these ranks that exists already is answered at once.
    AddMemberSet {
        /// Sorted global ranks.
        ranks: Vec<usize>,
        /// Milliseconds after which an op of the set that some members have not submitted
        /// fails on those that have (torch's group timeout); 0: the engine's own limit. Sets
        /// with the same ranks and different limits are different sets.
        timeout_ms: u64,
    },
    /// Unregister a process set.
    RemoveSet {
        /// Its id.
        id: u32,
    },
    /// Clean shutdown of this rank.
    Leave,
    /// This rank's transfer with `rank` made no progress for the timeout: `rank` is stopped or
    /// hung. The coordinator tells everyone, so every rank's error names it.
    Stalled {
        /// The silent rank.
        rank: usize,
        /// What was observed.
        detail: String,
    },
    /// From a relay node (see `control/node/`): the messages of the ranks below it,
    /// each with its sender, in the order they arrived.
    Relayed(Vec<(usize, ToCoordinator)>),
    /// From a relay node, in a relayed batch under the relay's own rank: every member of
    /// process set `set_id` that the relay reaches has submitted each of the cached `ids`
    /// (the relay held their submissions until the last came).
    CachedBelow {
        /// Process set.
        set_id: u32,
        /// Cache ids.
        ids: Vec<u64>,
    },
    /// From a relay node: its link to `rank` (an engine, or a node with ranks below it)
    /// closed. `rank` is gone, and the ranks below it are cut off from the coordinator.
    Lost {
        /// The rank at the far end of the link.
        rank: usize,
        /// What was observed.
        detail: String,
    },
}

/// One entry of a response: the validated request every rank executes.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// The validated request (the coordinator's copy; root, op, shapes agreed by all).
    pub request: Request,
    /// Cache id now assigned to this name: later submissions with the same parameters may
    /// send just this id.
    pub cache_id: Option<u64>,
    /// Allgather: first dimension of each tensor on each set rank (`[tensor][rank]`).
    pub first_dims: Vec<Vec<usize>>,
    /// Alltoall: splits of every set rank, row-major `[sender][receiver]`.
    pub split_matrix: Vec<usize>,
}

/// Coordinator → rank: one collective to run now (several fused entries for allreduce), or an
/// error for the named entries.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// Process set.
    pub set_id: u32,
    /// Collective kind.
    pub kind: OpKind,
    /// Entries, in the order they are packed.
    pub items: Vec<Item>,
    /// Global ranks that have joined and contribute zeros.
    pub joined: Vec<usize>,
    /// For `Join`: the last rank to join.
    pub last_joined: usize,
    /// An error every rank raises for these entries: (kind code of `Error`, message).
    pub error: Option<(u8, String)>,
}

/// Coordinator → rank.
#[derive(Debug, Clone, PartialEq)]
pub enum FromCoordinator {
    /// Every rank has connected: `init()` may return (it is collective, as in Horovod, so no
    /// rank can shut down before all are registered).
    Ready,
    /// Run these, in order.
    Responses(Vec<Response>),
    /// A cached submission referred to an id the coordinator no longer has: resend in full.
    CacheMiss {
        /// Process set.
        set_id: u32,
        /// The stale id.
        id: u64,
    },
    /// Result of `AddSet` or `AddMemberSet`: the id, or an error message.
    SetAdded {
        /// Sorted ranks.
        ranks: Vec<usize>,
        /// The limit asked for (`AddMemberSet`'s; 0 for `AddSet`), which with the ranks tells
        /// the asker which of its requests this answers.
        timeout_ms: u64,
        /// Id assigned, or the error.
        result: std::result::Result<u32, String>,
    },
    /// Result of `RemoveSet`.
    SetRemoved {
        /// Id.
        id: u32,
        /// Whether it existed, or why it was not removed.
        result: std::result::Result<bool, String>,
    },
    /// A rank shut down cleanly.
    RankLeft {
        /// Global rank.
        rank: usize,
    },
    /// A rank died, its connection broke, or it stalled.
    RankFailed {
        /// Global rank.
        rank: usize,
        /// What was observed.
        detail: String,
        /// It stopped making progress (alive but stuck) rather than disappearing.
        stalled: bool,
    },
    /// To a relay node: messages to pass down, each to every rank below the link (`None`) or
    /// to the listed ranks only.
    Down(Vec<(Option<Vec<usize>>, FromCoordinator)>),
    /// From a relay node to the ranks below it, just before it closes their links: their
    /// control path through `rank`'s node is gone (`clean`: `rank` shut down).
    PathClosed {
        /// The rank whose node went.
        rank: usize,
        /// It shut down cleanly rather than failing.
        clean: bool,
        /// What was observed.
        detail: String,
    },
}

/// A whole frame from `write`.
fn frame(write: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut w = Writer::new();
    write(&mut w);
    w.finish()
}

/// One message read from a whole frame by `read`; bytes left over are an error.
fn unframe<T>(buf: &[u8], read: impl FnOnce(&mut Reader<'_>) -> Result<T>) -> Result<T> {
    let mut r = Reader::new(buf);
    let msg = read(&mut r)?;
    r.finish()?;
    Ok(msg)
}

impl ToCoordinator {
    /// Encodes for the wire.
    pub fn encode(&self) -> Vec<u8> {
        frame(|w| self.encode_into(w))
    }

    fn encode_into(&self, w: &mut Writer) {
        match self {
            ToCoordinator::Hello { rank } => {
                w.u8(0).usize(*rank);
            }
            ToCoordinator::Submit(subs) => {
                w.u8(1).u32(subs.len() as u32);
                for s in subs {
                    match s {
                        Submit::Full(req) => {
                            w.u8(0);
                            req.encode(w);
                        }
                        Submit::Cached { set_id, id } => {
                            w.u8(1).u32(*set_id).u64(*id);
                        }
                        Submit::Rejected { request, reason } => {
                            w.u8(2);
                            request.encode(w);
                            w.str(reason);
                        }
                    }
                }
            }
            ToCoordinator::Join => {
                w.u8(2);
            }
            ToCoordinator::AddSet { ranks } => {
                w.u8(3).usizes(ranks);
            }
            ToCoordinator::RemoveSet { id } => {
                w.u8(4).u32(*id);
            }
            ToCoordinator::AddMemberSet { ranks, timeout_ms } => {
                w.u8(10).usizes(ranks).u64(*timeout_ms);
            }
            ToCoordinator::Leave => {
                w.u8(5);
            }
            ToCoordinator::Stalled { rank, detail } => {
                w.u8(6).usize(*rank).str(detail);
            }
            ToCoordinator::Relayed(msgs) => {
                w.u8(7).u32(msgs.len() as u32);
                for (from, m) in msgs {
                    w.usize(*from);
                    m.encode_into(w);
                }
            }
            ToCoordinator::Lost { rank, detail } => {
                w.u8(8).usize(*rank).str(detail);
            }
            ToCoordinator::CachedBelow { set_id, ids } => {
                w.u8(9).u32(*set_id).u32(ids.len() as u32);
                for id in ids {
                    w.u64(*id);
                }
            }
        }
    }

    /// Decodes from the wire.
    pub fn decode(buf: &[u8]) -> Result<ToCoordinator> {
        unframe(buf, |r| ToCoordinator::decode_from(r, true))
    }

    /// One message; `outer`: a relayed batch may hold messages, but not batches or hellos.
    fn decode_from(r: &mut Reader<'_>, outer: bool) -> Result<ToCoordinator> {
        let msg = match r.u8()? {
            0 => ToCoordinator::Hello { rank: r.usize()? },
            1 => {
                let n = r.u32()? as usize;
                if n > r.remaining() {
                    return Err(Error::Decode(format!("{n} submissions exceed the message")));
                }
                let mut subs = Vec::with_capacity(n);
                for _ in 0..n {
                    subs.push(match r.u8()? {
                        0 => Submit::Full(Request::decode(r)?),
                        1 => Submit::Cached {
                            set_id: r.u32()?,
                            id: r.u64()?,
                        },
                        2 => Submit::Rejected {
                            request: Request::decode(r)?,
                            reason: r.str()?.to_string(),
                        },
                        t => return Err(Error::Decode(format!("bad submission tag {t}"))),
                    });
                }
                ToCoordinator::Submit(subs)
            }
            2 => ToCoordinator::Join,
            3 => ToCoordinator::AddSet { ranks: r.usizes()? },
            4 => ToCoordinator::RemoveSet { id: r.u32()? },
            10 => ToCoordinator::AddMemberSet {
                ranks: r.usizes()?,
                timeout_ms: r.u64()?,
            },
            5 => ToCoordinator::Leave,
            6 => ToCoordinator::Stalled {
                rank: r.usize()?,
                detail: r.str()?.to_string(),
            },
            7 if outer => {
                let n = r.u32()? as usize;
                if n > r.remaining() {
                    return Err(Error::Decode(format!(
                        "{n} relayed messages exceed the message"
                    )));
                }
                let mut msgs = Vec::with_capacity(n);
                for _ in 0..n {
                    let from = r.usize()?;
                    msgs.push((from, ToCoordinator::decode_from(r, false)?));
                }
                ToCoordinator::Relayed(msgs)
            }
            8 => ToCoordinator::Lost {
                rank: r.usize()?,
                detail: r.str()?.to_string(),
            },
            9 => {
                let set_id = r.u32()?;
                let n = r.u32()? as usize;
                if n > r.remaining() {
                    return Err(Error::Decode(format!("{n} cache ids exceed the message")));
                }
                let ids = (0..n).map(|_| r.u64()).collect::<Result<_>>()?;
                ToCoordinator::CachedBelow { set_id, ids }
            }
            t => return Err(Error::Decode(format!("bad message tag {t}"))),
        };
        if !outer && matches!(msg, ToCoordinator::Hello { .. }) {
            return Err(Error::Decode("a hello inside a relayed batch".into()));
        }
        Ok(msg)
    }
}

impl Response {
    fn encode(&self, w: &mut Writer) {
        w.u32(self.set_id)
            .u8(self.kind as u8)
            .u32(self.items.len() as u32);
        for item in &self.items {
            item.request.encode(w);
            match item.cache_id {
                Some(id) => w.u8(1).u64(id),
                None => w.u8(0),
            };
            w.u32(item.first_dims.len() as u32);
            for d in &item.first_dims {
                w.usizes(d);
            }
            w.usizes(&item.split_matrix);
        }
        w.usizes(&self.joined).usize(self.last_joined);
        match &self.error {
            Some((code, msg)) => w.u8(1).u8(*code).str(msg),
            None => w.u8(0),
        };
    }

    fn decode(r: &mut Reader<'_>) -> Result<Response> {
        let set_id = r.u32()?;
        let kind = OpKind::from_code(r.u8()?)?;
        let n = r.u32()? as usize;
        if n > r.remaining() {
            return Err(Error::Decode(format!("{n} items exceed the message")));
        }
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            let request = Request::decode(r)?;
            let cache_id = if r.bool()? { Some(r.u64()?) } else { None };
            let nd = r.u32()? as usize;
            if nd > r.remaining() {
                return Err(Error::Decode(format!("{nd} dims lists exceed the message")));
            }
            let first_dims = (0..nd).map(|_| r.usizes()).collect::<Result<_>>()?;
            items.push(Item {
                request,
                cache_id,
                first_dims,
                split_matrix: r.usizes()?,
            });
        }
        let joined = r.usizes()?;
        let last_joined = r.usize()?;
        let error = if r.bool()? {
            Some((r.u8()?, r.str()?.to_string()))
        } else {
            None
        };
        Ok(Response {
            set_id,
            kind,
            items,
            joined,
            last_joined,
            error,
        })
    }
}

impl FromCoordinator {
    /// Encodes for the wire.
    pub fn encode(&self) -> Vec<u8> {
        frame(|w| self.encode_into(w))
    }

    fn encode_into(&self, w: &mut Writer) {
        match self {
            FromCoordinator::Responses(rs) => {
                w.u8(0).u32(rs.len() as u32);
                for r in rs {
                    r.encode(w);
                }
            }
            FromCoordinator::CacheMiss { set_id, id } => {
                w.u8(1).u32(*set_id).u64(*id);
            }
            FromCoordinator::Ready => {
                w.u8(6);
            }
            FromCoordinator::SetAdded {
                ranks,
                timeout_ms,
                result,
            } => {
                w.u8(2).usizes(ranks).u64(*timeout_ms);
                match result {
                    Ok(id) => w.u8(0).u32(*id),
                    Err(msg) => w.u8(1).str(msg),
                };
            }
            FromCoordinator::SetRemoved { id, result } => {
                w.u8(3).u32(*id);
                match result {
                    Ok(removed) => w.u8(0).bool(*removed),
                    Err(msg) => w.u8(1).str(msg),
                };
            }
            FromCoordinator::RankLeft { rank } => {
                w.u8(4).usize(*rank);
            }
            FromCoordinator::RankFailed {
                rank,
                detail,
                stalled,
            } => {
                w.u8(5).usize(*rank).str(detail).bool(*stalled);
            }
            FromCoordinator::Down(msgs) => {
                w.u8(7).u32(msgs.len() as u32);
                for (to, m) in msgs {
                    match to {
                        Some(ranks) => w.u8(1).usizes(ranks),
                        None => w.u8(0),
                    };
                    m.encode_into(w);
                }
            }
            FromCoordinator::PathClosed {
                rank,
                clean,
                detail,
            } => {
                w.u8(8).usize(*rank).bool(*clean).str(detail);
            }
        }
    }

    /// Decodes from the wire.
    pub fn decode(buf: &[u8]) -> Result<FromCoordinator> {
        unframe(buf, |r| FromCoordinator::decode_from(r, true))
    }

    /// One message; `outer`: a batch to pass down may not hold another.
    fn decode_from(r: &mut Reader<'_>, outer: bool) -> Result<FromCoordinator> {
        let msg = match r.u8()? {
            0 => {
                let n = r.u32()? as usize;
                if n > r.remaining() {
                    return Err(Error::Decode(format!("{n} responses exceed the message")));
                }
                let rs = (0..n).map(|_| Response::decode(r)).collect::<Result<_>>()?;
                FromCoordinator::Responses(rs)
            }
            1 => FromCoordinator::CacheMiss {
                set_id: r.u32()?,
                id: r.u64()?,
            },
            2 => {
                let ranks = r.usizes()?;
                let timeout_ms = r.u64()?;
                let result = if r.bool()? {
                    Err(r.str()?.to_string())
                } else {
                    Ok(r.u32()?)
                };
                FromCoordinator::SetAdded {
                    ranks,
                    timeout_ms,
                    result,
                }
            }
            3 => {
                let id = r.u32()?;
                let result = if r.bool()? {
                    Err(r.str()?.to_string())
                } else {
                    Ok(r.bool()?)
                };
                FromCoordinator::SetRemoved { id, result }
            }
            4 => FromCoordinator::RankLeft { rank: r.usize()? },
            6 => FromCoordinator::Ready,
            5 => FromCoordinator::RankFailed {
                rank: r.usize()?,
                detail: r.str()?.to_string(),
                stalled: r.bool()?,
            },
            7 if outer => {
                let n = r.u32()? as usize;
                if n > r.remaining() {
                    return Err(Error::Decode(format!(
                        "{n} messages to pass down exceed the message"
                    )));
                }
                let mut msgs = Vec::with_capacity(n);
                for _ in 0..n {
                    let to = if r.bool()? { Some(r.usizes()?) } else { None };
                    msgs.push((to, FromCoordinator::decode_from(r, false)?));
                }
                FromCoordinator::Down(msgs)
            }
            8 => FromCoordinator::PathClosed {
                rank: r.usize()?,
                clean: r.bool()?,
                detail: r.str()?.to_string(),
            },
            t => return Err(Error::Decode(format!("bad message tag {t}"))),
        };
        Ok(msg)
    }
}

#[cfg(test)]
mod tests;
