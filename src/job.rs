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

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bootstrap::auth;
use crate::bootstrap::tcp_store::{TcpStore, TcpStoreServer};
use crate::bootstrap::topology::{host_indices, ControlTree, Topology};
use crate::bootstrap::Store;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::sys::interfaces;
use crate::transport::host_memory::Exposed;
use crate::transport::hybrid::{HybridTransport, ShmOptions};
use crate::transport::offers::OfferRecords;
use crate::transport::tcp::Mesh;

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
        (Some(addr), true, 0) if given.is_none() => Some(host_store(addr, &secret)?),
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
        transport,
        store,
        cpu_share,
        offer_records,
        coordinator,
        control,
        store_server,
    })
}

/// What steps 3 and 4 leave.
struct Met<P: ControlPlane> {
    /// The data links (made on first use).
    transport: HybridTransport,
    /// This rank's node, if it runs one.
    coordinator: Option<P::Coordinator>,
    /// Where this rank's node listens (its own, or its parent's).
    coord_addr: CoordinatorAddr,
    /// That node's rank.
    node: usize,
    /// Each rank's host name.
    hosts: Vec<String>,
    /// The CPUs each rank may run on, as it published them (parsed for this host's ranks only).
    cpus: Vec<String>,
    /// Where every rank of a one-host job takes part in the fast path's records: the segment
    /// rank 0 made (on rank 0) and its address.
    offers: Option<(Option<Exposed>, Vec<u8>)>,
}

/// The peers that published this rank's host name: their links move to shared memory. Every
/// rank derives the lists from the same host table, so they are symmetric, as the handshake
/// needs; a pair that cannot share memory (same name, different machines or network
/// namespaces) stays on TCP.
fn local_peers(rank: usize, hosts: &[String]) -> Vec<usize> {
    (0..hosts.len())
        .filter(|&r| r != rank && !hosts[rank].is_empty() && hosts[r] == hosts[rank])
        .collect()
}

fn shm_options(config: &Config) -> ShmOptions {
    ShmOptions {
        disabled: config.shm_disable,
        ..ShmOptions::default()
    }
}

/// A job of one rank with no rendezvous: its own coordinator, and a mesh of itself.
fn alone<P: ControlPlane>(
    config: &Config,
    bind_ip: Option<IpAddr>,
    secret: &[u8],
    plane: &mut P,
) -> Result<Met<P>> {
    let ip = bind_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let (listeners, at) = bind_node(ip)?;
    let coordinator = plane.start_node(
        listeners,
        secret,
        Some(&ControlTree::new(&[0], config.control_fanout)),
        0,
        None,
    )?;
    let data = TcpListener::bind((ip, 0))?;
    let mesh = Mesh {
        rank: 0,
        size: 1,
        listener: &data,
        addrs: &[data.local_addr()?],
        secret,
        timeout: config.start_timeout,
    };
    let transport = HybridTransport::connect(&mesh, &[], &shm_options(config))?;
    Ok(Met {
        transport,
        coordinator: Some(coordinator),
        coord_addr: at,
        node: 0,
        hosts: vec![config.hostname.clone()],
        cpus: vec![crate::cpus::format_list(&crate::cpus::allowed())],
        offers: None,
    })
}

