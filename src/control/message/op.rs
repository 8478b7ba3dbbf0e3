//! What one rank asks for: an op ([`Op`]), its tensors' dtypes and shapes ([`TensorMeta`]) and
//! where they live ([`DeviceKind`]), together a [`Request`], and the request's codec.

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
/// submitted (`engine::OpSpec`), their dtypes and shapes when a rank describes it to the
/// coordinator ([`Request`]). One type for both, so that a field added to an op reaches the
/// request and the wire without being copied by hand. Grouped ops carry several tensors and
/// are negotiated as one unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Op<T> {
    /// Process set id (0 = global).
    pub set_id: u32,
    /// The matching key, and what the timeline and errors show.
    pub name: String,
    /// Where in `name` the part this op shares with ops of other kinds begins; 0 when it
    /// shares none. Horovod's torch names an op by its kind (`allreduce.grad`, `broadcast.grad`,
    /// `grouped_allreduce.grad`): the front end that built such a name says where the kind
    /// ends, and the engine never reads the name for it. See [`Op::base`].
    pub base_at: u32,
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
    /// The name this op shares with ops of other kinds, if it has one ([`Op::base_at`]). Each
    /// rank submits ops under one base to the coordinator one at a time, in the order they were
    /// called, so that it can match every rank's current op under the base and fail ranks that
    /// disagree on its kind instead of leaving each waiting for an op the others never send.
    pub fn base(&self) -> Option<&str> {
        match self.base_at as usize {
            0 => None,
            at => self.name.get(at..),
        }
    }

    /// Whether [`Op::base_at`] splits `name` into a kind and a non-empty base.
    pub fn base_at_is_valid(&self) -> bool {
        let at = self.base_at as usize;
        at == 0 || (at < self.name.len() && self.name.is_char_boundary(at))
    }

    /// The same op with each tensor replaced by what `f` makes of it.
    pub fn map_tensors<U>(&self, f: impl FnMut(&T) -> U) -> Op<U> {
        Op {
            set_id: self.set_id,
            name: self.name.clone(),
            base_at: self.base_at,
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

    pub(super) fn encode(&self, w: &mut Writer) {
        w.u32(self.set_id)
            .str(&self.name)
            .u32(self.base_at)
            .u8(self.kind as u8)
            .u8(self.op as u8)
            .usize(self.root)
            .f64(self.prescale)
            .f64(self.postscale);
        encode_tensors(w, &self.tensors);
        w.usizes(&self.splits).u8(self.device as u8);
    }

    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Request> {
        // Fields are evaluated in the order written, which is the order on the wire.
        let request = Request {
            spec: Op {
                set_id: r.u32()?,
                name: r.str()?.to_string(),
                base_at: r.u32()?,
                kind: OpKind::from_code(r.u8()?)?,
                op: ReduceOp::from_code(r.u8()?)?,
                root: r.usize()?,
                prescale: r.f64()?,
                postscale: r.f64()?,
                tensors: decode_tensors(r)?,
                splits: r.usizes()?,
            },
            device: DeviceKind::from_code(r.u8()?)?,
        };
        if !request.base_at_is_valid() {
            return Err(Error::Decode(format!(
                "op '{}': its base begins at byte {}, outside the name",
                request.name, request.base_at
            )));
        }
        Ok(request)
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
