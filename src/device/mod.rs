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
//! A fused response of several allreduces (one dtype, op and scaling) is copied into the
//! set's device fusion buffer, reduced there by one NCCL call and copied out, all on the
//! communicator's stream ([`DeviceComm::allreduce_fused`]); the buffer grows to the largest
//! fused response (at most the fusion threshold) and lives as long as the communicator.
//! Other responses are one NCCL group of per-tensor calls.
//!
//! A set two of whose ranks use one GPU (ranks on one machine that all picked device 0) cannot
//! have an NCCL communicator: NCCL refuses duplicate GPUs. The members find that out together
//! before creating one, by exchanging their GPUs' UUIDs through the store, so they all decide
//! alike; the set's CUDA responses are then *staged* by the engine: each tensor copied to host
//! memory once the submitter's stream is done with it, reduced by the host collectives like
//! any host op, and copied back before its handle completes ([`Staging`]). Each rank says why
//! once, as a warning. Where every member sets `FERROVOD_NCCL_SHARED_GPU=1`, such a set runs
//! on NCCL after all: each member becomes a host of its own to NCCL
//! ([`crate::config::nccl_host_of_its_own`]), which then joins them through its network
//! transport, the ranks' kernels time-sharing the GPU.
//!
//! With `FERROVOD_HIERARCHICAL_ALLREDUCE=1`, a set that spans hosts also gets a communicator
//! of its members on this host, and its allreduces go through [`layered`]: NCCL inside the
//! host, the host collectives across hosts.
//!
//! A module beside the engine rather than inside it: all of it is about GPUs, streams and
//! NCCL, and the engine's worker needs only [`DeviceState`] (a response's route and run) and
//! [`op_device`] (a submission's check). What it reads of the engine is the op records it is
//! handed (`engine::Entry`, `TensorBuf`); the files: `calls.rs` a response's NCCL calls,
//! `layered.rs` the hierarchical allreduce, `staging.rs` staged responses.

mod calls;
mod layered;
mod staging;

use calls::{
    after_submitters, device_buf, device_of, enqueue, fusable, layered_allreduce, same_reduction,
};
pub(crate) use staging::Staging;

use std::collections::HashMap;
use std::time::Duration;

use crate::backend::nccl::{check_device_op, unique_id_key, DeviceComm, Nccl};
use crate::collective::hierarchical::Layout;
use crate::error::{Error, Result};
use crate::gpu::cuda::{cuda_ready, Device, PinnedBuf};
use crate::job::StoreLink;
use crate::types::{OpKind, Reduction};

use crate::control::message::{DeviceKind, Response};
use crate::engine::{Entry, OpSpec, TensorBuf};
pub(crate) use layered::Cross;

/// Where a communicator's unique id is exchanged, and the limits of the waits.
pub(crate) struct DeviceState {
    /// The job's rendezvous store, as forming left it; `None` for a one-rank job without one.
    store: Option<StoreLink>,
    /// The engine's `init()` count, which keys the store entries.
    generation: u64,
    /// Bounds the unique-id wait, the communicator's creation and every collective.
    timeout: Duration,
    /// Per process set: how its CUDA responses run, or why they cannot.
    comms: HashMap<u32, std::result::Result<Route, Error>>,
    /// Host index of every global rank, and whether allreduces of sets that span hosts go
    /// hierarchical (`FERROVOD_HIERARCHICAL_ALLREDUCE=1`; see [`layered`]).
    hosts: Vec<u32>,
    layered: bool,
}

/// How a process set's CUDA responses run.
enum Route {
    /// On the set's NCCL communicator; allreduces also through a communicator of this host's
    /// members where the set's are layered ([`layered`]).
    Nccl(Box<DeviceComm>, Option<Box<layered::Local>>),
    /// Through host memory, by the host collectives ([`Staging`]).
    Staged(Box<Stager>),
}

/// A staged set's device and its page-locked bounce buffer, kept across responses (it grows
/// to the largest response seen): allocating and first touching fresh host memory for every
/// op cost more than the copies themselves.
struct Stager {
    device: Device,
    bounce: Option<PinnedBuf>,
}

