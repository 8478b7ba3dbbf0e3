//! The engine: one background thread per process that takes submitted ops from a queue,
//! negotiates them with the coordinator (rank 0's [`coordinator`] thread), and executes the
//! responses — fused where possible — over the transport, completing each op's [`Handle`].
//!
//! The thread sleeps only when it has nothing to do: a submission (through an eventfd) or a
//! control message (through its socket) wakes it, after a short bounded spin.

pub mod autotune;
pub mod control;
pub mod coordinator;
mod device;
mod execute;
#[cfg(feature = "python")]
pub(crate) use execute::post_factor;
pub mod fast;
pub mod handle;
pub mod message;
pub mod names;
pub mod negotiate;
pub mod pool;
pub mod progress;
pub mod sys;
pub mod tensor;
pub mod timeline;
mod worker;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::bootstrap::tcp_store::{TcpStore, TcpStoreServer};
use crate::bootstrap::Store;
use crate::bootstrap::{auth, net};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::transport::hybrid::{HybridTransport, ShmOptions};
use crate::transport::tcp::TcpTransport;
use crate::types::{OpKind, ReduceOp};

pub use handle::{Handle, Output};
pub use message::{DeviceKind, TensorMeta};
pub use names::NameClaim;
pub use pool::PageBuf;
pub use progress::Progress;
pub use tensor::TensorBuf;

use control::ControlStream;
use coordinator::{Coordinator, CoordinatorConfig};
use message::{FromCoordinator, ToCoordinator};
use sys::Waker;

/// Where this process sits in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank within this host.
    pub local_rank: usize,
    /// Ranks on this host.
    pub local_size: usize,
    /// Index of this host among the hosts that have this local rank.
    pub cross_rank: usize,
    /// Number of hosts that have this local rank.
    pub cross_size: usize,
    /// Whether every host runs the same number of ranks.
    pub homogeneous: bool,
}

impl Topology {
    /// Groups ranks by host name (`hosts[r]` is rank r's host), in rank order.
    pub fn from_hosts(rank: usize, hosts: &[String]) -> Topology {
        let mut order: Vec<&String> = Vec::new();
        for h in hosts {
            if !order.contains(&h) {
                order.push(h);
            }
        }
        let local_of = |r: usize| hosts[..r].iter().filter(|h| **h == hosts[r]).count();
        let counts: Vec<usize> = order
            .iter()
            .map(|h| hosts.iter().filter(|x| x == h).count())
            .collect();
        let local_rank = local_of(rank);
        let local_size = hosts.iter().filter(|h| **h == hosts[rank]).count();
        // cross ranks: hosts that have a rank with this local rank, in host order
        let column: Vec<&String> = order
            .iter()
            .filter(|h| hosts.iter().filter(|x| x == *h).count() > local_rank)
            .copied()
            .collect();
        Topology {
            rank,
            size: hosts.len(),
            local_rank,
            local_size,
            cross_rank: column.iter().position(|h| **h == hosts[rank]).unwrap_or(0),
            cross_size: column.len(),
            homogeneous: counts.windows(2).all(|w| w[0] == w[1]),
        }
    }
}

/// A host index per rank for the collectives ([`crate::comm::Communicator::with_hosts`]): ranks
/// that published the same host name share one, numbered in order of first appearance; a rank
/// that published none is a host of its own (as it gets no shared-memory peers either).
fn host_indices(hosts: &[String]) -> Vec<u32> {
    let mut names: Vec<&str> = Vec::new();
    hosts
        .iter()
        .map(|h| {
            let i = match names.iter().position(|n| !h.is_empty() && n == h) {
                Some(i) => i,
                None => {
                    names.push(h);
                    names.len() - 1
                }
            };
            i as u32
        })
        .collect()
}

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

/// A submitted op.
pub struct OpSpec {
    /// Process set id.
    pub set_id: u32,
    /// Matching name.
    pub name: String,
    /// Kind.
    pub kind: OpKind,
    /// Reduction.
    pub op: ReduceOp,
    /// Broadcast root (global rank).
    pub root: usize,
    /// Pre-scale factor.
    pub prescale: f64,
    /// Post-scale factor.
    pub postscale: f64,
    /// Tensors (several for grouped ops).
    pub tensors: Vec<TensorSpec>,
    /// Alltoall rows per destination; empty = equal split.
    pub splits: Vec<usize>,
}

