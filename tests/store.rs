//! Rendezvous store over real 127.0.0.1 sockets: set/get/add from many threads, waiting and
//! timing out, authentication, hostile input and shutdown.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use _core::bootstrap::tcp_store::{TcpStore, TcpStoreServer};
use _core::bootstrap::Store;
use _core::error::Error;

const SECRET: &[u8] = b"store-test-secret";
const LONG: Duration = Duration::from_secs(20);
/// Half of LONG: a wait that ends by itself (an answer, a refusal, its own short timeout)
/// ends well before it, however loaded the machine; one that waited for LONG does not.
const PROMPT: Duration = Duration::from_secs(10);

fn server() -> TcpStoreServer {
    TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), SECRET.to_vec()).unwrap()
}

fn client(s: &TcpStoreServer) -> TcpStore {
    TcpStore::connect(s.local_addr(), SECRET, LONG).unwrap()
}

#[test]
fn store_is_shareable_between_threads() {
    fn check<T: Send + Sync>() {}
    check::<TcpStore>();
}

#[test]
fn set_get_round_trip() {
    let s = server();
    let c = TcpStore::connect(s.local_addr().to_string().as_str(), SECRET, LONG).unwrap();
    let big: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 31 % 251) as u8).collect();
    c.set("empty", b"").unwrap();
    c.set("big", &big).unwrap();
    c.set("k", b"first").unwrap();
    c.set("k", b"second").unwrap();
    assert_eq!(c.get("empty", LONG).unwrap(), b"");
    assert_eq!(c.get("big", LONG).unwrap(), big);
    assert_eq!(c.get("k", LONG).unwrap(), b"second");
    // A second client sees the same data.
    assert_eq!(client(&s).get("k", LONG).unwrap(), b"second");
}

