use super::setup::{Offer, CONTROL_OFFER_LEN, KEY_LEN, OFFER_LEN};
use super::*;
use crate::sys::{poll, poll_fd, POLL_IN};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A linked pair (rank 0, rank 1) over a real loopback TCP connection.
fn pair(ring: usize) -> (ShmLink, ShmLink) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = Duration::from_secs(10);
    let deadline = Instant::now() + t;
    let hi = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        ShmLink::establish(&mut s, 1, 0, Some(ring), deadline, t).unwrap()
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let lo = ShmLink::establish(&mut s, 0, 1, Some(ring), deadline, t).unwrap();
    (lo.unwrap(), hi.join().unwrap().unwrap())
}

#[test]
fn offer_round_trip_and_rejections() {
    let o = Offer {
        willing: true,
        ring_bytes: 4096,
        listening: true,
        name: [7; 16],
        key: [9; KEY_LEN],
    };
    let b = o.encode();
    assert_eq!(b.len(), OFFER_LEN);
    let d = Offer::decode(&b).unwrap();
    assert!(d.willing && d.listening && d.ring_bytes == 4096);
    assert_eq!((d.name, d.key), ([7; 16], [9; KEY_LEN]));
    let mut bad = b.clone();
    bad[0] ^= 1;
    assert!(matches!(Offer::decode(&bad), Err(Error::Decode(_))));
    let huge = Offer {
        ring_bytes: MAX_RING_BYTES + 1,
        ..o
    };
    assert!(matches!(
        Offer::decode(&huge.encode()),
        Err(Error::Decode(_))
    ));
    assert!(Offer::decode(&b[..OFFER_LEN - 1]).is_err());
}

#[test]
fn bytes_wrap_around_and_full_ring_stops_the_producer() {
    let (mut a, mut b) = pair(100);
    let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
    let mut got = vec![0u8; 1000];
    let (mut so, mut ro) = (0, 0);
    let mut rounds = 0;
    while ro < data.len() {
        let mut s = Xfer::Send {
            peer: 1,
            buf: &data,
        };
        a.progress(&mut s, &mut so).unwrap();
        // The ring holds exactly 100 bytes until the consumer frees some.
        assert_eq!(so - ro, 100.min(data.len() - ro));
        let mut r = Xfer::Recv {
            peer: 0,
            buf: &mut got[..(ro + 37).min(1000)],
        };
        b.progress(&mut r, &mut ro).unwrap();
        rounds += 1;
    }
    assert_eq!(got, data);
    assert!(rounds > 20);
}

#[test]
fn corrupt_indices_are_errors_not_accesses() {
    let (mut a, mut b) = pair(64);
    // The "peer" claims to have published more than a ring's worth.
    b.at(off_tail(1)).store(1 << 40, Ordering::Release);
    let mut buf = [0u8; 8];
    let mut off = 0;
    let res = a.progress(
        &mut Xfer::Recv {
            peer: 1,
            buf: &mut buf,
        },
        &mut off,
    );
    assert!(
        matches!(res, Err(Error::PeerLost { rank: 1, .. })),
        "{res:?}"
    );
    // And a head beyond what was ever sent.
    a.at(off_head(1)).store(1000, Ordering::Release);
    // (Checked when the producer next needs space: after filling the ring.)
    let mut off = 0;
    let mut x = Xfer::Send {
        peer: 0,
        buf: &[1; 200],
    };
    assert!(b.progress(&mut x, &mut off).unwrap());
    let res = b.progress(&mut x, &mut off);
    assert!(
        matches!(res, Err(Error::PeerLost { rank: 0, .. })),
        "{res:?}"
    );
}

#[test]
fn closed_peer_fails_sends_at_once_and_receives_after_the_last_byte() {
    let (mut a, mut b) = pair(64);
    let mut off = 0;
    a.progress(
        &mut Xfer::Send {
            peer: 1,
            buf: b"last words",
        },
        &mut off,
    )
    .unwrap();
    drop(a);
    let mut got = [0u8; 10];
    let mut off = 0;
    let mut x = Xfer::Recv {
        peer: 0,
        buf: &mut got,
    };
    assert!(b.progress(&mut x, &mut off).unwrap());
    assert_eq!(&got, b"last words");
    let mut more = [0u8; 1];
    let mut off = 0;
    let mut x = Xfer::Recv {
        peer: 0,
        buf: &mut more,
    };
    assert!(matches!(
        b.progress(&mut x, &mut off),
        Err(Error::PeerLost { rank: 0, .. })
    ));
    let mut off = 0;
    let res = b.progress(&mut Xfer::Send { peer: 0, buf: &[1] }, &mut off);
    assert!(matches!(res, Err(Error::PeerLost { rank: 0, .. })));
    assert!(b.ready(true) && b.ready(false));
}

