//! A training step's flat buffer as one engine object: the torch optimizer's gradients, and
//! with a sharded update the one copy of its parameters, in one buffer per rank that the
//! optimizer's tensors view, made once by [`Door::flat_step`] and reduced by its methods.
//!
//! **Why one object.** The step's protocol (whether every rank is ready, where each rank's
//! reduction may begin, when every updated shard is visible) and the choice between host
//! memory and the rings are the engine's: the optimizer asks for an allreduce, the reduction
//! of its shard or the publication of its parameters, and the object meets the other ranks as
//! its memory requires. No caller builds the names of those meetings or decides the route.
//!
//! **Two routes, one agreement.** When every rank of the set maps every other rank's segment
//! (one host, shared memory on), [`Route::HostMemory`]: each rank reduces its shard straight
//! from its peers' buffers (`collective::host_memory`), and the meetings are one-element
//! allreduces through the door, which take the fast path where the ranks share one. Otherwise
//! [`Route::Rings`]: the same calls are in-place allreduce, reduce-scatter and allgather ops
//! over this rank's buffer. The ranks agree on the route when the object is made, so every
//! rank takes the same one; a rank that dies fails every meeting as it fails any op.
//!
//! **Layout of each rank's segment.** The gradients, `count` elements of `dtype`, at byte 0;
//! with a sharded update the parameters, as many elements, from the next page. On the host
//! memory route the one copy of the parameters is set rank 0's; on the rings every rank holds
//! a copy, which [`FlatStep::publish`] fills from every shard's owner.

use std::ops::Range;
use std::time::Duration;

use crate::collective::host_memory as peers;
use crate::collective::split_rows;
use crate::control::message::TensorMeta;
use crate::error::{Error, Result};
use crate::transport::host_memory::{Exposed, HostMemory, Segment, ADDRESS_LEN};
use crate::types::{DType, OpKind, ReduceOp, Reduction};

use super::door::Door;
use super::tensor::TensorBuf;
use super::{OpSpec, TensorSpec};

/// How long ranks wait for each other's answers while mapping the segments; they arrive
/// together, straight from an allgather, so this bounds only a failure.
const SHARE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the parameters of a sharded update start in a segment: the page after the gradients.
const PAGE: usize = 4096;

/// What [`Door::flat_step`] makes.
#[derive(Debug, Clone)]
pub struct FlatSpec {
    /// The process set whose ranks share the step.
    pub set_id: u32,
    /// This rank's index in the set.
    pub rank: usize,
    /// The set's size.
    pub size: usize,
    /// The object's name: its meetings are named after it.
    pub name: String,
    /// Elements of the gradient buffer.
    pub count: usize,
    /// Their type.
    pub dtype: DType,
    /// Whether the buffer also holds the parameters of a sharded update.
    pub sharded: bool,
    /// Whether the ranks may share host memory (shared memory is on).
    pub share: bool,
    /// Made without meeting anyone, on the rings: an elastic worker builds its optimizer
    /// while its peers are busy. A rank without memory for it then has no object while the
    /// others have one (their ops then differ, an error by name, never a wrong sum).
    pub alone: bool,
}

/// How a step's buffers are reduced (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Every rank maps every other rank's segment.
    HostMemory,
    /// Ops through the engine over this rank's segment.
    Rings,
}

/// The object's meetings and ops. Their names are made here alone, from the object's name.
#[derive(Debug, Clone, Copy)]
enum Meeting {
    /// Set-up: the segments' addresses (an allgather).
    Addresses,
    /// Set-up: the route every rank can take (a Min allreduce).
    Mapped,
    /// Every step: whether every rank's gradients are in the buffer (a Min allreduce, after
    /// which every rank's are final).
    Ready,
    /// Host memory: every rank has reduced its shard.
    Reduced,
    /// Host memory: every rank has copied the others' shards.
    Gathered,
    /// The rings' in-place allreduce, reduce-scatter and allgather.
    Allreduce,
    Shards,
    /// Every rank's shard of the parameters is written (host memory: a meeting; the rings:
    /// the allgather that copies them).
    Published,
}

impl Meeting {
    fn part(self) -> &'static str {
        match self {
            Meeting::Addresses => "addresses",
            Meeting::Mapped => "mapped",
            Meeting::Ready => "ready",
            Meeting::Reduced => "reduced",
            Meeting::Gathered => "gathered",
            Meeting::Allreduce => "allreduce",
            Meeting::Shards => "shards",
            Meeting::Published => "published",
        }
    }
}