pub(crate) enum Command {
    Op(Box<OpSpec>, Handle),
    /// An op this rank refuses, with the reason (see [`Engine::reject`]).
    Reject(Box<OpSpec>, String, Handle),
    Join(Handle),
    AddSet(Vec<usize>, mpsc::Sender<Result<u32>>),
    RemoveSet(u32, mpsc::Sender<Result<bool>>),
    /// Start (path, mark cycles) or stop (`None`) the timeline.
    Timeline(Option<(String, bool)>, mpsc::Sender<Result<()>>),
    Shutdown,
}

pub(crate) struct Shared {
    queue: Mutex<Vec<Command>>,
    waker: Waker,
    /// Held by a caller driving the worker (see [`progress`]).
    lease: progress::Lease,
    /// The engine thread is (about to be) blocked in its long idle poll: a submission must
    /// wake it even while a caller holds the lease, or it sleeps on with the op unsent.
    polling: std::sync::atomic::AtomicBool,
    sets: Mutex<HashMap<u32, Vec<usize>>>,
    /// The fast path, which the worker closes when the engine fails.
    fast: Arc<fast::FastPath>,
    /// Names of this rank's ops in flight.
    in_flight: Arc<names::InFlight>,
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
    dynamic: bool,
}

impl Engine {
    /// Rendezvous with the other ranks, connect, and start the background thread.
    /// `generation` counts this process's `init()` calls, so a re-init after `shutdown()`
    /// uses fresh rendezvous keys.
    pub fn start(config: &Config, process_sets: &[Vec<usize>], generation: u64) -> Result<Engine> {
        let launch = &config.launch;
        let (rank, size) = (launch.rank, launch.size);
        for ps in process_sets {
            if ps.is_empty() || ps.iter().any(|&r| r >= size) || ps.windows(2).any(|w| w[0] >= w[1])
            {
                return Err(Error::InvalidArgument(format!(
                    "invalid process set {ps:?} for a job of {size} ranks"
                )));
            }
        }
        launch.require_rendezvous()?;
        // FERROVOD_IFACE pins the data and coordinator listeners to one interface; a wrong name fails here, before
        // anything is bound or published.
        let bind_ip = match &config.iface {
            Some(name) => {
                let ip = iface_ip(name, &config.hostname)?;
                log::debug!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: listening on {ip} (FERROVOD_IFACE={name})"
                );
                Some(ip)
            }
            None => None,
        };
        let secret = match &launch.secret {
            Some(s) => s.clone(),
            None if size == 1 => auth::random_secret(),
            None => {
                return Err(Error::InvalidArgument(
                    "FERROVOD_SECRET is not set: start the job with ferrovodrun".into(),
                ))
            }
        };
        let deadline = config.start_timeout;
        let coord_cfg = CoordinatorConfig {
            size,
            secret: secret.clone(),
            process_sets: process_sets.to_vec(),
            fusion_threshold: config.fusion_threshold,
            cache_capacity: config.cache_capacity,
            cycle_time: config.cycle_time,
            timeout: config.timeout,
            stall_check: config.stall_check,
            stall_shutdown: config.stall_shutdown,
            autotune: config.autotune.clone(),
            spin: config.spin,
        };
        log::debug!(
            target: crate::LOG_TARGET,
            "rank {rank}/{size}: launch environment: {}{}",
            launch.launcher.describe(),
            match &launch.rendezvous_addr {
                Some(addr) if launch.rank0_hosts_store => format!(", rendezvous store on rank 0 at {addr}"),
                Some(addr) => format!(", rendezvous at {addr}"),
                None => String::new(),
            }
        );
        if launch.secret_derived && rank == 0 {
            log::info!(
                target: crate::LOG_TARGET,
                "no FERROVOD_SECRET from the launcher: the job secret is derived from the job's \
                 identity, which keeps other jobs out but not someone who can read this job's \
                 environment; set FERROVOD_SECRET (hex) on every rank for a real secret"
            );
        }
        // Without ferrovodrun, rank 0 serves the rendezvous store itself.
        let store_server = match (&launch.rendezvous_addr, launch.rank0_hosts_store, rank) {
            (Some(addr), true, 0) => Some(host_store(addr, &secret)?),
            _ => None,
        };