#[test]
fn add_is_atomic_across_threads_and_clients() {
    let s = server();
    let shared = Arc::new(client(&s));
    let seen: Vec<i64> = thread::scope(|sc| {
        let hs: Vec<_> = (0..6)
            .map(|t| {
                let shared = shared.clone();
                let s = &s;
                sc.spawn(move || {
                    // Half the threads share one client, the others have their own.
                    let own;
                    let c: &TcpStore = if t % 2 == 0 {
                        &shared
                    } else {
                        own = client(s);
                        &own
                    };
                    (0..50)
                        .map(|_| c.add("counter", 1).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    // Every increment returned a distinct value and none was lost.
    let distinct: BTreeSet<i64> = seen.iter().copied().collect();
    assert_eq!(distinct, (1..=300).collect::<BTreeSet<i64>>());
    assert_eq!(shared.add("counter", -10).unwrap(), 290);
    assert_eq!(shared.add("counter", 0).unwrap(), 290);
    assert_eq!(shared.get("counter", LONG).unwrap(), b"290");
    assert_eq!(shared.add("fresh", -4).unwrap(), -4);
    shared.set("text", b"not a number").unwrap();
    assert!(matches!(
        shared.add("text", 1),
        Err(Error::InvalidArgument(_))
    ));
    shared.set("max", i64::MAX.to_string().as_bytes()).unwrap();
    assert!(matches!(
        shared.add("max", 1),
        Err(Error::InvalidArgument(_))
    ));
    // The store still serves after refusing those.
    assert_eq!(shared.add("counter", 1).unwrap(), 291);
}

#[test]
fn get_waits_for_a_later_set_from_another_thread() {
    let s = server();
    let c = Arc::new(client(&s));
    let c2 = c.clone();
    let start = Instant::now();
    let waiter = thread::spawn(move || (c2.get("late", LONG), start.elapsed()));
    thread::sleep(Duration::from_millis(200));
    // Same client object: the waiting get must not block this set.
    c.set("late", b"here").unwrap();
    let (v, dt) = waiter.join().unwrap();
    assert_eq!(v.unwrap(), b"here");
    assert!(dt >= Duration::from_millis(200) && dt < PROMPT, "{dt:?}");
}

#[test]
fn many_waiters_are_all_released() {
    let s = server();
    let c = Arc::new(client(&s));
    let hs: Vec<_> = (0..8)
        .map(|i| {
            let c = c.clone();
            thread::spawn(move || c.get(&format!("k{}", i % 3), LONG))
        })
        .collect();
    thread::sleep(Duration::from_millis(100));
    for i in 0..3 {
        c.set(&format!("k{i}"), format!("v{i}").as_bytes()).unwrap();
    }
    for (i, h) in hs.into_iter().enumerate() {
        assert_eq!(h.join().unwrap().unwrap(), format!("v{}", i % 3).as_bytes());
    }
}

#[test]
fn get_times_out() {
    let s = server();
    let c = client(&s);
    let t = Duration::from_millis(300);
    let start = Instant::now();
    let res = c.get("never", t);
    let dt = start.elapsed();
    match res {
        Err(Error::Timeout { what, after }) => {
            assert!(what.contains("never"), "{what}");
            assert_eq!(after, t);
        }
        other => panic!("{other:?}"),
    }
    assert!(dt >= t && dt < PROMPT, "{dt:?}");
    // The connection that timed out is still usable.
    c.set("never", b"now").unwrap();
    assert_eq!(c.get("never", Duration::ZERO).unwrap(), b"now");
}

#[test]
fn wrong_secret_is_rejected() {
    let s = server();
    let start = Instant::now();
    let res = TcpStore::connect(s.local_addr(), b"wrong", LONG);
    assert!(matches!(res, Err(Error::Auth(_))), "{res:?}");
    assert!(start.elapsed() < PROMPT, "{:?}", start.elapsed());
    // A client with the right secret is unaffected.
    client(&s).set("a", b"b").unwrap();
}

#[test]
fn unauthenticated_requests_are_never_read() {
    let s = server();
    let mut raw = TcpStream::connect(s.local_addr()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    // A well-formed SET frame for key "x", sent without the handshake.
    let mut body = vec![1u8];
    body.extend_from_slice(&1u32.to_le_bytes());
    body.push(b'x');
    body.extend_from_slice(&1u32.to_le_bytes());
    body.push(b'y');
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame.resize(64, 0);
    raw.write_all(&frame).unwrap();
    // The server answers with its greeting and then drops us; it never replies OK.
    let mut got = Vec::new();
    let _ = raw.read_to_end(&mut got);
    assert!(got.len() <= 36, "server sent {} bytes", got.len());
    let c = client(&s);
    assert!(matches!(
        c.get("x", Duration::from_millis(50)),
        Err(Error::Timeout { .. })
    ));
}

#[test]
fn garbage_does_not_kill_the_server() {
    let s = server();
    let c = client(&s);
    c.set("before", b"1").unwrap();
    let mut keep = Vec::new();
    for junk in [
        vec![],
        vec![0xff; 4],
        vec![0xAB; 10_000],
        b"FVA1".to_vec(),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
    ] {
        let mut raw = TcpStream::connect(s.local_addr()).unwrap();
        let _ = raw.write_all(&junk);
        keep.push(raw);
    }
    // Half of them hang up at once; the rest stay open and silent.
    keep.truncate(2);
    let c2 = client(&s);
    assert_eq!(c2.get("before", LONG).unwrap(), b"1");
    c2.set("after", b"2").unwrap();
    assert_eq!(c.get("after", LONG).unwrap(), b"2");
}

#[test]
fn client_waits_for_a_late_server() {
    // A free port below the kernel's ephemeral range: a port from bind(0), once released,
    // can be taken by another test of this binary running beside this one before the server
    // binds it, and the client then talks to a stranger.
    let addr = free_port_below_ephemeral_range();
    let h = thread::spawn(move || TcpStore::connect(addr, SECRET, LONG));
    thread::sleep(Duration::from_millis(300));
    let s = TcpStoreServer::start(addr, SECRET.to_vec()).unwrap();
    let c = h.join().unwrap().unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(client(&s).get("k", LONG).unwrap(), b"v");
}

fn free_port_below_ephemeral_range() -> SocketAddr {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let seed = std::process::id() as u16;
    (0..2000u16)
        .map(|i| {
            10000 + (seed.wrapping_add(i.wrapping_mul(7919))) % (low.saturating_sub(10000)).max(1)
        })
        .find_map(|p| TcpListener::bind(("127.0.0.1", p)).ok()?.local_addr().ok())
        .expect("a free port below the ephemeral range")
}

#[test]
fn connect_times_out_without_a_server() {
    let addr = free_port_below_ephemeral_range();
    let start = Instant::now();
    let res = TcpStore::connect(addr, SECRET, Duration::from_millis(300));
    assert!(matches!(res, Err(Error::Timeout { .. })), "{res:?}");
    assert!(start.elapsed() < PROMPT, "{:?}", start.elapsed());
}

#[test]
fn shutdown_is_prompt_and_releases_waiters() {
    let mut s = server();
    let addr = s.local_addr();
    let c = Arc::new(client(&s));
    let c2 = c.clone();
    let waiter = thread::spawn(move || c2.get("never", LONG));
    // An unauthenticated connection is mid-handshake when the server stops.
    let _silent = TcpStream::connect(addr).unwrap();
    thread::sleep(Duration::from_millis(150));
    let start = Instant::now();
    s.shutdown();
    // Half the server's 10 s handshake timeout: a shutdown that waited for the silent
    // connection's handshake would take it all.
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "{took:?}");
    let res = waiter.join().unwrap();
    assert!(
        matches!(res, Err(Error::Shutdown(_)) | Err(Error::Io(_))),
        "{res:?}"
    );
    // The listener is closed: nobody can connect any more.
    let res = TcpStore::connect(addr, SECRET, Duration::from_millis(200));
    assert!(matches!(res, Err(Error::Timeout { .. })), "{res:?}");
    s.shutdown(); // idempotent
    drop(s);
}