/// A step's flat buffer (see the module doc).
#[derive(Debug)]
pub struct FlatStep {
    mem: HostMemory,
    route: Route,
    spec: FlatSpec,
    /// Bytes of the gradient buffer, and where the parameters start (sharded).
    grads: usize,
    params_at: Option<usize>,
    /// Every rank's bytes of either buffer, in set order: Horovod's reducescatter split of
    /// the elements (made once; the host memory route's allreduce reads them every step).
    shards: Vec<Range<usize>>,
}

impl Door {
    /// A step's flat buffer for the ranks of `spec.set_id` (see the module doc): a collective
    /// over them unless `spec.alone`, in which they exchange their segments' addresses (where
    /// `spec.share`) and agree on its route. `None` on every rank when some rank has no memory
    /// for it (no memfd); the caller then reduces its tensors one by one. `stop`: asked
    /// between waits whether to give up.
    pub fn flat_step(&self, spec: FlatSpec, stop: &dyn Fn() -> bool) -> Result<Option<FlatStep>> {
        if spec.size == 0 || spec.rank >= spec.size {
            return Err(Error::InvalidArgument(format!(
                "{}: rank {} of a set of {}",
                spec.name, spec.rank, spec.size
            )));
        }
        let grads = spec.count.checked_mul(spec.dtype.size()).ok_or_else(|| {
            Error::InvalidArgument(format!("{}: {} elements overflow", spec.name, spec.count))
        })?;
        let params_at = spec.sharded.then(|| grads.div_ceil(PAGE) * PAGE);
        let len = params_at.map_or(grads, |at| at + grads).max(1);
        let exposed = Exposed::new(len)
            .inspect_err(
                |e| log::warn!(target: crate::LOG_TARGET, "rank {}: {}: {e}", spec.rank, spec.name),
            )
            .ok();
        let (rank, size) = (spec.rank, spec.size);
        let esize = spec.dtype.size();
        let shards: Vec<Range<usize>> = (0..size)
            .map(|q| {
                let (lo, count) = split_rows(spec.count, size, q);
                lo * esize..(lo + count) * esize
            })
            .collect();
        let step = |mem: HostMemory, route| FlatStep {
            mem,
            route,
            grads,
            params_at,
            shards: shards.clone(),
            spec: spec.clone(),
        };
        if spec.alone {
            return Ok(exposed.map(|e| step(e.alone(rank, size), Route::Rings)));
        }
        let offer = exposed
            .as_ref()
            .filter(|_| spec.share && size > 1)
            .map(Exposed::address);
        let addresses = self.allgather_addresses(&spec, offer, stop)?;
        let mem = match exposed {
            Some(e) if addresses.iter().all(|a| a.is_some()) => {
                let all: Vec<Vec<u8>> = addresses.iter().flatten().map(|a| a.to_vec()).collect();
                match e.share(&all, rank, SHARE_TIMEOUT) {
                    Ok(mem) => Some(mem),
                    Err(e) => {
                        log::warn!(target: crate::LOG_TARGET, "{}: not shared: {e}", spec.name);
                        Exposed::new(len).ok().map(|e| e.alone(rank, size))
                    }
                }
            }
            Some(e) => Some(e.alone(rank, size)),
            None => None,
        };
        let can = match &mem {
            None => 0,
            Some(m) if m.complete() && size > 1 => 2,
            Some(_) => 1,
        };
        let agreed = self.agree_min(
            spec.set_id,
            &meeting(&spec.name, Meeting::Mapped),
            can,
            stop,
        )?;
        Ok(match (agreed, mem) {
            (2, Some(mem)) => Some(step(mem, Route::HostMemory)),
            (1, Some(mem)) => Some(step(mem.alone(), Route::Rings)),
            _ => None,
        })
    }

