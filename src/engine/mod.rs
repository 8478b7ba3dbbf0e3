//! The engine: one background thread per process that takes submitted ops from a queue,
//! negotiates them with the coordinator (rank 0's [`coordinator`] thread), and executes the
//! responses — fused where possible — over the transport, completing each op's [`Handle`].
//!
//! The thread sleeps only when it has nothing to do: a submission (through an eventfd) or a
//! control message (through its socket) wakes it, after a short bounded spin.

// Public: what the fast path's tests reach; everything else a caller needs is re-exported
// below.
mod door;
mod entry;
pub mod fast;
mod flat_step;
mod handle;
mod pool;
mod progress;
mod tensor;
mod worker;

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::bootstrap::tcp_store::TcpStoreServer;
use crate::bootstrap::{auth, net, ControlTree};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::job::{self, ControlPlane, CoordinatorAddr, CoordinatorListeners, Job, Membership};

pub use crate::bootstrap::Topology;
pub use crate::control::message::{DeviceKind, Op, TensorMeta};
pub use crate::control::names::NameClaim;
pub use door::{Door, Ran, Transfer};
pub use flat_step::{
    gather_shards_in_host_memory, reduce_shard_in_host_memory, FlatSpec, FlatStep, Route,
};
pub use handle::{Handle, Output};
pub use pool::PageBuf;
pub use progress::Progress;
pub use tensor::TensorBuf;

// Crate-wide for the GPU dispatch (`crate::device`), which runs a response's entries on a
// device: the one engine type it needs beyond the public ones.
pub(crate) use entry::Entry;

use crate::control::connection::{self, ControlStream};
use crate::control::message::{self, FromCoordinator, ToCoordinator};
use crate::control::node::{Coordinator, CoordinatorConfig};
use crate::control::{lease, names};
use crate::sys::Waker;
use crate::transport::messenger::Messenger;

/// One tensor of a submitted op.
pub struct TensorSpec {
    /// Dtype and shape.
    pub meta: TensorMeta,
    /// Input memory.
    pub input: TensorBuf,
    /// Output memory of the same size (allreduce, broadcast; may be the input itself for
    /// in-place ops). `None`: the engine allocates the result.
    pub output: Option<TensorBuf>,
}

/// A submitted op: its tensors with their buffers.
pub type OpSpec = Op<TensorSpec>;

impl OpSpec {
    /// What the coordinator is told of this op, whose tensors live on `device`.
    fn request(&self, device: DeviceKind) -> message::Request {
        message::Request {
            spec: self.map_tensors(|t| t.meta.clone()),
            device,
        }
    }
}

/// Who registers a process set, and how long its ops may stall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetScope {
    /// Every rank of the job, in the same order (Horovod's `add_process_set`); its ops stall
    /// as long as the engine's stall limit allows.
    EveryRank,
    /// Its members alone (torch.distributed makes a group's backend on its members only); a
    /// set with these ranks and this limit that exists already is reused. An op of the set
    /// that some members have not submitted within `timeout` (torch's group timeout) fails on
    /// the members that have; `None`: the engine's stall limit.
    Members {
        /// The set's own stall limit.
        timeout: Option<Duration>,
    },
}

pub(crate) enum Command {
    Op(Box<OpSpec>, Handle),
    /// An op this rank refuses, with the reason (see [`Engine::reject`]).
    Reject(Box<OpSpec>, String, Handle),
    Join(Handle),
    /// Ranks, who registers it, where the id goes.
    AddSet(Vec<usize>, SetScope, mpsc::Sender<Result<u32>>),
    RemoveSet(u32, mpsc::Sender<Result<bool>>),
    /// Start (path, mark cycles) or stop (`None`) the timeline.
    Timeline(Option<(String, bool)>, mpsc::Sender<Result<()>>),
    Shutdown,
}