impl DeviceState {
    pub(crate) fn new(
        store: Option<StoreLink>,
        generation: u64,
        timeout: Duration,
        hosts: Vec<u32>,
        layered: bool,
    ) -> DeviceState {
        DeviceState {
            store,
            generation,
            timeout,
            comms: HashMap::new(),
            hosts,
            layered,
        }
    }

    /// Runs the collectives of a CUDA response (`entries` line up with its items); `cross`
    /// runs the cross-host step of a layered allreduce. The caller completes the handles
    /// with the result.
    pub(crate) fn execute(
        &mut self,
        rank: usize,
        members: &[usize],
        resp: &Response,
        entries: &mut [Option<Entry>],
        cross: Cross<'_>,
    ) -> Result<()> {
        let ordinal = device_of(entries)?;
        let Route::Nccl(comm, local) = self.route(resp.set_id, members, rank, ordinal)? else {
            return Err(Error::Io(
                "internal error: a staged set's response sent to NCCL".into(),
            ));
        };
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
        if let Some(local) = local.as_deref_mut() {
            if resp.kind == OpKind::Allreduce {
                if let Some(f) = same_reduction(entries)? {
                    let result = layered_allreduce(local, &f, members, entries, cross);
                    if result.is_err() {
                        // The set's other members may wait in either communicator.
                        local.comm.abort();
                        comm.abort();
                    }
                    return result;
                }
            }
        }
        let nccl_stream = after_submitters(comm, entries)?;
        let me = rank_in(members, rank)?;
        if let Some(f) = fusable(resp, members, entries)? {
            let red = Reduction::new(f.dtype, f.op).scaled(f.postscale);
            comm.allreduce_fused(&f.parts, red, f.prescale, nccl_stream)?;
        } else {
            comm.group_start()?;
            let enqueued = enqueue(comm, members, me, resp, entries, nccl_stream);
            // Closed even after a failed enqueue: NCCL's group state is per thread.
            let closed = comm.group_end();
            enqueued.and(closed)?;
        }
        let done = comm.record(nccl_stream)?;
        comm.wait(&done)
    }

    /// When `resp`'s set is staged: its tensors copied into host memory (after the
    /// submitters' streams are done with them) and `entries` pointing there, for the host
    /// collectives; [`DeviceState::unstage`] copies the results back. `None`: the set runs
    /// on NCCL ([`DeviceState::execute`]).
    pub(crate) fn stage(
        &mut self,
        rank: usize,
        members: &[usize],
        resp: &Response,
        entries: &mut [Option<Entry>],
    ) -> Result<Option<Staging>> {
        let ordinal = device_of(entries)?;
        let timeout = self.timeout;
        let n = members.len();
        match self.route(resp.set_id, members, rank, ordinal)? {
            Route::Nccl(..) => Ok(None),
            Route::Staged(stager) => Staging::take(
                stager,
                resp.kind,
                n,
                rank_in(members, rank)?,
                entries,
                timeout,
            )
            .map(Some),
        }
    }

    /// Copies a staged response's results into the callers' device memory; returns once they
    /// are there.
    pub(crate) fn unstage(&mut self, set_id: u32, staging: Staging) -> Result<()> {
        match self.comms.get(&set_id) {
            Some(Ok(Route::Staged(stager))) => staging.give_back(stager, self.timeout),
            _ => Err(Error::Io(
                "internal error: unstaging a set that is not staged".into(),
            )),
        }
    }

