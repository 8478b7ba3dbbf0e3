//! Loopback meshes for the integration tests: transports made as a job makes them, every rank
//! a thread of one process on 127.0.0.1, index = rank. Not part of the library's surface
//! (hidden from its documentation), and kept here so that no production module carries a
//! hook for its tests.

use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::Duration;

use crate::error::Result;
use crate::transport::hybrid::{HybridTransport, ShmOptions};
use crate::transport::tcp::{Mesh, TcpTransport};
use crate::transport::{Transport, Xfer};

/// How long a loopback mesh waits for a peer.
const LOOPBACK_TIMEOUT: Duration = Duration::from_secs(60);

/// `n` ranks' data listeners on 127.0.0.1 (each on a port of its own choosing), and their
/// addresses, in rank order.
pub fn loopback_listeners(n: usize) -> std::io::Result<(Vec<TcpListener>, Vec<SocketAddr>)> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    let addrs = listeners
        .iter()
        .map(TcpListener::local_addr)
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok((listeners, addrs))
}

/// `connect(mesh)` for each of `n` ranks on a thread of its own, every rank's [`Mesh`] with its
/// own listener on 127.0.0.1; the transports in rank order.
fn on_every_rank<T: Send>(
    n: usize,
    secret: &[u8],
    connect: impl Fn(&Mesh<'_>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let (listeners, addrs) = loopback_listeners(n)?;
    thread::scope(|scope| {
        let handles: Vec<_> = listeners
            .iter()
            .enumerate()
            .map(|(rank, listener)| {
                let (addrs, connect) = (&addrs, &connect);
                scope.spawn(move || {
                    connect(&Mesh {
                        rank,
                        size: n,
                        listener,
                        addrs,
                        secret,
                        timeout: LOOPBACK_TIMEOUT,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("mesh thread panicked"))
            .collect()
    })
}

/// `n` TCP transports, every pair linked ([`TcpTransport::connect_mesh`]).
pub fn tcp_mesh(n: usize, secret: &[u8]) -> Result<Vec<TcpTransport>> {
    on_every_rank(n, secret, TcpTransport::connect_mesh)
}

/// `hosts.len()` hybrid transports made as a job's are ([`HybridTransport::connect`]: no link
/// yet; ranks with equal `hosts` entries move to shared memory, with rank r's `options(r)`,
/// as their links are made).
pub fn hybrid_unlinked(
    hosts: &[usize],
    options: &(dyn Fn(usize) -> ShmOptions + Sync),
    secret: &[u8],
) -> Result<Vec<HybridTransport>> {
    let n = hosts.len();
    on_every_rank(n, secret, |mesh| {
        let rank = mesh.rank;
        let local: Vec<usize> = (0..n)
            .filter(|&p| p != rank && hosts[p] == hosts[rank])
            .collect();
        HybridTransport::connect(mesh, &local, &options(rank))
    })
}

/// [`hybrid_unlinked`] with rings of `ring_bytes` on every rank, then every pair linked by
/// one exchange of a byte.
pub fn hybrid_mesh(
    hosts: &[usize],
    ring_bytes: usize,
    secret: &[u8],
) -> Result<Vec<HybridTransport>> {
    let options = ShmOptions {
        ring_bytes,
        disabled: false,
    };
    let mut ts = hybrid_unlinked(hosts, &|_| options.clone(), secret)?;
    let n = hosts.len();
    thread::scope(|scope| {
        let handles: Vec<_> = ts
            .iter_mut()
            .map(|t| {
                scope.spawn(move || {
                    let ones = vec![1u8; n];
                    let mut got = vec![0u8; n];
                    let mut xfers: Vec<Xfer<'_>> = Vec::with_capacity(2 * n);
                    for (p, (s, r)) in ones.chunks(1).zip(got.chunks_mut(1)).enumerate() {
                        xfers.push(Xfer::Send { peer: p, buf: s });
                        xfers.push(Xfer::Recv { peer: p, buf: r });
                    }
                    t.exchange(&mut xfers, LOOPBACK_TIMEOUT)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("mesh thread panicked"))
            .collect::<Result<Vec<()>>>()
    })?;
    Ok(ts)
}