        let (mut transport, coordinator, coord_addr, hosts) = match &launch.rendezvous_addr {
            None => {
                let ip = bind_ip.unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
                let listener = TcpListener::bind((ip, 0))?;
                let addr = listener.local_addr()?;
                let (local, local_name) = bind_local_control().unzip();
                let coordinator = Coordinator::start(listener, local, coord_cfg)?;
                let data = TcpListener::bind((ip, 0))?;
                let transport = TcpTransport::connect_mesh(
                    0,
                    1,
                    &data,
                    &[data.local_addr()?],
                    &secret,
                    deadline,
                )?;
                (
                    transport,
                    Some(coordinator),
                    CoordinatorAddr {
                        tcp: addr,
                        local: local_name,
                    },
                    vec![config.hostname.clone()],
                )
            }
            Some(rdv) => {
                let store = TcpStore::connect(rdv.as_str(), &secret, deadline)?;
                let ip = match bind_ip {
                    Some(ip) => ip,
                    None => advertised_ip(rdv)?,
                };
                let data = TcpListener::bind((ip, 0))?;
                let key = |k: &str| format!("g{generation}/{k}");
                let coordinator = if rank == 0 {
                    let listener = TcpListener::bind((ip, 0))?;
                    let addr = listener.local_addr()?;
                    let (local, local_name) = bind_local_control().unzip();
                    let c = Coordinator::start(listener, local, coord_cfg)?;
                    let published = format!("{addr}\n{}", local_name.unwrap_or_default());
                    store.set(&key("coordinator"), published.as_bytes())?;
                    Some(c)
                } else {
                    None
                };
                // Process sets are registered by position (ids 1, 2, ...) and added or removed
                // in dynamic mode by every rank alike: a rank that differs would get other ids
                // or wait alone for a change the others refuse.
                let settings = format!(
                    "{} process_sets={process_sets:?} dynamic_process_sets={}",
                    config.tuning.shared_settings(),
                    u8::from(config.dynamic_process_sets)
                );
                let me = format!("{}\n{}\n{settings}", data.local_addr()?, config.hostname);
                store.set(&key(&format!("peer/{rank}")), me.as_bytes())?;
                let mut addrs = Vec::with_capacity(size);
                let mut hosts = Vec::with_capacity(size);
                let mut disagree = None;
                for r in 0..size {
                    let v = store.get(&key(&format!("peer/{r}")), deadline)?;
                    let text = String::from_utf8_lossy(&v).to_string();
                    let mut lines = text.splitn(3, '\n');
                    let a = lines.next().unwrap_or_default();
                    let h = lines.next().unwrap_or_default();
                    let theirs = lines.next().unwrap_or_default();
                    addrs.push(a.parse::<SocketAddr>().map_err(|e| {
                        Error::Decode(format!("rank {r} published a bad address {a:?}: {e}"))
                    })?);
                    hosts.push(h.to_string());
                    if theirs != settings && disagree.is_none() {
                        disagree = Some((r, theirs.to_string()));
                    }
                }
                // Every rank reads every entry, so every rank fails here alike, before any
                // collective could hang on the difference.
                if let Some((r, theirs)) = disagree {
                    return Err(Error::InvalidArgument(format!(
                        "ranks disagree on settings every rank must share: rank {rank} has \
                         `{settings}`, rank {r} has `{theirs}`; set them the same everywhere \
                         (ferrovodrun passes its environment, and `-x VAR=value`, to every rank; \
                         every rank must pass the same init(process_sets=...))"
                    )));
                }
                let coord = store.get(&key("coordinator"), deadline)?;
                let coord = String::from_utf8_lossy(&coord).to_string();
                let (tcp, local) = coord.split_once('\n').unwrap_or((coord.as_str(), ""));
                let coord_addr = CoordinatorAddr {
                    tcp: tcp
                        .parse::<SocketAddr>()
                        .map_err(|e| Error::Decode(format!("bad coordinator address: {e}")))?,
                    // Only a rank on rank 0's host can reach its abstract socket; a rank whose
                    // host merely has the same name falls back to TCP when connecting fails.
                    local: (!local.is_empty() && !hosts[0].is_empty() && hosts[rank] == hosts[0])
                        .then(|| local.to_string()),
                };
                let transport =
                    TcpTransport::connect_mesh(rank, size, &data, &addrs, &secret, deadline)?;
                (transport, coordinator, coord_addr, hosts)
            }
        };