    /// The set's route, decided now if this is its first CUDA response.
    fn route(
        &mut self,
        set_id: u32,
        members: &[usize],
        rank: usize,
        ordinal: u32,
    ) -> Result<&mut Route> {
        if !self.comms.contains_key(&set_id) {
            let made = self.create(set_id, members, rank, ordinal);
            match &made {
                Ok(Route::Nccl(c, local)) => {
                    log::debug!(
                        target: crate::LOG_TARGET,
                        "rank {rank}: NCCL communicator of process set {set_id} on CUDA device \
                         {ordinal} ({} of {})",
                        c.rank(),
                        c.size()
                    );
                    if let Some(l) = local {
                        log::info!(
                            target: crate::LOG_TARGET,
                            "rank {rank}: process set {set_id}'s CUDA allreduces are \
                             hierarchical: NCCL inside each host ({} of {} here), TCP across \
                             {} hosts ({})",
                            l.comm.rank(),
                            l.comm.size(),
                            l.layout.hosts.len(),
                            if l.layout.uniform() { "2-D" } else { "through each host's first rank" }
                        );
                    }
                }
                Ok(Route::Staged(_)) => {}
                Err(e) => log::warn!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: no NCCL communicator for process set {set_id}: {e}; its CUDA \
                     ops fail"
                ),
            }
            self.comms.insert(set_id, made);
        }
        match self.comms.get_mut(&set_id).expect("inserted above") {
            Ok(r) => Ok(r),
            Err(e) => Err(e.clone()),
        }
    }

    /// Decides the set's route with its other members: NCCL where every member can use it
    /// and no two share a GPU (or all let them, `FERROVOD_NCCL_SHARED_GPU`), else staging.
    /// Each member publishes its [`GPU_RECORD`], so that all of them decide alike.
    fn create(&self, set_id: u32, members: &[usize], rank: usize, ordinal: u32) -> Result<Route> {
        // Asked before the store is touched: ranks without CUDA (and in practice all ranks of
        // a job lack it alike) fail at once instead of waiting for an id.
        cuda_ready()?;
        let me = rank_in(members, rank)?;
        let device = Device::open(ordinal as usize)?;
        let nccl = Nccl::dispatched(&[]).map_err(|e| e.to_string());
        let staged = |device: Device, why: String| {
            log::warn!(
                target: crate::LOG_TARGET,
                "rank {rank}: process set {set_id}'s CUDA tensors are staged through host memory \
                 (expect host-memory speed, not NCCL's): {why}"
            );
            Ok(Route::Staged(Box::new(Stager {
                device,
                bounce: None,
            })))
        };
        let store = match &self.store {
            _ if members.len() == 1 => None,
            Some(link) => Some(link.connect()?),
            None => {
                return Err(Error::InvalidArgument(
                    "CUDA ops of several ranks need the job's rendezvous store, and this job \
                     has none"
                        .into(),
                ))
            }
        };
        if let Some(store) = &store {
            let sharing = crate::config::nccl_shared_gpu();
            let mut mine = device.uuid()?.to_vec();
            mine.push(u8::from(nccl.is_ok()));
            mine.push(u8::from(sharing));
            let prefix = format!("g{}/gpu/ps{set_id}", self.generation);
            store.set(&format!("{prefix}/m{me}"), &mine)?;
            let mut seen: Vec<Vec<u8>> = Vec::with_capacity(members.len());
            let mut why = None;
            let mut shared = None;
            for m in 0..members.len() {
                let theirs = if m == me {
                    mine.clone()
                } else {
                    store.get(&format!("{prefix}/m{m}"), self.timeout)?
                };
                if theirs.len() != GPU_RECORD {
                    return Err(Error::Decode(format!(
                        "the GPU record of rank {} is {} bytes, not {GPU_RECORD}",
                        members[m],
                        theirs.len()
                    )));
                }
                if why.is_some() {
                    continue;
                }
                if theirs[16] == 0 {
                    why = Some(match (&nccl, m == me) {
                        (Err(e), true) => e.clone(),
                        _ => format!("rank {} cannot use NCCL", members[m]),
                    });
                } else if shared.is_none() {
                    if let Some(first) = seen.iter().position(|u| u[..16] == theirs[..16]) {
                        shared = Some(format!(
                            "ranks {} and {} share one GPU (GPU-{}), and NCCL takes one GPU \
                             per rank; give each rank its own GPU, e.g. \
                             torch.cuda.set_device(hvd.local_rank()), or set \
                             FERROVOD_NCCL_SHARED_GPU=1 on every rank",
                            members[first],
                            members[m],
                            uuid_text(&theirs[..16])
                        ));
                    }
                }
                seen.push(theirs);
            }
            // Ranks that share a GPU take NCCL only where every member lets them.
            if why.is_none() && shared.is_some() && !seen.iter().all(|u| u[17] == 1) {
                why = shared.take();
            }
            if let Some(why) = why {
                return staged(device, why);
            }
            if let Some(share) = shared {
                let id = crate::config::nccl_host_of_its_own();
                log::info!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: process set {set_id} runs on NCCL although {share}: \
                     FERROVOD_NCCL_SHARED_GPU=1, so this rank is a host of its own to NCCL \
                     (NCCL_HOSTID={id})"
                );
            }
        }
        let nccl = match nccl {
            Ok(nccl) => nccl,
            Err(why) => return staged(device, why),
        };
        let id = match &store {
            None => nccl.unique_id()?,
            Some(store) => {
                // Apart from the keys `_core.nccl_unique_id` (a diagnostic) writes.
                let key = format!("{}/engine", unique_id_key(self.generation, set_id, 0));
                nccl.exchange_unique_id(store.as_ref(), &key, me, self.timeout)?
            }
        };
        drop(device);
        let comm = DeviceComm::init(
            &nccl,
            &id,
            me,
            members.len(),
            ordinal as usize,
            self.timeout,
        )?;
        let layout = match (&store, self.layered) {
            (Some(_), true) => {
                Layout::new(members.len(), me, |r| self.hosts.get(members[r]).copied())
            }
            _ => None,
        };
        let local = match (store, layout) {
            (Some(store), Some(layout)) => {
                // Every member made the set's communicator before any makes its host's.
                let host = &layout.hosts[layout.mine];
                let key = format!(
                    "{}/engine",
                    unique_id_key(self.generation, set_id, 1 + layout.mine as u32)
                );
                let id =
                    nccl.exchange_unique_id(store.as_ref(), &key, layout.local, self.timeout)?;
                let c = DeviceComm::init(
                    &nccl,
                    &id,
                    layout.local,
                    host.len(),
                    ordinal as usize,
                    self.timeout,
                )?;
                Some(Box::new(layered::Local::new(c, layout)))
            }
            _ => None,
        };
        Ok(Route::Nccl(Box::new(comm), local))
    }

    /// Closes every communicator. `healthy` (the engine never failed): each is finalized
    /// first, which waits (bounded) until NCCL has delivered what this rank still owes its
    /// peers: an op completes here once this rank's GPU is done with it, while NCCL's proxy
    /// may still be sending its last bytes (the socket transport), and a communicator
    /// aborted then fails a peer's last op. Otherwise each is aborted, which needs nothing
    /// from peers that may be gone already.
    pub(crate) fn close(&mut self, healthy: bool) {
        for route in self.comms.values_mut().flatten() {
            if let Route::Nccl(c, local) = route {
                if !healthy {
                    c.abort();
                    if let Some(l) = local {
                        l.comm.abort();
                    }
                }
            }
        }
        // Dropping a live communicator finalizes it (DeviceComm's Drop).
        self.comms.clear();
    }
}

