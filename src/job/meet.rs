//! Steps 3 and 4 of forming a job (see the module above): every rank publishes its record
//! and reads everyone's, the control tree's nodes start, and the TCP mesh is made; or, for a
//! job of one rank, all of that without a rendezvous.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};

use super::addr::bind_node;
use super::{ControlPlane, CoordinatorAddr, Membership};
use crate::bootstrap::auth;
use crate::bootstrap::topology::{host_indices, ControlTree};
use crate::bootstrap::Store;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::transport::host_memory::Exposed;
use crate::transport::hybrid::{HybridTransport, ShmOptions};
use crate::transport::offers::OfferRecords;
use crate::transport::tcp::Mesh;

/// What steps 3 and 4 leave.
pub(super) struct Met<P: ControlPlane> {
    /// The data links (made on first use).
    pub(super) transport: HybridTransport,
    /// This rank's node, if it runs one.
    pub(super) coordinator: Option<P::Coordinator>,
    /// Where this rank's node listens (its own, or its parent's).
    pub(super) coord_addr: CoordinatorAddr,
    /// That node's rank.
    pub(super) node: usize,
    /// Each rank's host name.
    pub(super) hosts: Vec<String>,
    /// The CPUs each rank may run on, as it published them (parsed for this host's ranks only).
    pub(super) cpus: Vec<String>,
    /// Where every rank of a one-host job takes part in the fast path's records: the segment
    /// rank 0 made (on rank 0) and its address.
    pub(super) offers: Option<(Option<Exposed>, Vec<u8>)>,
}

/// The peers that published this rank's host name: their links move to shared memory. Every
/// rank derives the lists from the same host table, so they are symmetric, as the handshake
/// needs; a pair that cannot share memory (same name, different machines or network
/// namespaces) stays on TCP.
pub(super) fn local_peers(rank: usize, hosts: &[String]) -> Vec<usize> {
    (0..hosts.len())
        .filter(|&r| r != rank && !hosts[rank].is_empty() && hosts[r] == hosts[rank])
        .collect()
}

pub(super) fn shm_options(config: &Config) -> ShmOptions {
    ShmOptions {
        disabled: config.shm_disable,
        ..ShmOptions::default()
    }
}

/// A job of one rank with no rendezvous: its own coordinator, and a mesh of itself.
pub(super) fn alone<P: ControlPlane>(
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
pub(super) fn meet<P: ControlPlane>(
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
pub(super) fn split_record(text: &str) -> (&str, &str) {
    text.match_indices('\n')
        .nth(3)
        .map_or((text, ""), |(i, _)| (&text[..i], &text[i + 1..]))
}