    /// Every rank's segment address (`None`: it offers none), in set order.
    fn allgather_addresses(
        &self,
        spec: &FlatSpec,
        offer: Option<[u8; ADDRESS_LEN]>,
        stop: &dyn Fn() -> bool,
    ) -> Result<Vec<Option<[u8; ADDRESS_LEN]>>> {
        let mine = offer.unwrap_or([0; ADDRESS_LEN]);
        let op = OpSpec {
            set_id: spec.set_id,
            name: meeting(&spec.name, Meeting::Addresses),
            base_at: 0,
            kind: OpKind::Allgather,
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            tensors: vec![TensorSpec {
                meta: TensorMeta {
                    dtype: DType::U8,
                    shape: vec![ADDRESS_LEN],
                },
                input: TensorBuf::Owned(mine.to_vec()),
                output: None,
            }],
            splits: Vec::new(),
        };
        let out = self.run_and_wait(op, stop)?;
        let bytes = out
            .tensors
            .first()
            .map(|(buf, _)| buf.as_slice())
            .unwrap_or(&[]);
        if bytes.len() != ADDRESS_LEN * spec.size {
            return Err(Error::Io(format!(
                "internal error: {}: {} bytes of addresses from {} ranks",
                spec.name,
                bytes.len(),
                spec.size
            )));
        }
        Ok(bytes
            .chunks_exact(ADDRESS_LEN)
            .map(|a| {
                let a: [u8; ADDRESS_LEN] = a.try_into().expect("chunks of ADDRESS_LEN");
                (a != [0; ADDRESS_LEN]).then_some(a)
            })
            .collect())
    }

    /// Returns once every rank of set `set_id` has met under `name`: a one-element
    /// allreduce, which the fast path agrees through its board when the ranks share one.
    fn meet(&self, set_id: u32, name: &str, stop: &dyn Fn() -> bool) -> Result<()> {
        self.agree_min(set_id, name, 0, stop).map(|_| ())
    }

    /// The least `value` of every rank of set `set_id`, agreed under `name`: a one-element Min
    /// allreduce (through the fast path's board where the ranks share one), so also a
    /// meeting: every rank has called it when it returns.
    fn agree_min(
        &self,
        set_id: u32,
        name: &str,
        value: i32,
        stop: &dyn Fn() -> bool,
    ) -> Result<i32> {
        let spec = OpSpec {
            set_id,
            name: name.to_string(),
            base_at: 0,
            kind: OpKind::Allreduce,
            op: ReduceOp::Min,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            tensors: vec![TensorSpec {
                meta: TensorMeta {
                    dtype: DType::I32,
                    shape: vec![1],
                },
                input: TensorBuf::Owned(value.to_ne_bytes().to_vec()),
                output: None,
            }],
            splits: Vec::new(),
        };
        let out = self.run_and_wait(spec, stop)?;
        out.tensors
            .first()
            .and_then(|(buf, _)| buf.as_slice().try_into().ok())
            .map(i32::from_ne_bytes)
            .ok_or_else(|| {
                Error::Io(format!(
                    "internal error: the agreement '{name}' returned no result"
                ))
            })
    }
}

/// The name of the object `name`'s meeting `m`.
fn meeting(name: &str, m: Meeting) -> String {
    format!("{name}.{}", m.part())
}

impl FlatStep {
    /// The route the ranks agreed on.
    pub fn route(&self) -> Route {
        self.route
    }

    /// This rank's gradient buffer: its segment and the bytes in it.
    pub fn grads(&self) -> (Segment, Range<usize>) {
        (self.own_segment(), 0..self.grads)
    }

    /// The parameters a sharded update's model views, or `None` when the object was made
    /// without them: on the host memory route the one copy in set rank 0's segment, else this
    /// rank's copy.
    pub fn params(&self) -> Option<(Segment, Range<usize>)> {
        let at = self.params_at?;
        let seg = match self.route {
            Route::HostMemory => self.mem.segment(0).expect("every segment is mapped"),
            Route::Rings => self.own_segment(),
        };
        Some((seg, at..at + self.grads))
    }

    /// This rank's shard of either buffer, in bytes from its start.
    pub fn shard(&self) -> Range<usize> {
        self.shards[self.spec.rank].clone()
    }

    /// Runs `f` over this rank's gradient buffer (writable): how a Rust caller fills it and
    /// reads its reduction (Python views the segment instead). The step's protocol decides
    /// when other ranks read it, as for any writer.
    pub fn with_grads<T>(&self, f: impl FnOnce(&mut [u8]) -> T) -> Result<T> {
        self.mem.with_own(0..self.grads, |bytes| Ok(f(bytes)))
    }