pub(crate) struct Shared {
    queue: Mutex<Vec<Command>>,
    waker: Waker,
    /// Held by a caller driving the worker (see [`progress`]).
    lease: lease::Lease,
    /// The engine thread is (about to be) blocked in its long idle poll: a submission must
    /// wake it even while a caller holds the lease, or it sleeps on with the op unsent.
    polling: std::sync::atomic::AtomicBool,
    sets: Mutex<HashMap<u32, Vec<usize>>>,
    /// The fast path, which the worker closes when the engine fails.
    fast: Arc<fast::FastPath>,
    /// Names of this rank's ops in flight.
    in_flight: Arc<names::InFlight>,
    /// Point-to-point messages ([`Door::send`], [`Door::recv`]); `None` in a job of one rank.
    messenger: Option<Messenger>,
}

/// The pending answer to a process-set change.
pub struct SetReply<T>(mpsc::Receiver<Result<T>>);

impl<T> SetReply<T> {
    /// Waits for the coordinator's answer.
    pub fn wait(self) -> Result<T> {
        self.0
            .recv()
            .map_err(|_| Error::Shutdown("the engine stopped".into()))?
    }
}

/// A running engine. Dropping it shuts it down.
pub struct Engine {
    topology: Topology,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    coordinator: Option<Coordinator>,
    /// The rendezvous store, when rank 0 serves it (launchers other than ferrovodrun).
    store_server: Option<TcpStoreServer>,
    progress: Progress,
    door: Door,
    dynamic: bool,
}

impl Engine {
    /// Forms the job (see [`job::form`]) and starts the background thread.
    /// `generation` counts this process's `init()` calls, so a re-init after `shutdown()`
    /// uses fresh rendezvous keys.
    pub fn start(config: &Config, process_sets: &[Vec<usize>], generation: u64) -> Result<Engine> {
        Engine::start_as(
            config,
            Membership {
                process_sets,
                generation,
                store: None,
                store_listener: None,
            },
        )
    }