/// Steps 3 and 4 through `store`, listening on `ip`, then the TCP mesh.
fn meet<P: ControlPlane>(
    config: &Config,
    membership: &Membership<'_>,
    store: &dyn Store,
    ip: IpAddr,
    secret: &[u8],
    plane: &mut P,
) -> Result<Met<P>> {
    let (rank, size) = (config.launch.rank, config.launch.size);
    let deadline = config.start_timeout;
    let process_sets = membership.process_sets;
    let data = TcpListener::bind((ip, 0))?;
    let key = |k: &str| format!("g{}/{k}", membership.generation);
    // Rank 0's coordinator starts, and says where it listens, before the host table is read
    // (the control tree comes from it): connections are authenticated at once and register
    // once the tree is known.
    let early = if rank == 0 {
        let (listeners, at) = bind_node(ip)?;
        let c = plane.start_node(listeners, secret, None, 0, None)?;
        store.set(&key("coordinator"), at.record().as_bytes())?;
        Some((c, at))
    } else {
        None
    };
    // Process sets are registered by position (ids 1, 2, ...) and added or removed in dynamic
    // mode by every rank alike: a rank that differs would get other ids or wait alone for a
    // change the others refuse.
    let settings = format!(
        "{} process_sets={process_sets:?} dynamic_process_sets={} control_fanout={}",
        config.tuning.shared_settings(),
        u8::from(config.dynamic_process_sets),
        config.control_fanout
    );
    // Every rank takes part in the fast path's records, unless its launcher says the ranks
    // span hosts or shared memory is off; rank 0 makes their one segment (a host that forbids
    // abstract Unix sockets lets it make none). They are used only when every rank turns out
    // to be on this host and every rank takes part: a rank that does not publishes an empty
    // field, rank 0 its segment's address, the others a mark, so all decide alike.
    let one_host = size > 1
        && !config.shm_disable
        && config.launch.local.map_or(true, |(_, ls, _, _)| ls == size);
    let exposed = (one_host && rank == 0)
        .then(|| Exposed::new(OfferRecords::segment_bytes(size)))
        .transpose()
        .map_err(|e| log::debug!(target: crate::LOG_TARGET, "rank {rank}: no offer records: {e}"))
        .ok()
        .flatten();
    let offer_field = match &exposed {
        Some(e) => auth::secret_to_hex(&e.address()),
        None if one_host && rank != 0 => auth::secret_to_hex(&[1]),
        None => String::new(),
    };
    let me = format!(
        "{}\n{}\n{}\n{}\n{settings}",
        data.local_addr()?,
        config.hostname,
        crate::cpus::format_list(&crate::cpus::allowed()),
        offer_field
    );
    store.set(&key(&format!("peer/{rank}")), me.as_bytes())?;
    // Rank 0 reads every rank's record and publishes them as one table, which every other
    // rank reads once: N + N store requests in all, where every rank reading every record
    // made N^2 (a million at 1024 ranks). Rank 0 also compares the settings, so every rank
    // fails alike, before any collective could hang on the difference.
    let table = if rank == 0 {
        let mut table = String::new();
        let mut disagree = String::new();
        for r in 0..size {
            let text = if r == 0 {
                me.clone()
            } else {
                String::from_utf8_lossy(&store.get(&key(&format!("peer/{r}")), deadline)?)
                    .into_owned()
            };
            let (record, theirs) = split_record(&text);
            if theirs != settings && disagree.is_empty() {
                disagree = format!("{r}\n{settings}\n{theirs}");
            }
            table.push_str(record);
            table.push('\n');
        }
        let table = format!("{disagree}\n\n{table}");
        store.set(&key("table"), table.as_bytes())?;
        table
    } else {
        String::from_utf8_lossy(&store.get(&key("table"), deadline)?).to_string()
    };
    let (verdict, records) = table.split_once("\n\n").unwrap_or((table.as_str(), ""));
    if !verdict.is_empty() {
        let mut v = verdict.splitn(3, '\n');
        let (r, first, theirs) = (v.next(), v.next(), v.next());
        return Err(Error::InvalidArgument(format!(
            "ranks disagree on settings every rank must share: rank 0 has `{}`, rank {} has \
             `{}`; set them the same everywhere (ferrovodrun passes its environment, and \
             `-x VAR=value`, to every rank; every rank must pass the same \
             init(process_sets=...))",
            first.unwrap_or_default(),
            r.unwrap_or_default(),
            theirs.unwrap_or_default()
        )));
    }
    let mut addrs = Vec::with_capacity(size);
    let mut hosts = Vec::with_capacity(size);
    let mut cpus = Vec::with_capacity(size);
    let mut offer_addrs = Vec::with_capacity(size);
    let mut lines = records.split('\n');
    for r in 0..size {
        let mut field = || lines.next().unwrap_or_default();
        let (a, h, c, o) = (field(), field(), field(), field());
        offer_addrs.push(
            auth::secret_from_hex(o).map_err(|_| {
                Error::Decode(format!("rank {r} published a bad offer address {o:?}"))
            })?,
        );
        cpus.push(c.to_string());
        addrs.push(
            a.parse::<SocketAddr>().map_err(|e| {
                Error::Decode(format!("rank {r} published a bad address {a:?}: {e}"))
            })?,
        );
        hosts.push(h.to_string());
    }
    // The control tree: every rank derives the same one from the same host table. A node
    // publishes where it listens before it reads its parent's address, so no rank waits on
    // one that waits on it.
    let tree = ControlTree::new(&host_indices(&hosts), config.control_fanout);
    let node_key = |r: usize| {
        key(&if r == 0 {
            "coordinator".to_string()
        } else {
            format!("node/{r}")
        })
    };
    // Only a rank on the node's host can reach its abstract socket; a rank whose host merely
    // has the same name falls back to TCP when connecting fails.
    let node_addr = |r: usize| -> Result<CoordinatorAddr> {
        let text = String::from_utf8_lossy(&store.get(&node_key(r), deadline)?).to_string();
        let (tcp, local) = text.split_once('\n').unwrap_or((text.as_str(), ""));
        Ok(CoordinatorAddr {
            tcp: tcp
                .parse::<SocketAddr>()
                .map_err(|e| Error::Decode(format!("bad address of rank {r}'s node: {e}")))?,
            local: (!local.is_empty() && !hosts[r].is_empty() && hosts[rank] == hosts[r])
                .then(|| local.to_string()),
        })
    };
    let coordinator = if let Some((c, at)) = early {
        plane.place(&c, &tree);
        Some((c, at))
    } else if tree.has_node(rank) {
        let (listeners, at) = bind_node(ip)?;
        store.set(&node_key(rank), at.record().as_bytes())?;
        let parent = tree.parent(rank).map(node_addr).transpose()?;
        let node = plane.start_node(listeners, secret, Some(&tree), rank, parent)?;
        Some((node, at))
    } else {
        None
    };
    let node = tree.control_node(rank);
    let (coordinator, at) = match coordinator {
        Some((c, at)) => (Some(c), at),
        None => (None, node_addr(node)?),
    };
    // Every link is made on first use, so a rank holds links to the few peers its algorithms
    // talk to; those to the ranks on this host move to shared memory as they are made.
    let mesh = Mesh {
        rank,
        size,
        listener: &data,
        addrs: &addrs,
        secret,
        timeout: deadline,
    };
    let transport =
        HybridTransport::connect(&mesh, &local_peers(rank, &hosts), &shm_options(config))?;
    Ok(Met {
        transport,
        coordinator,
        coord_addr: at,
        node,
        hosts,
        cpus,
        offers: offer_addrs
            .iter()
            .all(|a| !a.is_empty())
            .then(|| (exposed, offer_addrs.swap_remove(0))),
    })
}