/// Bytes of a member's GPU record: its GPU's UUID, whether it can use NCCL, and whether it
/// lets ranks that share a GPU use NCCL (`FERROVOD_NCCL_SHARED_GPU`).
const GPU_RECORD: usize = 18;

/// `rank`'s position in the set.
fn rank_in(members: &[usize], rank: usize) -> Result<usize> {
    members
        .binary_search(&rank)
        .map_err(|_| Error::InvalidArgument(format!("rank {rank} is not in the process set")))
}

fn uuid_text(u: &[u8]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Where a submitted op's tensors live, checked locally (errors every rank would hit alike):
/// all in host memory, or all on one CUDA device, with outputs the caller allocated, for an
/// op the NCCL path runs ([`check_device_op`]). `n` is the set's size.
pub(crate) fn op_device(spec: &OpSpec, n: usize) -> Result<DeviceKind> {
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
        let red = Reduction::new(t.meta.dtype, spec.op).scaled(spec.postscale);
        check_device_op(spec.kind, red, spec.prescale, n, &t.meta.shape)
            .map_err(|e| Error::InvalidArgument(format!("{} on CUDA: {e}", what())))?;
        let want = match spec.kind {
            OpKind::Reducescatter => Some(t.input.len() / n.max(1)),
            // Sized from every rank's first dimension or splits: checked at execution,
            // against the negotiated ones.
            OpKind::Allgather | OpKind::Alltoall => None,
            _ => Some(t.input.len()),
        };
        match &t.output {
            Some(out) if want.map_or(true, |w| out.len() == w) => {}
            Some(out) => {
                return Err(Error::InvalidArgument(format!(
                    "{}: the output holds {} bytes, the result {}",
                    what(),
                    out.len(),
                    want.unwrap_or_default()
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