        transport.spin = config.spin;
        // Peers that published this rank's host name move to shared memory. Every rank derives
        // the lists from the same host table, so they are symmetric, as the handshake needs; a
        // pair that cannot share memory (same name, different machines or network namespaces)
        // stays on TCP.
        let local: Vec<usize> = (0..size)
            .filter(|&r| r != rank && !hosts[rank].is_empty() && hosts[r] == hosts[rank])
            .collect();
        let options = ShmOptions {
            disabled: config.shm_disable,
            ..ShmOptions::default()
        };
        let transport =
            HybridTransport::upgrade(transport, &local, &options, config.start_timeout)?;
        let fast = Arc::new(fast::FastPath::new(
            rank,
            size,
            transport.boards()?,
            // A fast op cannot be given up on one rank alone (a peer may be reading its
            // offer), so a job that asks for stalled ops to fail keeps every op in the engine.
            if config.stall_shutdown.is_some() {
                0
            } else {
                config.fast_path_bytes
            },
            config.spin,
            config.stall_check,
        ));
        // A timeline from the start records every op, so none may bypass the engine.
        fast.set_timeline(config.timeline.is_some());
        let shm = transport.shm_peers();
        let links: Vec<String> = (0..size)
            .filter(|&r| r != rank)
            .map(|r| format!("{r} {}", if shm.contains(&r) { "shm" } else { "tcp" }))
            .collect();
        log::debug!(
            target: crate::LOG_TARGET,
            "rank {rank}: transport to each peer: {}; coordinator at {}{}",
            if links.is_empty() { "none (one rank)".to_string() } else { links.join(", ") },
            coord_addr.tcp,
            if coord_addr.local.is_some() { " (reached over a local socket)" } else { "" }
        );
        let mut topology = Topology::from_hosts(rank, &hosts);
        if let Some((lr, ls, cr, cs)) = launch.local {
            topology.local_rank = lr;
            topology.local_size = ls;
            topology.cross_rank = cr;
            topology.cross_size = cs;
        }
        let rings = (!config.shm_disable).then_some(crate::transport::shm::CONTROL_RING_BYTES);
        let control = connect_control(&coord_addr, rank, &secret, deadline, config.timeout, rings)?;

