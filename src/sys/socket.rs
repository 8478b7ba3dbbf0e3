//! Sockets beyond what std wraps: descriptor passing over Unix sockets (`SCM_RIGHTS`), sends
//! that neither block nor raise SIGPIPE, keepalive options that bound how long an unreachable
//! peer goes unnoticed, and this host's IPv4 interfaces.

use std::ffi::CStr;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::error::{Error, Result};

/// Sends `payload` with one descriptor attached (SCM_RIGHTS).
pub fn send_with_fd(sock: &UnixStream, payload: &[u8], fd: &OwnedFd) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    // u64 storage keeps the control buffer aligned for cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) };
    assert!(space as usize <= std::mem::size_of_val(&control));
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as usize;
    // SAFETY: `msg` points at `control`, large enough for one header with one int (checked
    // above), so CMSG_FIRSTHDR is non-null and CMSG_DATA is inside `control`; the data is
    // written unaligned-safe. sendmsg only reads `payload` (through `iov`) and `control`,
    // both alive for the call.
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
        libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != payload.len() {
        return Err(io::Error::other("short sendmsg"));
    }
    Ok(())
}

/// Receives one message without waiting: (bytes, the first descriptor attached). Any
/// other descriptors are closed. `WouldBlock` when nothing is queued.
pub fn recv_with_fd(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 16];
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    let flags = libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC;
    // SAFETY: `iov` describes `buf`, exclusively borrowed, and `msg_control` describes
    // `control`; the kernel writes within those lengths only.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut first = None;
    // SAFETY: walks the control messages the kernel wrote into `control` with the CMSG_*
    // macros, which stay within `msg_controllen`; each SCM_RIGHTS payload holds
    // `(cmsg_len - CMSG_LEN(0)) / sizeof(int)` descriptors now owned by this process, each
    // read unaligned and wrapped exactly once (so every one is closed unless kept).
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let bytes = (*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if first.is_none() {
                        first = Some(fd);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, first))
}

/// Writes `bytes` without blocking and without SIGPIPE if the peer is gone.
pub fn send_nosignal(sock: &UnixStream, bytes: &[u8]) -> io::Result<usize> {
    // SAFETY: send only reads `bytes`, alive for the call.
    let n = unsafe {
        libc::send(
            sock.as_raw_fd(),
            bytes.as_ptr().cast(),
            bytes.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Makes a connection fail within about `timeout` when the peer's host becomes unreachable
/// (a cut link, a vanished machine) even while nothing is being sent: TCP keepalive probes
/// every second, and TCP_USER_TIMEOUT bounding how long sent data or probes may stay
/// unacknowledged. A dead *process* is noticed at once anyway (its kernel closes the socket).
pub fn detect_unreachable_peer(fd: RawFd, timeout: Duration) -> Result<()> {
    let secs = timeout.as_secs().clamp(1, i32::MAX as u64) as libc::c_int;
    let ms = timeout.as_millis().clamp(1000, u32::MAX as u128) as libc::c_uint;
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| -> Result<()> {
        // SAFETY: passes a pointer to a live local c_int and its exact size; setsockopt only
        // reads it. An invalid fd or option is reported through the return value.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::Io(format!(
                "setsockopt: {}",
                std::io::Error::last_os_error()
            )))
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, secs)?;
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, ms as libc::c_int)
}

/// Takes over `fd`, a listening TCP socket another part of this process opened and handed
/// over (Python's rendezvous answer keeps the port it hands out bound, and listening, until
/// the engine serves on it: a port closed and bound again later could be taken meanwhile).
/// Errors, leaving `fd` alone, unless it is an open, listening stream socket.
#[cfg(feature = "python")]
pub fn tcp_listener_from_fd(fd: RawFd) -> Result<std::net::TcpListener> {
    let int_option = |name: libc::c_int| -> Option<libc::c_int> {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: passes a live local c_int and its exact size, which getsockopt writes
        // within; a closed or non-socket fd is reported through the return value.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                name,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (rc == 0).then_some(value)
    };
    let listening = int_option(libc::SO_ACCEPTCONN) == Some(1)
        && int_option(libc::SO_TYPE) == Some(libc::SOCK_STREAM);
    if fd < 0 || !listening {
        return Err(Error::InvalidArgument(format!(
            "descriptor {fd} is not a listening TCP socket"
        )));
    }
    // SAFETY: `fd` is an open socket (getsockopt succeeded on it) whose ownership the caller
    // hands over (Python detached it from its socket object), so it gets exactly one owner.
    Ok(unsafe { std::net::TcpListener::from_raw_fd(fd) })
}

/// One IPv4 address of a network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Interface name (`lo`, `eth0`, ...).
    pub name: String,
    /// The address.
    pub addr: Ipv4Addr,
    /// Netmask length in bits.
    pub prefix: u8,
}

/// This host's IPv4 interface addresses, in the kernel's order (an interface with several
/// addresses appears once per address; interfaces without an IPv4 address do not appear).
pub fn interfaces() -> Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs only writes the head of a list it allocates into `head`, a valid
    // local; failure is reported through the return value and then leaves nothing to free.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::Io(format!(
            "getifaddrs: {}",
            std::io::Error::last_os_error()
        )));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a non-null node of the list getifaddrs returned, which stays alive
        // and unmodified until freeifaddrs below. Its name is a NUL-terminated string; its
        // address and netmask pointers are checked for null, and for AF_INET the kernel stores
        // a sockaddr_in behind both, read unaligned as a copy (nothing keeps a reference).
        let (next, found) = unsafe {
            let ifa = &*cur;
            let mut found = None;
            if !ifa.ifa_addr.is_null() && i32::from((*ifa.ifa_addr).sa_family) == libc::AF_INET {
                let sin = std::ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_in>());
                let mask = if ifa.ifa_netmask.is_null() {
                    u32::MAX
                } else {
                    let m = std::ptr::read_unaligned(ifa.ifa_netmask.cast::<libc::sockaddr_in>());
                    u32::from_be(m.sin_addr.s_addr)
                };
                found = Some(Interface {
                    name: CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned(),
                    addr: Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                    prefix: mask.count_ones() as u8,
                });
            }
            (ifa.ifa_next, found)
        };
        out.extend(found);
        cur = next;
    }
    // SAFETY: `head` came from a successful getifaddrs, is freed exactly once, and no pointer
    // into the list is used after this.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_listed_with_its_prefix() {
        let all = interfaces().unwrap();
        let lo = all
            .iter()
            .find(|i| i.addr == Ipv4Addr::LOCALHOST)
            .unwrap_or_else(|| panic!("no 127.0.0.1 in {all:?}"));
        assert_eq!(lo.prefix, 8, "{all:?}");
        assert!(!lo.name.is_empty());
        assert!(
            all.iter().all(|i| i.prefix <= 32 && !i.name.is_empty()),
            "{all:?}"
        );
    }

    #[test]
    #[cfg(feature = "python")]
    fn only_a_listening_tcp_socket_is_taken_over() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let taken = tcp_listener_from_fd(std::os::fd::IntoRawFd::into_raw_fd(l)).unwrap();
        assert_eq!(taken.local_addr().unwrap(), at);
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let connected = std::net::TcpStream::connect(at).unwrap();
        for fd in [udp.as_raw_fd(), connected.as_raw_fd(), -1] {
            let e = tcp_listener_from_fd(fd).unwrap_err().to_string();
            assert!(e.contains("not a listening TCP socket"), "{e}");
        }
    }
}
