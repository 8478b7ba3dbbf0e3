//! Forming a job: [`form`] takes the settings ([`Config`], whose `launch` says who this rank is)
//! and a [`Membership`], and does everything that comes before the engine's threads, in this
//! order on every rank:
//!
//! 1. check the membership, pick the address to listen on and the job secret;
//! 2. when no launcher of ours serves the rendezvous store, rank 0 serves it, and rank 0 starts
//!    its coordinator and publishes where it listens;
//! 3. every rank publishes its data address, its host name and the settings every rank must
//!    share, and reads everyone else's (a difference fails every rank alike);
//! 4. every rank derives the control tree from the host table ([`ControlTree`]): rank 0 gives
//!    it to its coordinator, every other rank with children starts a relay and publishes where
//!    it listens;
//! 5. the TCP mesh, then the move of each same-host pair to shared memory;
//! 6. the control connection to this rank's node (its own, else its parent's), which
//!    completes once every rank has joined.
//!
//! Forming sits above both [`crate::bootstrap`] (launch environment, secret, store, host
//! grouping) and [`crate::transport`] (the data links it makes), so the layers run one way:
//! neither of those imports the other's users.
//!
//! The coordinator and the messages on the control connection are the engine's (the
//! coordinator negotiates ops), so forming does not build them: the engine hands [`form`] a
//! [`ControlPlane`] whose hooks it calls at steps 2, 4 and 6, on the listeners and the
//! addresses forming chose. That keeps the start-up order in one place without forming knowing
//! any engine type; the engine in turn knows no store addresses, meshes or host names.
//!
//! Everything a forming creates is owned by the [`Job`] it returns (or dropped when it fails),
//! and its rendezvous keys carry the membership's generation. So the same process can form a
//! job again — after a shutdown, or with other members — and nothing of an earlier forming
//! (threads, sockets, segments, store entries) takes part or stays behind.
//!
//! [`form`] is here; steps 3 and 4 (and a job of one rank) are in `meet.rs`, the addresses and
//! listeners in `addr.rs`.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bootstrap::auth;
use crate::bootstrap::tcp_store::{TcpStore, TcpStoreServer};
use crate::bootstrap::topology::{host_indices, ControlTree, Topology};
use crate::bootstrap::Store;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::transport::hybrid::HybridTransport;
use crate::transport::messenger::Messenger;
use crate::transport::offers::OfferRecords;

mod addr;
mod meet;

pub use addr::iface_ip;
use addr::{advertised_ip, host_ip, host_store};
use meet::{alone, local_peers, meet, Met};

/// What a forming needs beyond the launch environment (`config.launch`: this rank, the job's
/// size, the rendezvous address and secret).
#[derive(Clone, Copy)]
pub struct Membership<'a> {
    /// Process sets registered at start-up, as ids 1, 2, ... in this order; each is sorted,
    /// distinct global ranks.
    pub process_sets: &'a [Vec<usize>],
    /// Which forming of a job this is in this process. The rendezvous keys carry it, so a
    /// forming never reads an earlier one's entries from a store that outlived it.
    pub generation: u64,
    /// A store the caller forms over instead of the rendezvous store at
    /// `config.launch.rendezvous_addr`: torch.distributed's front end forms over the store
    /// torch hands its backend, so such a job has one rendezvous, torch's. Its
    /// `rendezvous_addr`, when set, is only where the store lives (the address to listen on is
    /// the one that reaches it).
    pub store: Option<&'a Arc<dyn Store>>,
    /// Where rank 0 serves the rendezvous store when it hosts it: the listener the address
    /// exchange opened on the port it handed out (see [`crate::sys::tcp_listener_from_fd`]).
    pub store_listener: Option<&'a std::net::TcpListener>,
}

/// The sockets the coordinator accepts control connections on.
#[derive(Debug)]
pub struct CoordinatorListeners {
    /// TCP, on the address this rank listens on.
    pub tcp: TcpListener,
    /// An abstract Unix socket for ranks on rank 0's host (`None` where the host forbids it).
    pub local: Option<UnixListener>,
}

/// Where a rank reaches a node of the control tree (the coordinator, or a relay).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorAddr {
    /// The node's TCP address.
    pub tcp: SocketAddr,
    /// The abstract name of its Unix socket, given only to ranks on rank 0's host (others
    /// could not reach it).
    pub local: Option<String>,
}

impl CoordinatorAddr {
    /// How a node publishes it in the rendezvous store (read back in `meet`).
    fn record(&self) -> String {
        format!(
            "{}\n{}",
            self.tcp,
            self.local.as_deref().unwrap_or_default()
        )
    }
}

/// The job's control plane, which the engine defines: rank 0's coordinator and each rank's
/// connection to it. [`form`] calls the hooks; see the module doc for when.
pub trait ControlPlane {
    /// A running node of the control tree: rank 0's coordinator, or a relay.
    type Coordinator;
    /// This rank's connection to its node.
    type Control;