        let mut sets: HashMap<u32, Vec<usize>> = HashMap::new();
        sets.insert(0, (0..size).collect());
        for (i, ps) in process_sets.iter().enumerate() {
            sets.insert(i as u32 + 1, ps.clone());
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(Vec::new()),
            waker: Waker::new()?,
            lease: progress::Lease::default(),
            polling: std::sync::atomic::AtomicBool::new(false),
            sets: Mutex::new(sets.clone()),
            fast,
            in_flight: Arc::default(),
        });
        let w = worker::Worker::new(
            config,
            rank,
            Box::new(transport),
            control,
            shared.clone(),
            sets,
            host_indices(&hosts),
            device::DeviceState::new(
                launch.rendezvous_addr.clone().map(|a| (a, secret.clone())),
                generation,
                config.timeout,
                config.start_timeout,
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
            shared,
            thread: Some(thread),
            coordinator,
            store_server,
            progress,
            dynamic: config.dynamic_process_sets,
        })
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

    /// Queues an op; the handle completes when it is done. Fails at once, queuing nothing,
    /// when an op under the same name is still in flight in its process set.
    pub fn submit(&self, op: OpSpec) -> Result<Handle> {
        let claim = self.claim(&op)?;
        Ok(self.submit_claimed(op, claim, true))
    }

    /// Claims the name of `op` until the claim drops or moves into its handle (see [`names`]).
    pub fn claim(&self, op: &OpSpec) -> Result<NameClaim> {
        self.shared.in_flight.claim(op.set_id, &op.name, op.kind)
    }

    /// Queues an op whose name `claim` holds. `slotted`: false when its fast-path slot is
    /// already spent (see [`fast`]).
    pub fn submit_claimed(&self, op: OpSpec, claim: NameClaim, slotted: bool) -> Handle {
        if slotted && op.set_id == 0 {
            self.shared.fast.decline();
        }
        let h = Handle::counted(self.shared.fast.outstanding()).hold(claim);
        self.push(Command::Op(Box::new(op), h.clone()));
        h
    }

    /// Takes part in the negotiation of an op this rank refuses (arguments it cannot describe
    /// to the engine: an unknown reduction, an unsupported dtype...), so that every member of
    /// the set fails it with `reason` instead of waiting for it. `op` holds what is known of
    /// it (its tensors may be empty). The handle completes with that error once every member
    /// has submitted the name.
    pub fn reject(&self, op: OpSpec, reason: String) -> Result<Handle> {
        let claim = self.claim(&op)?;
        if op.set_id == 0 {
            self.shared.fast.decline();
        }
        let h = Handle::counted(self.shared.fast.outstanding()).hold(claim);
        self.push(Command::Reject(Box::new(op), reason, h.clone()));
        Ok(h)
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

    /// Registers a process set (every rank must call this in the same order). The receiver
    /// yields its id once every rank has asked for it.
    pub fn add_process_set(&self, ranks: Vec<usize>) -> SetReply<u32> {
        let (tx, rx) = mpsc::channel();
        match self.check_dynamic() {
            Ok(()) => self.push(Command::AddSet(ranks, tx)),
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

    /// Stops the engine: pending ops fail with `Shutdown`, the coordinator (rank 0) tells the
    /// other ranks, threads are joined.
    pub fn shutdown(&mut self) {
        self.shared.fast.close();
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

/// Starts the rendezvous store on rank 0 at the port of `addr`, on every interface (other
/// ranks reach it through whatever `addr`'s host name resolves to on their side).
fn host_store(addr: &str, secret: &[u8]) -> Result<TcpStoreServer> {
    let port = addr
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("rendezvous address {addr:?} has no port"))
        })?;
    TcpStoreServer::start(SocketAddr::from(([0, 0, 0, 0], port)), secret.to_vec()).map_err(|e| {
        Error::InvalidArgument(format!(
            "rank 0 cannot serve the rendezvous store on port {port} ({e}); pick a free port \
             with FERROVOD_RENDEZVOUS_ADDR=<host>:<port>"
        ))
    })
}

/// The IPv4 address of interface `name` (`FERROVOD_IFACE`), or an error naming it, this host
/// and the interfaces it has.
pub fn iface_ip(name: &str, hostname: &str) -> Result<std::net::IpAddr> {
    let all = sys::interfaces()?;
    if let Some(i) = all.iter().find(|i| i.name == name) {
        return Ok(std::net::IpAddr::V4(i.addr));
    }
    let have: Vec<String> = all
        .iter()
        .map(|i| format!("{} {}/{}", i.name, i.addr, i.prefix))
        .collect();
    Err(Error::InvalidArgument(format!(
        "FERROVOD_IFACE={name}: host {hostname} has no network interface {name:?} with an IPv4 \
         address; its interfaces: {}",
        if have.is_empty() {
            "none".to_string()
        } else {
            have.join(", ")
        }
    )))
}

/// The address other ranks can reach this process on: the local address of the route to the
/// rendezvous store (a UDP "connect" sends nothing; it only picks the route).
fn advertised_ip(rendezvous: &str) -> Result<std::net::IpAddr> {
    let target = rendezvous
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("bad rendezvous address {rendezvous:?}: {e}")))?
        .next()
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "rendezvous address {rendezvous:?} does not resolve"
            ))
        })?;
    if target.ip().is_loopback() {
        return Ok(target.ip());
    }
    let bind = if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let s = UdpSocket::bind(bind)?;
    s.connect(target)?;
    Ok(s.local_addr()?.ip())
}