fn control_pair(ring: usize) -> (ShmLink, ShmLink) {
    let (mut c, mut s) = UnixStream::pair().unwrap();
    let t = Duration::from_secs(10);
    let coordinator =
        std::thread::spawn(move || ShmLink::accept_control(&mut s, 3, t).unwrap().unwrap());
    let client = ShmLink::offer_control(&mut c, Some(ring), t)
        .unwrap()
        .unwrap();
    (client, coordinator.join().unwrap())
}

#[test]
fn control_rings_stream_both_ways_and_ring_only_for_an_armed_sleeper() {
    let (mut client, mut coord) = control_pair(4096);
    // More than a ring's worth each way, interleaved as the two threads would.
    let up: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let down: Vec<u8> = (0..9_000u32).map(|i| (i * 13 % 241) as u8).collect();
    let (mut got_up, mut got_down) = (Vec::new(), Vec::new());
    let (mut sent_up, mut sent_down) = (0, 0);
    let mut buf = [0u8; 1000];
    while got_up.len() < up.len() || got_down.len() < down.len() {
        sent_up += client.write_some(&up[sent_up..]).unwrap();
        sent_down += coord.write_some(&down[sent_down..]).unwrap();
        let n = coord.read_some(&mut buf).unwrap();
        got_up.extend_from_slice(&buf[..n]);
        let n = client.read_some(&mut buf).unwrap();
        got_down.extend_from_slice(&buf[..n]);
    }
    assert_eq!((got_up, got_down), (up, down));
    let quiet = |l: &ShmLink| {
        let mut fds = [poll_fd(l.doorbell(), POLL_IN)];
        poll(&mut fds, Some(Duration::ZERO)).unwrap();
        fds[0].revents == 0
    };
    // Not armed: a write rings nothing.
    client.write_some(b"x").unwrap();
    assert!(quiet(&coord) && coord.readable());
    assert_eq!(coord.read_some(&mut buf).unwrap(), 1);
    // Armed: the next write rings once, and the ring is cleared by the writer.
    coord.arm();
    assert!(!coord.readable());
    client.write_some(b"yz").unwrap();
    let mut fds = [poll_fd(coord.doorbell(), POLL_IN)];
    poll(&mut fds, Some(Duration::from_secs(5))).unwrap();
    assert_ne!(fds[0].revents, 0);
    coord.drain_doorbell(fds[0].revents);
    coord.disarm();
    assert!(quiet(&coord));
    assert_eq!(coord.read_some(&mut buf).unwrap(), 2);
}

#[test]
fn control_ring_hands_over_the_last_words_before_the_closure() {
    let (mut client, mut coord) = control_pair(4096);
    client.write_some(b"leave").unwrap();
    drop(client);
    // A buffer larger than what is there: the bytes come first, the closure after.
    let mut buf = [0u8; 64];
    assert_eq!(coord.read_some(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"leave");
    assert!(matches!(
        coord.read_some(&mut buf),
        Err(Error::PeerLost { rank: 3, .. })
    ));
    assert!(coord.write_some(b"late").is_err());
}

#[test]
fn control_offer_declined_or_malformed() {
    let t = Duration::from_secs(10);
    let (mut c, mut s) = UnixStream::pair().unwrap();
    let coordinator = std::thread::spawn(move || {
        let link = ShmLink::accept_control(&mut s, 1, t).unwrap();
        (link.is_none(), s)
    });
    assert!(ShmLink::offer_control(&mut c, None, t).unwrap().is_none());
    let (declined, mut s) = coordinator.join().unwrap();
    assert!(declined);
    // The socket is still a plain byte stream for both.
    c.write_all(b"plain").unwrap();
    let mut got = [0u8; 5];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"plain");

    let (mut c, mut s) = UnixStream::pair().unwrap();
    c.write_all(&[0xAB; CONTROL_OFFER_LEN]).unwrap();
    let res = ShmLink::accept_control(&mut s, 2, t);
    assert!(matches!(res, Err(Error::Decode(m)) if m.contains("rank 2")));
}