    /// Starts this rank's node of the control tree on `listeners`: the coordinator on rank 0
    /// (`parent` is `None`), else a relay, which connects to its parent's node at `parent`
    /// (rank `tree.parent(rank)`) once the links below it have connected. `secret` is the job
    /// secret every control connection must prove. Rank 0 starts before the host table is
    /// read, with no `tree` (connections wait until [`ControlPlane::place`] gives it one).
    fn start_node(
        &mut self,
        listeners: CoordinatorListeners,
        secret: &[u8],
        tree: Option<&ControlTree>,
        rank: usize,
        parent: Option<CoordinatorAddr>,
    ) -> Result<Self::Coordinator>;

    /// Gives rank 0's coordinator, started early, the control tree.
    fn place(&mut self, node: &Self::Coordinator, tree: &ControlTree);

    /// Connects this rank (`rank`) to the node of rank `node` at `at` (its own node, or its
    /// parent's), once the data links are up, and returns when every rank has connected:
    /// forming a job is collective.
    fn connect(
        &mut self,
        at: &CoordinatorAddr,
        rank: usize,
        node: usize,
        secret: &[u8],
    ) -> Result<Self::Control>;
}

/// A formed job: what the engine's threads run on. Dropping it closes every connection and
/// stops the coordinator and the store it holds.
pub struct Job<P: ControlPlane> {
    /// Where this rank sits.
    pub topology: Topology,
    /// A host index per rank, for the collectives (see [`host_indices`]).
    pub hosts: Vec<u32>,
    /// Data links to every other rank: shared memory on this host, TCP otherwise.
    pub transport: HybridTransport,
    /// Point-to-point messages with any other rank, over connections of their own (`None` in
    /// a job of one rank).
    pub messenger: Option<Messenger>,
    /// How to reach the rendezvous store after forming (the device path exchanges NCCL ids
    /// through it); `None` for a one-rank job without one.
    pub store: Option<StoreLink>,
    /// How many CPUs this rank has to itself ([`crate::cpus::share`]) among its host's ranks.
    pub cpu_share: f64,
    /// Every rank's fast-path offer records, when every rank is on this host.
    pub offer_records: Option<OfferRecords>,
    /// This rank's node of the control tree: rank 0's coordinator, a relay on a rank with
    /// children, none on the others.
    pub coordinator: Option<P::Coordinator>,
    /// The connection to this rank's node (its own, or its parent's).
    pub control: P::Control,
    /// The rendezvous store, when rank 0 serves it (launchers other than ferrovodrun).
    pub store_server: Option<TcpStoreServer>,
}

/// How a formed job's ranks reach its rendezvous store again.
#[derive(Clone)]
pub enum StoreLink {
    /// ferrovod's own store: its address, the job secret, and how long connecting may take. A
    /// way to connect rather than a connection: most jobs never use the store after forming,
    /// and an idle connection from every rank would hold the store server's connections for
    /// the job's life.
    Tcp {
        /// host:port.
        addr: String,
        /// The job secret the store checks.
        secret: Vec<u8>,
        /// How long connecting may take.
        timeout: Duration,
    },
    /// The store the job was formed over ([`Membership::store`]), which its owner keeps.
    Given(Arc<dyn Store>),
}

impl StoreLink {
    /// The store: a new connection proving the job secret, or the given one.
    pub fn connect(&self) -> Result<Arc<dyn Store>> {
        match self {
            StoreLink::Tcp {
                addr,
                secret,
                timeout,
            } => Ok(Arc::new(TcpStore::connect(
                addr.as_str(),
                secret,
                *timeout,
            )?)),
            StoreLink::Given(store) => Ok(store.clone()),
        }
    }
}