/// Where the coordinator listens: TCP, and an abstract Unix socket for ranks on its host.
struct CoordinatorAddr {
    tcp: SocketAddr,
    local: Option<String>,
}

/// Binds the coordinator's local control socket under a random abstract name (no file to
/// clean up; other jobs cannot guess it, and connections are authenticated anyway). `None`
/// when this host does not allow it: every rank then uses TCP.
fn bind_local_control() -> Option<(UnixListener, String)> {
    let bound = crate::transport::shm::random_name("ferrovod-control").and_then(|name| {
        let addr = UnixAddr::from_abstract_name(name.as_bytes())?;
        Ok((UnixListener::bind_addr(&addr)?, name))
    });
    match bound {
        Ok(l) => Some(l),
        Err(e) => {
            log::debug!(target: crate::LOG_TARGET, "no local control socket ({e}); using TCP");
            None
        }
    }
}

/// Connects to the coordinator's local socket, if it has one this rank can reach.
fn connect_local(name: Option<&str>) -> Option<UnixStream> {
    let addr = UnixAddr::from_abstract_name(name?.as_bytes()).ok()?;
    UnixStream::connect_addr(&addr).ok()
}

fn connect_control(
    coordinator: &CoordinatorAddr,
    rank: usize,
    secret: &[u8],
    timeout: Duration,
    liveness: Duration,
    rings: Option<usize>,
) -> Result<control::FrameConn> {
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
                    what: format!("connecting to the coordinator at {addr}: {e}"),
                    after: timeout,
                })
            }
        }
    };
    auth::authenticate(&mut stream, secret, true, timeout)?;
    if let ControlStream::Tcp(s) = &stream {
        sys::detect_unreachable_peer(std::os::fd::AsRawFd::as_raw_fd(s), liveness)?;
    }
    net::write_frame(&mut stream, &ToCoordinator::Hello { rank }.encode())?;
    if let ControlStream::Unix(s) = &mut stream {
        if let Some(link) = crate::transport::shm::ShmLink::offer_control(s, rings, timeout)? {
            stream = ControlStream::Shm(Box::new(link));
        }
    }
    let mut conn = control::FrameConn::new(stream, 0)?;
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
                rank: 0,
                detail: "the coordinator closed the connection during start-up".into(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_groups_hosts() {
        let hosts: Vec<String> = ["a", "a", "b", "b", "c"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let t = Topology::from_hosts(3, &hosts);
        assert_eq!(
            (t.local_rank, t.local_size, t.cross_rank, t.cross_size),
            (1, 2, 1, 2)
        );
        let t = Topology::from_hosts(4, &hosts);
        assert_eq!(
            (t.local_rank, t.local_size, t.cross_rank, t.cross_size),
            (0, 1, 2, 3)
        );
        assert!(!t.homogeneous);
    }

    #[test]
    fn host_indices_follow_first_appearance() {
        let hosts: Vec<String> = ["b", "a", "b", "", "a", ""]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(host_indices(&hosts), vec![0, 1, 0, 2, 1, 3]);
    }

    #[test]
    fn iface_names_resolve_or_fail_clearly() {
        let lo = sys::interfaces()
            .unwrap()
            .into_iter()
            .find(|i| i.addr.is_loopback())
            .expect("a loopback interface");
        assert_eq!(
            iface_ip(&lo.name, "h").unwrap(),
            std::net::IpAddr::V4(lo.addr)
        );
        let e = iface_ip("nosuch0", "hostA").unwrap_err().to_string();
        assert!(
            e.contains("nosuch0") && e.contains("hostA") && e.contains(&lo.name),
            "{e}"
        );
    }
}