    /// Runs `f` over the parameters of a sharded update as [`FlatStep::params`] says (on the
    /// host memory route, set rank 0's one copy: read it, and write only this rank's shard).
    pub fn with_params<T>(&self, f: impl FnOnce(&mut [u8]) -> T) -> Result<T> {
        let at = self.params_at.ok_or_else(|| {
            Error::InvalidArgument(format!("{}: made without parameters", self.spec.name))
        })?;
        let owner = match self.route {
            Route::HostMemory => 0,
            Route::Rings => self.mem.rank(),
        };
        self.mem
            .with_peer(owner, at..at + self.grads, |bytes| Ok(f(bytes)))
    }

    fn own_segment(&self) -> Segment {
        self.mem
            .segment(self.mem.rank())
            .expect("this rank's own segment is always mapped")
    }

    fn name(&self, m: Meeting) -> String {
        meeting(&self.spec.name, m)
    }

    /// Whether every rank is `ready` (its gradients in its buffer); if all are, every rank's
    /// gradients, each times `scale.0`, reduced with `op` (Sum, or Average over the set's
    /// ranks) times `scale.1` into each rank's, with the same bits on every rank. Nothing is
    /// reduced without the agreement, which it returns. Every rank's buffer is final once the
    /// ranks agree, and any rank may write its own again when this returns.
    pub fn allreduce(
        &self,
        door: &Door,
        ready: bool,
        op: ReduceOp,
        scale: (f64, f64),
        stop: &dyn Fn() -> bool,
    ) -> Result<bool> {
        let red = self.reduction(op, scale.1)?;
        if !self.agree(door, ready, stop)? {
            return Ok(false);
        }
        if !self.in_host_memory(scale.0) {
            self.in_place(door, OpKind::Allreduce, (op, scale), stop)?;
            return Ok(true);
        }
        let set = self.spec.set_id;
        reduce_shard_in_host_memory(&self.mem, self.shard(), red)?;
        door.meet(set, &self.name(Meeting::Reduced), stop)?;
        gather_shards_in_host_memory(&self.mem, &self.shards)?;
        door.meet(set, &self.name(Meeting::Gathered), stop)?;
        Ok(true)
    }

    /// The reduction of a sharded update: whether every rank is `ready`, and if all are, this
    /// rank's shard of the gradients reduced over every rank's (as [`FlatStep::allreduce`]
    /// says) into its own; the rest of its buffer then holds nothing it may rely on. Returns
    /// the agreement. No rank may write its gradients until the ranks meet again
    /// ([`FlatStep::publish`]).
    pub fn reduce_shard(
        &self,
        door: &Door,
        ready: bool,
        op: ReduceOp,
        scale: (f64, f64),
        stop: &dyn Fn() -> bool,
    ) -> Result<bool> {
        let red = self.reduction(op, scale.1)?;
        if !self.agree(door, ready, stop)? {
            return Ok(false);
        }
        if self.in_host_memory(scale.0) {
            reduce_shard_in_host_memory(&self.mem, self.shard(), red)?;
        } else {
            self.in_place(door, OpKind::Reducescatter, (op, scale), stop)?;
        }
        Ok(true)
    }

    /// Whether a reduction whose inputs are each scaled by `prescale` runs in host memory: on
    /// that route, unless there is a prescale, which must apply to each rank's input before
    /// the sum (a predivide keeps half-precision sums finite) and which the in-place ops of
    /// the rings apply.
    fn in_host_memory(&self, prescale: f64) -> bool {
        self.route == Route::HostMemory && prescale == 1.0
    }

    /// Makes every rank's writes to its shard of the parameters visible to every rank: on the
    /// host memory route a meeting (after which no rank reads another's gradients either), on
    /// the rings an in-place allgather into every rank's copy.
    pub fn publish(&self, door: &Door, stop: &dyn Fn() -> bool) -> Result<()> {
        if self.params_at.is_none() {
            return Err(Error::InvalidArgument(format!(
                "{}: made without parameters, it has none to publish",
                self.spec.name
            )));
        }
        match self.route {
            Route::HostMemory => door.meet(self.spec.set_id, &self.name(Meeting::Published), stop),
            Route::Rings => {
                self.in_place(door, OpKind::Allgather, (ReduceOp::Sum, (1.0, 1.0)), stop)
            }
        }
    }

    fn agree(&self, door: &Door, ready: bool, stop: &dyn Fn() -> bool) -> Result<bool> {
        let name = self.name(Meeting::Ready);
        Ok(door.agree_min(self.spec.set_id, &name, i32::from(ready), stop)? == 1)
    }

