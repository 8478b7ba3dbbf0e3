//! Control-plane messages between each rank's engine and the coordinator, and their codec.
//! Every decode goes through [`crate::wire::Reader`], so malformed bytes become `Error::Decode`.

use crate::error::{Error, Result};
use crate::types::{DType, OpKind, ReduceOp};
use crate::wire::{Reader, Writer};

/// Dtype and shape of one tensor of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Dimensions (empty for a 0-d tensor).
    pub shape: Vec<usize>,
}

impl TensorMeta {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Number of bytes.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
    /// Elements in one first-dimension row (1 for 0-d tensors).
    pub fn row_elems(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
}

/// Where an op's tensors live. Every rank of a set must submit a name on the same kind of
/// device (host tensors run over the host transports, CUDA tensors over NCCL); the ordinal of
/// a rank's GPU is its own business and never travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// Host memory.
    #[default]
    Host = 0,
    /// CUDA device memory.
    Cuda = 1,
}

impl DeviceKind {
    /// The name error messages use.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Host => "CPU",
            DeviceKind::Cuda => "CUDA",
        }
    }

    /// Decodes a wire code.
    pub fn from_code(code: u8) -> Result<DeviceKind> {
        match code {
            0 => Ok(DeviceKind::Host),
            1 => Ok(DeviceKind::Cuda),
            c => Err(Error::Decode(format!("bad device kind {c}"))),
        }
    }
}

/// A collective under one name, with its tensors as `T`: the caller's buffers when it is
/// submitted ([`super::OpSpec`]), their dtypes and shapes when a rank describes it to the
/// coordinator ([`Request`]). One type for both, so that a field added to an op reaches the
/// request and the wire without being copied by hand. Grouped ops carry several tensors and
/// are negotiated as one unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Op<T> {
    /// Process set id (0 = global).
    pub set_id: u32,
    /// The matching key.
    pub name: String,
    /// Collective kind.
    pub kind: OpKind,
    /// Reduction (allreduce, reducescatter).
    pub op: ReduceOp,
    /// Broadcast root, a global rank.
    pub root: usize,
    /// Multiplier applied before the reduction.
    pub prescale: f64,
    /// Multiplier applied after the reduction.
    pub postscale: f64,
    /// The tensors.
    pub tensors: Vec<T>,
    /// Alltoall: first-dimension rows sent to each set rank. A caller may leave it empty for
    /// an equal split, which the engine fills in before it sends the request.
    pub splits: Vec<usize>,
}

impl<T> Op<T> {
    /// The same op with each tensor replaced by what `f` makes of it.
    pub fn map_tensors<U>(&self, f: impl FnMut(&T) -> U) -> Op<U> {
        Op {
            set_id: self.set_id,
            name: self.name.clone(),
            kind: self.kind,
            op: self.op,
            root: self.root,
            prescale: self.prescale,
            postscale: self.postscale,
            tensors: self.tensors.iter().map(f).collect(),
            splits: self.splits.clone(),
        }
    }
}

/// What one rank asks for under one name: the op, described, and where its tensors live.
/// The device is not part of [`Op`] because a submitted op's buffers already say where they
/// are; the engine works it out when it builds the request. Reads of the op's fields go
/// through [`Deref`](std::ops::Deref), as in `request.name`.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The op. Not named `op`, so that `request.op` reads the reduction through `Deref`.
    pub spec: Op<TensorMeta>,
    /// Where the tensors live.
    pub device: DeviceKind,
}

impl std::ops::Deref for Request {
    type Target = Op<TensorMeta>;

    fn deref(&self) -> &Op<TensorMeta> {
        &self.spec
    }
}

impl Request {
    /// Whether a validated response for this request can be cached and replayed by id: the
    /// response must follow from the request alone (no per-rank shapes or splits).
    pub fn cacheable(&self) -> bool {
        matches!(
            self.kind,
            OpKind::Allreduce | OpKind::Broadcast | OpKind::Reducescatter
        )
    }