    /// [`Engine::start`] with all of what the forming takes beyond `config`: a store to form
    /// over instead of the rendezvous store the launch environment names (torch.distributed's
    /// front end hands in the store torch gave its backend; [`Membership::store`]), or the
    /// listener rank 0 serves that store on.
    pub fn start_as(config: &Config, membership: Membership<'_>) -> Result<Engine> {
        let (process_sets, generation) = (membership.process_sets, membership.generation);
        let mut plane = EnginePlane {
            config,
            process_sets,
        };
        let Job {
            topology,
            hosts,
            transport,
            messenger,
            store,
            cpu_share,
            offer_records,
            coordinator,
            control,
            store_server,
        } = job::form(config, &membership, &mut plane)?;
        let (rank, size) = (topology.rank, topology.size);
        let crowded = config.yield_when_idle.unwrap_or(cpu_share < 1.0);
        crate::spin::set_crowded(crowded);
        log::debug!(
            target: crate::LOG_TARGET,
            "rank {rank}: idle waits {} (FERROVOD_YIELD_WHEN_IDLE={})",
            if crowded { "yield the core between polls, crowded" } else { "spin, then block" },
            config.yield_when_idle.map_or("auto", |y| if y { "1" } else { "0" })
        );
        // A job of one rank per host agrees on its small ops across hosts over connections of
        // their own (every rank decides alike, from the same host table).
        let one_per_host = (2..=fast::MAX_ACROSS_RANKS).contains(&size)
            && hosts.iter().collect::<std::collections::HashSet<_>>().len() == size;
        let fast_links = if one_per_host {
            transport.fast_links()
        } else {
            None
        };
        let fast = Arc::new(fast::FastPath::new(
            rank,
            size,
            offer_records,
            fast_links.clone(),
            // A fast op cannot be given up on one rank alone (a peer may be reading its
            // offer), so a job that asks for stalled ops to fail keeps every op in the engine.
            if config.stall_shutdown.is_some() {
                0
            } else {
                config.fast_path_bytes
            },
            if crowded && !config.spin.is_zero() {
                config.spin.max(crate::spin::CROWDED_SPIN)
            } else {
                config.spin
            },
            config.stall_check,
        ));
        // A timeline from the start records every op, so none may bypass the engine.
        fast.set_timeline(config.timeline.is_some());

        let mut sets: HashMap<u32, Vec<usize>> = HashMap::new();
        sets.insert(0, (0..size).collect());
        for (i, ps) in process_sets.iter().enumerate() {
            sets.insert(i as u32 + 1, ps.clone());
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(Vec::new()),
            waker: Waker::new()?,
            lease: lease::Lease::default(),
            polling: std::sync::atomic::AtomicBool::new(false),
            sets: Mutex::new(sets.clone()),
            fast,
            in_flight: Arc::default(),
            messenger,
        });
        if let Some(links) = &fast_links {
            // The engine thread watches the peers' connections as they come.
            let weak = Arc::downgrade(&shared);
            links.set_on_arrival(Box::new(move || {
                if let Some(shared) = weak.upgrade() {
                    shared.waker.wake();
                }
            }));
        }
        let w = worker::Worker::new(
            config,
            rank,
            Box::new(transport),
            control,
            shared.clone(),
            sets,
            hosts.clone(),
            crate::device::DeviceState::new(
                store,
                generation,
                config.timeout,
                hosts,
                config.tuning.hierarchical == crate::comm::Hierarchical::Always,
            ),
        )?;
        let (thread, progress) = progress::start(
            w,
            shared.clone(),
            config.spin,
            coordinator.as_ref().map(Coordinator::assist),
        )?;
        Ok(Engine {
            topology,
            door: Door::new(shared.clone(), progress.clone()),
            shared,
            thread: Some(thread),
            coordinator,
            store_server,
            progress,
            dynamic: config.dynamic_process_sets,
        })
    }

    /// Ranks may register process sets without this one after it has shut down, as in a job
    /// that torch.distributed's front end started: that front end has joined this engine,
    /// and its `destroy_process_group` is no barrier (see [`CoordinatorConfig::sets_may_come`]).
    pub fn let_sets_come(&self) {
        if let Some(c) = &self.coordinator {
            c.let_sets_come();
        }
    }

    /// This process's place in the job.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// What a caller waiting for one of its ops uses (see [`progress`]).
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }

    /// Members (sorted global ranks) of process set `id`, if registered.
    pub fn process_set(&self, id: u32) -> Option<Vec<usize>> {
        self.shared.sets.lock().get(&id).cloned()
    }

    /// Registered process sets.
    pub fn process_sets(&self) -> HashMap<u32, Vec<usize>> {
        self.shared.sets.lock().clone()
    }

    /// The engine's one entry for ops, which callers on other threads can hold without the
    /// engine (see [`door`]).
    pub fn door(&self) -> Door {
        self.door.clone()
    }

    /// [`Door::run`].
    pub fn run(&self, op: OpSpec, now: Option<&dyn Fn() -> bool>) -> Result<Ran> {
        self.door.run(op, now)
    }

    /// [`Door::submit`].
    pub fn submit(&self, op: OpSpec) -> Result<Handle> {
        self.door.submit(op)
    }

    /// [`Door::reject`].
    pub fn reject(&self, op: OpSpec, reason: String) -> Result<Handle> {
        self.door.reject(op, reason)
    }

    /// The fast path, for a caller that will wait for its op at once (see [`fast`]).
    pub fn fast_path(&self) -> Arc<fast::FastPath> {
        self.shared.fast.clone()
    }

    /// Declares this rank out of data; the handle completes (with `last_joined`) once every
    /// rank has joined.
    pub fn join(&self) -> Handle {
        // Ranks that joined stop taking slots: the fast path is off from here on.
        self.shared.fast.close();
        let h = Handle::counted(self.shared.fast.outstanding());
        self.push(Command::Join(h.clone()));
        h
    }

    /// Registers a process set, as `scope` says who does. The receiver yields its id once
    /// every rank (every member) has asked for it.
    pub fn add_process_set(&self, ranks: Vec<usize>, scope: SetScope) -> SetReply<u32> {
        let (tx, rx) = mpsc::channel();
        // Dynamic mode is Horovod's promise that every rank adds sets in one order; sets their
        // members register alone (torch's groups, over an engine ferrovod.init() started in
        // static mode too) ask nothing of the other ranks.
        let allowed = match scope {
            SetScope::EveryRank => self.check_dynamic(),
            SetScope::Members { .. } => Ok(()),
        };
        match allowed {
            Ok(()) => self.push(Command::AddSet(ranks, scope, tx)),
            Err(e) => drop(tx.send(Err(e))),
        }
        SetReply(rx)
    }

    /// Starts writing a timeline to `path` (rank 0 writes it; other ranks accept and ignore),
    /// replacing one already running. The reply comes once the engine has opened it.
    pub fn start_timeline(&self, path: String, mark_cycles: bool) -> SetReply<()> {
        self.shared.fast.set_timeline(true);
        let (tx, rx) = mpsc::channel();
        self.push(Command::Timeline(Some((path, mark_cycles)), tx));
        SetReply(rx)
    }

    /// Stops the timeline; the reply comes once its file is finished.
    pub fn stop_timeline(&self) -> SetReply<()> {
        self.shared.fast.set_timeline(false);
        let (tx, rx) = mpsc::channel();
        self.push(Command::Timeline(None, tx));
        SetReply(rx)
    }

    fn check_dynamic(&self) -> Result<()> {
        if self.dynamic {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "process sets can only be added or removed after init() in dynamic mode: call \
                 init(process_sets=\"dynamic\") or set FERROVOD_DYNAMIC_PROCESS_SETS=1"
                    .into(),
            ))
        }
    }

    /// Removes a process set; the receiver yields false if it did not exist.
    pub fn remove_process_set(&self, id: u32) -> SetReply<bool> {
        let (tx, rx) = mpsc::channel();
        match self.check_dynamic() {
            Ok(()) => self.push(Command::RemoveSet(id, tx)),
            Err(e) => drop(tx.send(Err(e))),
        }
        SetReply(rx)
    }

    fn push(&self, cmd: Command) {
        self.door.push(cmd);
    }

    /// Stops the engine: pending ops fail with `Shutdown`, the coordinator (rank 0) tells the
    /// other ranks, threads are joined.
    pub fn shutdown(&mut self) {
        self.shared.fast.close();
        if let Some(m) = &self.shared.messenger {
            m.fail(Error::Shutdown(
                "ferrovod was shut down on this rank".into(),
            ));
        }
        if self.thread.is_some() {
            self.push(Command::Shutdown);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        if let Some(mut c) = self.coordinator.take() {
            c.stop();
        }
        if let Some(mut s) = self.store_server.take() {
            s.shutdown();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The engine's side of forming a job ([`bootstrap::ControlPlane`]): its coordinator, and each
/// rank's control connection to it.
struct EnginePlane<'a> {
    config: &'a Config,
    process_sets: &'a [Vec<usize>],
}

impl ControlPlane for EnginePlane<'_> {
    type Coordinator = Coordinator;
    type Control = connection::FrameConn;

    fn start_node(
        &mut self,
        listeners: CoordinatorListeners,
        secret: &[u8],
        tree: Option<&ControlTree>,
        rank: usize,
        parent: Option<CoordinatorAddr>,
    ) -> Result<Coordinator> {
        let config = self.config;
        let rings = (!config.shm_disable).then_some(crate::transport::shm::CONTROL_RING_BYTES);
        let parent = parent.map(|at| {
            let secret = secret.to_vec();
            let node = tree.and_then(|t| t.parent(rank)).unwrap_or(0);
            let (start, liveness) = (config.start_timeout, config.timeout);
            Box::new(move || connect_control(&at, rank, node, &secret, start, liveness, rings))
                as crate::control::node::ConnectUp
        });
        let cfg = CoordinatorConfig {
            size: config.launch.size,
            secret: secret.to_vec(),
            process_sets: self.process_sets.to_vec(),
            fusion_threshold: config.fusion_threshold,
            cache_capacity: config.cache_capacity,
            cycle_time: config.cycle_time,
            timeout: config.timeout,
            stall_check: config.stall_check,
            stall_shutdown: config.stall_shutdown,
            autotune: config.autotune.clone(),
            spin: config.spin,
            rank,
            tree: tree.cloned(),
            parent,
            sets_may_come: config.launch.launcher == crate::config::Launcher::ProcessGroup,
        };
        Coordinator::start(listeners.tcp, listeners.local, cfg)
    }

    fn place(&mut self, node: &Coordinator, tree: &ControlTree) {
        node.place(tree);
    }

    fn connect(
        &mut self,
        at: &CoordinatorAddr,
        rank: usize,
        node: usize,
        secret: &[u8],
    ) -> Result<connection::FrameConn> {
        let config = self.config;
        let rings = (!config.shm_disable).then_some(crate::transport::shm::CONTROL_RING_BYTES);
        connect_control(
            at,
            rank,
            node,
            secret,
            config.start_timeout,
            config.timeout,
            rings,
        )
    }
}

/// Connects to the coordinator's local socket, if it has one this rank can reach.
fn connect_local(name: Option<&str>) -> Option<UnixStream> {
    let addr = UnixAddr::from_abstract_name(name?.as_bytes()).ok()?;
    UnixStream::connect_addr(&addr).ok()
}

/// A control connection from `rank` (its engine, or its relay) to the node of rank `node` (the
/// coordinator, or a relay): the node's local socket when this rank can reach it, else TCP;
/// authenticated, introduced with this rank's number, moved onto shared-memory rings where
/// the node takes them, and returned once the node says every rank has joined.
fn connect_control(
    coordinator: &CoordinatorAddr,
    rank: usize,
    node: usize,
    secret: &[u8],
    timeout: Duration,
    liveness: Duration,
    rings: Option<usize>,
) -> Result<connection::FrameConn> {
    let deadline = Instant::now() + timeout;
    let addr = coordinator.tcp;
    let mut stream = loop {
        if let Some(s) = connect_local(coordinator.local.as_deref()) {
            break ControlStream::Unix(s);
        }
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => break ControlStream::Tcp(s),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(Error::Timeout {
                    what: format!("connecting to rank {node}'s control node at {addr}: {e}"),
                    after: timeout,
                })
            }
        }
    };
    auth::authenticate(&mut stream, secret, true, timeout)?;
    if let ControlStream::Tcp(s) = &stream {
        crate::sys::detect_unreachable_peer(std::os::fd::AsRawFd::as_raw_fd(s), liveness)?;
    }
    net::write_frame(&mut stream, &ToCoordinator::Hello { rank }.encode())?;
    if let ControlStream::Unix(s) = &mut stream {
        if let Some(link) = crate::transport::shm::ShmLink::offer_control(s, rings, timeout)? {
            stream = ControlStream::Shm(Box::new(link));
        }
    }
    let mut conn = connection::FrameConn::new(stream, node)?;
    // init() is collective: wait until every rank has registered with the coordinator.
    loop {
        // Read before parsing: the ready message and an immediate close (rank 0 shutting down
        // right after init) can arrive in the same read.
        let open = conn.fill()?;
        if let Some(frame) = conn.next_frame()? {
            return match FromCoordinator::decode(&frame)? {
                FromCoordinator::Ready => Ok(conn),
                other => Err(Error::Decode(format!(
                    "expected the coordinator's ready message, got {other:?}"
                ))),
            };
        }
        if !open {
            return Err(Error::PeerLost {
                rank: node,
                detail: format!("rank {node}'s control node closed the connection during start-up"),
            });
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: "waiting for every rank to connect to the coordinator".into(),
                after: timeout,
            });
        }
        conn.wait_readable(left)?;
    }
}
