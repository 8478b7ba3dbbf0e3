//! Where a rank listens and how others reach it: the address to bind and to advertise, the
//! interface a user named, the rendezvous store rank 0 serves, and a control node's
//! listeners.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};

use super::{CoordinatorAddr, CoordinatorListeners};
use crate::bootstrap::tcp_store::TcpStoreServer;
use crate::error::{Error, Result};
use crate::sys::interfaces;

/// The address to listen on when nothing says which: the first non-loopback IPv4 address the
/// host name resolves to, else loopback (a job on one host).
pub(super) fn host_ip(hostname: &str) -> IpAddr {
    (hostname, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|a| a.is_ipv4() && !a.ip().is_loopback()))
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip())
}

/// Starts the rendezvous store on rank 0 at the port of `addr`, on every interface (other
/// ranks reach it through whatever `addr`'s host name resolves to on their side): on
/// `listener` when the process already holds that port (the rendezvous answer that handed the
/// port out kept it), else bound now.
pub(super) fn host_store(
    addr: &str,
    secret: &[u8],
    listener: Option<&TcpListener>,
) -> Result<TcpStoreServer> {
    let port = addr
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("rendezvous address {addr:?} has no port"))
        })?;
    if let Some(l) = listener.filter(|l| l.local_addr().is_ok_and(|a| a.port() == port)) {
        return TcpStoreServer::serve(l.try_clone()?, secret.to_vec());
    }
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
pub(super) fn advertised_ip(rendezvous: &str) -> Result<IpAddr> {
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
pub(super) fn bind_node(ip: IpAddr) -> Result<(CoordinatorListeners, CoordinatorAddr)> {
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
pub(super) fn bind_local_control() -> Option<(UnixListener, String)> {
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

    #[test]
    fn the_store_serves_on_the_listener_that_holds_its_port() {
        // Held here all along: a store that bound the port itself would fail.
        let held = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let server = host_store(&format!("127.0.0.1:{port}"), b"k", Some(&held)).unwrap();
        assert_eq!(server.local_addr().port(), port);
        let store = crate::bootstrap::tcp_store::TcpStore::connect(
            format!("127.0.0.1:{port}"),
            b"k",
            std::time::Duration::from_secs(10),
        )
        .unwrap();
        crate::bootstrap::Store::set(&store, "a", b"1").unwrap();
        assert_eq!(
            crate::bootstrap::Store::get(&store, "a", std::time::Duration::from_secs(10)).unwrap(),
            b"1"
        );
    }
}