/// A rank's rendezvous record split into its table part (address, host, CPUs, offer address:
/// four lines) and its settings (the rest).
fn split_record(text: &str) -> (&str, &str) {
    text.match_indices('\n')
        .nth(3)
        .map_or((text, ""), |(i, _)| (&text[..i], &text[i + 1..]))
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

/// The address to listen on when nothing says which: the first non-loopback IPv4 address the
/// host name resolves to, else loopback (a job on one host).
fn host_ip(hostname: &str) -> IpAddr {
    (hostname, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|a| a.is_ipv4() && !a.ip().is_loopback()))
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip())
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
pub fn iface_ip(name: &str, hostname: &str) -> Result<IpAddr> {
    let all = interfaces()?;
    if let Some(i) = all.iter().find(|i| i.name == name) {
        return Ok(IpAddr::V4(i.addr));
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
fn advertised_ip(rendezvous: &str) -> Result<IpAddr> {
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

/// A node's listeners (TCP on `ip`, and a local socket where the host allows one) and the
/// address they make.
fn bind_node(ip: IpAddr) -> Result<(CoordinatorListeners, CoordinatorAddr)> {
    let tcp = TcpListener::bind((ip, 0))?;
    let (local, name) = bind_local_control().unzip();
    let at = CoordinatorAddr {
        tcp: tcp.local_addr()?,
        local: name,
    };
    Ok((CoordinatorListeners { tcp, local }, at))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iface_names_resolve_or_fail_clearly() {
        let lo = interfaces()
            .unwrap()
            .into_iter()
            .find(|i| i.addr.is_loopback())
            .expect("a loopback interface");
        assert_eq!(iface_ip(&lo.name, "h").unwrap(), IpAddr::V4(lo.addr));
        let e = iface_ip("nosuch0", "hostA").unwrap_err().to_string();
        assert!(
            e.contains("nosuch0") && e.contains("hostA") && e.contains(&lo.name),
            "{e}"
        );
    }
}