    fn reduction(&self, op: ReduceOp, postscale: f64) -> Result<Reduction> {
        if !matches!(op, ReduceOp::Sum | ReduceOp::Average) {
            return Err(Error::InvalidArgument(format!(
                "{}: a step's buffer reduces with Sum or Average, not {op:?}",
                self.spec.name
            )));
        }
        Ok(Reduction::over(
            self.spec.dtype,
            op,
            postscale,
            self.spec.size,
        ))
    }

    /// The rings route's in-place op of `kind` over this rank's segment, waited for: an
    /// allreduce of the gradients, their reduce-scatter into this rank's shard, or the
    /// allgather of the parameters from this rank's shard.
    fn in_place(
        &self,
        door: &Door,
        kind: OpKind,
        (op, (prescale, postscale)): (ReduceOp, (f64, f64)),
        stop: &dyn Fn() -> bool,
    ) -> Result<()> {
        let (whole, m) = match kind {
            OpKind::Allreduce => (0..self.grads, Meeting::Allreduce),
            OpKind::Reducescatter => (0..self.grads, Meeting::Shards),
            _ => {
                let at = self.params_at.unwrap_or(0);
                (at..at + self.grads, Meeting::Published)
            }
        };
        let shard = self.shard();
        let esize = self.spec.dtype.size();
        let seg = self.mem.segment(self.mem.rank()).ok_or_else(|| {
            Error::Io(format!(
                "internal error: {}: this rank's segment is not mapped",
                self.spec.name
            ))
        })?;
        // The loan of `with_own`, held until the op is waited for, keeps every other caller in
        // this process off these bytes; the buffers keep the segment mapped as long as the
        // engine holds them. Other ranks never map this segment on the rings route.
        self.mem.with_own(whole.clone(), |_| {
            let buf = |range: Range<usize>| TensorBuf::in_segment(seg.clone(), range);
            let mine = whole.start + shard.start..whole.start + shard.end;
            let (input, output, rows) = match kind {
                OpKind::Allreduce => (buf(whole.clone())?, buf(whole)?, self.spec.count),
                OpKind::Reducescatter => (buf(whole)?, buf(mine)?, self.spec.count),
                _ => (buf(mine)?, buf(whole)?, shard.len() / esize),
            };
            let spec = OpSpec {
                set_id: self.spec.set_id,
                name: self.name(m),
                base_at: 0,
                kind,
                op,
                root: 0,
                prescale,
                postscale,
                tensors: vec![TensorSpec {
                    meta: TensorMeta {
                        dtype: self.spec.dtype,
                        shape: vec![rows],
                    },
                    input,
                    output: Some(output),
                }],
                splits: Vec::new(),
            };
            door.run_and_wait(spec, stop).map(|_| ())
        })
    }
}

/// This rank's shard of a reduce-scatter whose inputs already lie in host memory, each rank's
/// in its own segment at the same offsets: `range` of this rank's segment becomes the
/// reduction of `range` over every rank's segment, as `red` says, read straight from the other
/// ranks' memory (this rank's bytes fold first, then the others' in rank order). Only a
/// protocol the caller keeps makes it right: every rank's input is final before any rank
/// starts, and no rank writes its `range` (or this rank's) until every rank has finished.
pub fn reduce_shard_in_host_memory(
    mem: &HostMemory,
    range: Range<usize>,
    red: Reduction,
) -> Result<()> {
    let rank = mem.rank();
    if range.start > range.end {
        return Err(Error::InvalidArgument(format!(
            "host memory: bytes {range:?} end before they start"
        )));
    }
    mem.with_range(0..range.end, |own, others| {
        let at = range.start;
        peers::reduce_in_rank_order(others, Some(rank), at, red, &mut own[range])
    })
}

/// The allgather half of an allreduce in host memory: `shards[q]` of this rank's segment
/// becomes a copy of `shards[q]` of rank `q`'s, for every other rank `q`. Only a protocol the
/// caller keeps makes it right: every owner has finished its shard before any rank starts, and
/// no rank writes its segment until every rank has finished.
pub fn gather_shards_in_host_memory(mem: &HostMemory, shards: &[Range<usize>]) -> Result<()> {
    let hi = shards.iter().map(|s| s.end).max().unwrap_or(0);
    let rank = mem.rank();
    mem.with_range(0..hi, |own, others| {
        peers::gather_shards(others, rank, shards, own)
    })
}