    /// Payload bytes (sum over tensors).
    pub fn nbytes(&self) -> usize {
        self.tensors.iter().map(TensorMeta::nbytes).sum()
    }

    fn encode(&self, w: &mut Writer) {
        w.u32(self.set_id)
            .str(&self.name)
            .u8(self.kind as u8)
            .u8(self.op as u8)
            .usize(self.root)
            .f64(self.prescale)
            .f64(self.postscale);
        encode_tensors(w, &self.tensors);
        w.usizes(&self.splits).u8(self.device as u8);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Request> {
        // Fields are evaluated in the order written, which is the order on the wire.
        Ok(Request {
            spec: Op {
                set_id: r.u32()?,
                name: r.str()?.to_string(),
                kind: OpKind::from_code(r.u8()?)?,
                op: ReduceOp::from_code(r.u8()?)?,
                root: r.usize()?,
                prescale: r.f64()?,
                postscale: r.f64()?,
                tensors: decode_tensors(r)?,
                splits: r.usizes()?,
            },
            device: DeviceKind::from_code(r.u8()?)?,
        })
    }
}

fn encode_tensors(w: &mut Writer, tensors: &[TensorMeta]) {
    w.u32(tensors.len() as u32);
    for t in tensors {
        w.u8(t.dtype as u8).usizes(&t.shape);
    }
}

fn decode_tensors(r: &mut Reader<'_>) -> Result<Vec<TensorMeta>> {
    let n = r.u32()? as usize;
    if n > r.remaining() {
        return Err(Error::Decode(format!("{n} tensors exceed the message")));
    }
    (0..n)
        .map(|_| {
            Ok(TensorMeta {
                dtype: DType::from_code(r.u8()?)?,
                shape: r.usizes()?,
            })
        })
        .collect()
}

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
    /// Result of `AddSet`: the id, or an error message.
    SetAdded {
        /// Sorted ranks.
        ranks: Vec<usize>,
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
}

impl ToCoordinator {
    /// Encodes for the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
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
                            req.encode(&mut w);
                        }
                        Submit::Cached { set_id, id } => {
                            w.u8(1).u32(*set_id).u64(*id);
                        }
                        Submit::Rejected { request, reason } => {
                            w.u8(2);
                            request.encode(&mut w);
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
            ToCoordinator::Leave => {
                w.u8(5);
            }
            ToCoordinator::Stalled { rank, detail } => {
                w.u8(6).usize(*rank).str(detail);
            }
        }
        w.finish()
    }

    /// Decodes from the wire.
    pub fn decode(buf: &[u8]) -> Result<ToCoordinator> {
        let mut r = Reader::new(buf);
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
                        0 => Submit::Full(Request::decode(&mut r)?),
                        1 => Submit::Cached {
                            set_id: r.u32()?,
                            id: r.u64()?,
                        },
                        2 => Submit::Rejected {
                            request: Request::decode(&mut r)?,
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
            5 => ToCoordinator::Leave,
            6 => ToCoordinator::Stalled {
                rank: r.usize()?,
                detail: r.str()?.to_string(),
            },
            t => return Err(Error::Decode(format!("bad message tag {t}"))),
        };
        r.finish()?;
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
        let mut w = Writer::new();
        match self {
            FromCoordinator::Responses(rs) => {
                w.u8(0).u32(rs.len() as u32);
                for r in rs {
                    r.encode(&mut w);
                }
            }
            FromCoordinator::CacheMiss { set_id, id } => {
                w.u8(1).u32(*set_id).u64(*id);
            }
            FromCoordinator::Ready => {
                w.u8(6);
            }
            FromCoordinator::SetAdded { ranks, result } => {
                w.u8(2).usizes(ranks);
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
        }
        w.finish()
    }

    /// Decodes from the wire.
    pub fn decode(buf: &[u8]) -> Result<FromCoordinator> {
        let mut r = Reader::new(buf);
        let msg = match r.u8()? {
            0 => {
                let n = r.u32()? as usize;
                if n > r.remaining() {
                    return Err(Error::Decode(format!("{n} responses exceed the message")));
                }
                let rs = (0..n)
                    .map(|_| Response::decode(&mut r))
                    .collect::<Result<_>>()?;
                FromCoordinator::Responses(rs)
            }
            1 => FromCoordinator::CacheMiss {
                set_id: r.u32()?,
                id: r.u64()?,
            },
            2 => {
                let ranks = r.usizes()?;
                let result = if r.bool()? {
                    Err(r.str()?.to_string())
                } else {
                    Ok(r.u32()?)
                };
                FromCoordinator::SetAdded { ranks, result }
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
            t => return Err(Error::Decode(format!("bad message tag {t}"))),
        };
        r.finish()?;
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> Request {
        Request {
            spec: Op {
                set_id: 3,
                name: "grad.w1".into(),
                kind: OpKind::Allgather,
                op: ReduceOp::Sum,
                root: 2,
                prescale: 0.5,
                postscale: 2.0,
                tensors: vec![
                    TensorMeta {
                        dtype: DType::BF16,
                        shape: vec![3, 4],
                    },
                    TensorMeta {
                        dtype: DType::F32,
                        shape: vec![],
                    },
                ],
                splits: vec![1, 2],
            },
            device: DeviceKind::Cuda,
        }
    }

    fn samples() -> (Vec<ToCoordinator>, Vec<FromCoordinator>) {
        let to = vec![
            ToCoordinator::Hello { rank: 7 },
            ToCoordinator::Submit(vec![
                Submit::Full(req()),
                Submit::Cached { set_id: 0, id: 9 },
            ]),
            ToCoordinator::Join,
            ToCoordinator::AddSet { ranks: vec![0, 2] },
            ToCoordinator::RemoveSet { id: 4 },
            ToCoordinator::Leave,
            ToCoordinator::Stalled {
                rank: 2,
                detail: "no progress".into(),
            },
        ];
        let from = vec![
            FromCoordinator::Responses(vec![Response {
                set_id: 1,
                kind: OpKind::Allgather,
                items: vec![Item {
                    request: req(),
                    cache_id: Some(8),
                    first_dims: vec![vec![1, 2], vec![0, 0]],
                    split_matrix: vec![1, 2, 3, 4],
                }],
                joined: vec![1],
                last_joined: 1,
                error: Some((3, "Mismatched".into())),
            }]),
            FromCoordinator::CacheMiss { set_id: 1, id: 2 },
            FromCoordinator::SetAdded {
                ranks: vec![1],
                result: Err("dup".into()),
            },
            FromCoordinator::SetAdded {
                ranks: vec![1],
                result: Ok(2),
            },
            FromCoordinator::SetRemoved {
                id: 2,
                result: Ok(true),
            },
            FromCoordinator::SetRemoved {
                id: 3,
                result: Err("busy".into()),
            },
            FromCoordinator::RankLeft { rank: 1 },
            FromCoordinator::Ready,
            FromCoordinator::RankFailed {
                rank: 1,
                detail: "eof".into(),
                stalled: true,
            },
        ];
        (to, from)
    }

    #[test]
    fn round_trips() {
        let (to, from) = samples();
        for m in to {
            assert_eq!(ToCoordinator::decode(&m.encode()).unwrap(), m);
        }
        for m in from {
            assert_eq!(FromCoordinator::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn truncated_messages_are_errors_not_panics() {
        let (to, from) = samples();
        for m in to {
            let b = m.encode();
            for cut in 0..b.len() {
                assert!(ToCoordinator::decode(&b[..cut]).is_err());
            }
        }
        for m in from {
            let b = m.encode();
            for cut in 0..b.len() {
                assert!(FromCoordinator::decode(&b[..cut]).is_err());
            }
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut x: u32 = 12345;
        for len in 0..200usize {
            for _ in 0..50 {
                let b: Vec<u8> = (0..len)
                    .map(|_| {
                        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        (x >> 24) as u8
                    })
                    .collect();
                let _ = ToCoordinator::decode(&b);
                let _ = FromCoordinator::decode(&b);
            }
        }
    }
}