/// Forms the job `config.launch` describes with `membership` (see the module doc for the
/// steps). Collective: every rank of the job calls it with the same generation and process
/// sets, and it returns once every rank is connected, or fails within about
/// `config.start_timeout` (`Timeout`, naming what it waited for). A membership or setting
/// ranks disagree on, a bad process set, a missing rendezvous address or secret, or a wrong
/// `FERROVOD_IFACE` are `InvalidArgument`, before anything is connected where possible.
pub fn form<P: ControlPlane>(
    config: &Config,
    membership: &Membership<'_>,
    plane: &mut P,
) -> Result<Job<P>> {
    let launch = &config.launch;
    let (rank, size) = (launch.rank, launch.size);
    for ps in membership.process_sets {
        if ps.is_empty() || ps.iter().any(|&r| r >= size) || ps.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::InvalidArgument(format!(
                "invalid process set {ps:?} for a job of {size} ranks"
            )));
        }
    }
    let given = membership.store.filter(|_| size > 1);
    if given.is_none() {
        launch.require_rendezvous()?;
    }
    // FERROVOD_IFACE pins the data and coordinator listeners to one interface; a wrong name
    // fails here, before anything is bound or published.
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
    let secret = match (&launch.secret, given) {
        (Some(s), _) => s.clone(),
        (None, _) if size == 1 => auth::random_secret(),
        (None, Some(store)) => secret_through(store.as_ref(), rank, membership.generation, config)?,
        (None, None) => {
            return Err(Error::InvalidArgument(
                "FERROVOD_SECRET is not set: start the job with ferrovodrun".into(),
            ))
        }
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
    // Without ferrovodrun (and without a store handed in), rank 0 serves the rendezvous store
    // itself.
    let store_server = match (&launch.rendezvous_addr, launch.rank0_hosts_store, rank) {
        (Some(addr), true, 0) if given.is_none() => {
            Some(host_store(addr, &secret, membership.store_listener)?)
        }
        _ => None,
    };

    let Met {
        mut transport,
        coordinator,
        coord_addr,
        node,
        hosts,
        cpus,
        offers,
    } = {
        // The store to meet through: the one handed in, else a connection to the rendezvous
        // store, closed once met (nothing later needs it). A job of one rank meets nobody: a
        // store handed in is not needed, and its address (torch's) is no store of ours.
        let dialled = match (membership.store, &launch.rendezvous_addr) {
            (None, Some(rdv)) => Some(TcpStore::connect(rdv, &secret, config.start_timeout)?),
            _ => None,
        };
        let store: Option<&dyn Store> = match given {
            Some(store) => Some(store.as_ref()),
            None => dialled.as_ref().map(|s| s as &dyn Store),
        };
        match store {
            None => alone(config, bind_ip, &secret, plane)?,
            Some(store) => {
                // Listen on the address that reaches the store (a handed-in store's address
                // may be unknown: a file store).
                let ip = match (bind_ip, &launch.rendezvous_addr) {
                    (Some(ip), _) => ip,
                    (None, Some(at)) => advertised_ip(at)?,
                    (None, None) => host_ip(&config.hostname),
                };
                meet(config, membership, store, ip, &secret, plane)?
            }
        }
    };
    transport.spin = config.spin;
    let local = local_peers(rank, &hosts);
    // The fast path's offer records, where every rank is on this host (every rank decides
    // alike, from the same host table).
    let offer_records = match offers {
        Some((made, address)) if local.len() + 1 == size => OfferRecords::form(
            rank,
            size,
            made,
            &address,
            Instant::now() + config.start_timeout,
        ),
        _ => None,
    };
    log::debug!(
        target: crate::LOG_TARGET,
        "rank {rank}: data links made on first use, over shared memory with {} rank(s) of this \
         host{}, over TCP with the other {}; control node (rank {node}) at {}{}",
        local.len(),
        if config.shm_disable { " (off: TCP)" } else { "" },
        size - 1 - local.len(),
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
    // `local` is ascending: this rank's place among its host's ranks is the count below it.
    let me = local.partition_point(|&r| r < rank);
    let mut host_cpus = Vec::with_capacity(local.len() + 1);
    for &r in local[..me].iter().chain([&rank]).chain(&local[me..]) {
        host_cpus.push(crate::cpus::parse_list(&cpus[r]).ok_or_else(|| {
            Error::Decode(format!("rank {r} published a bad CPU list {:?}", cpus[r]))
        })?);
    }
    let quota = crate::cpus::quota();
    let cpu_share = crate::cpus::share(me, &host_cpus, quota);
    log::debug!(
        target: crate::LOG_TARGET,
        "rank {rank}: {cpu_share:.2} CPUs to itself (CPUs {}, {} rank(s) on this host, CPU \
         quota {})",
        cpus[rank],
        host_cpus.len(),
        quota.map_or("none".to_string(), |q| format!("{q:.2}"))
    );
    let control = plane.connect(&coord_addr, rank, node, &secret)?;
    let store = match membership.store {
        Some(store) => Some(StoreLink::Given(store.clone())),
        None => launch.rendezvous_addr.as_ref().map(|addr| StoreLink::Tcp {
            addr: addr.clone(),
            secret: secret.clone(),
            timeout: config.start_timeout,
        }),
    };
    Ok(Job {
        topology,
        hosts: host_indices(&hosts),
        messenger: transport.messenger().inspect(|m| m.set_spin(config.spin)),
        transport,
        store,
        cpu_share,
        offer_records,
        coordinator,
        control,
        store_server,
    })
}

/// The job secret, for a job formed over a store handed in with no `FERROVOD_SECRET`: rank 0
/// draws one and the others read it from the store. It keeps other jobs out; it keeps out
/// nobody who can read that store (torch's stores authenticate no one), as rank 0 says once.
fn secret_through(
    store: &dyn Store,
    rank: usize,
    generation: u64,
    config: &Config,
) -> Result<Vec<u8>> {
    let key = format!("g{generation}/secret");
    if rank == 0 {
        log::info!(
            target: crate::LOG_TARGET,
            "no FERROVOD_SECRET: the job secret is handed to the ranks through the store the job \
             was formed over, which keeps other jobs out but not someone who can read that \
             store; set FERROVOD_SECRET (hex) on every rank for a real secret"
        );
        let secret = auth::random_secret();
        store.set(&key, auth::secret_to_hex(&secret).as_bytes())?;
        Ok(secret)
    } else {
        let hex = store.get(&key, config.start_timeout)?;
        auth::secret_from_hex(&String::from_utf8_lossy(&hex))
            .map_err(|_| Error::Decode(format!("rank 0 published a bad job secret under {key}")))
    }
}
