//! TCP transport over real 127.0.0.1 sockets, ranks as threads: mesh set-up (late peers,
//! strangers, wrong secrets), links made on first use (two ranks dialling each other at once,
//! a gone peer), ring and all-pairs exchanges with content checks, peer loss, abort and idle
//! timeouts.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use _core::bootstrap::auth::authenticate;
use _core::error::Error;
use _core::transport::tcp::{Mesh, TcpTransport};
use _core::transport::{Transport, Xfer};

const SECRET: &[u8] = b"transport-test-secret";
const LONG: Duration = Duration::from_secs(30);

/// Deterministic bytes that differ with `seed` and position (an independent reference).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn seed(from: usize, to: usize, len: usize) -> u64 {
    (from as u64) << 40 | (to as u64) << 32 | len as u64
}

/// Runs `f` on every transport in its own thread; results in rank order.
fn run<R: Send>(ts: &mut [TcpTransport], f: impl Fn(&mut TcpTransport) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = ts.iter_mut().map(|t| s.spawn(|| f(t))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn ring_step(t: &mut TcpTransport, len: usize) -> Vec<u8> {
    let (r, n) = (t.rank(), t.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let send = pattern(seed(r, next, len), len);
    let mut recv = vec![0u8; len];
    t.exchange(
        &mut [
            Xfer::Send {
                peer: next,
                buf: &send,
            },
            Xfer::Recv {
                peer: prev,
                buf: &mut recv,
            },
        ],
        LONG,
    )
    .unwrap();
    recv
}

#[test]
fn ring_small_sizes_on_1_to_5_ranks() {
    for n in 1..=5 {
        let mut ts = _core::testing::tcp_mesh(n, SECRET).unwrap();
        for (r, t) in ts.iter().enumerate() {
            assert_eq!((t.rank(), t.size()), (r, n));
        }
        for len in [0usize, 1, 7, 4099] {
            let got = run(&mut ts, |t| ring_step(t, len));
            for (r, g) in got.iter().enumerate() {
                let prev = (r + n - 1) % n;
                assert_eq!(
                    *g,
                    pattern(seed(prev, r, len), len),
                    "n={n} len={len} rank={r}"
                );
            }
        }
    }
}

#[test]
fn ring_64_mib_with_throughput() {
    const LEN: usize = 64 << 20;
    for n in [2usize, 3] {
        let mut ts = _core::testing::tcp_mesh(n, SECRET).unwrap();
        let sends: Vec<Vec<u8>> = (0..n)
            .map(|r| pattern(seed(r, (r + 1) % n, LEN), LEN))
            .collect();
        let barrier = Barrier::new(n);
        let times = run(&mut ts, |t| {
            let (r, n) = (t.rank(), t.size());
            let mut recv = vec![0u8; LEN];
            barrier.wait();
            let start = Instant::now();
            t.exchange(
                &mut [
                    Xfer::Send {
                        peer: (r + 1) % n,
                        buf: &sends[r],
                    },
                    Xfer::Recv {
                        peer: (r + n - 1) % n,
                        buf: &mut recv,
                    },
                ],
                LONG,
            )
            .unwrap();
            let dt = start.elapsed();
            assert!(
                recv == sends[(r + n - 1) % n],
                "rank {r} received wrong bytes"
            );
            dt
        });
        let worst = times.iter().max().unwrap().as_secs_f64();
        eprintln!(
            "tcp ring {n} ranks, 64 MiB per rank: {:.1} ms, {:.2} GB/s per rank",
            worst * 1e3,
            LEN as f64 / worst / 1e9
        );
    }
}

#[test]
fn all_pairs_exchange() {
    let n = 4;
    let mut ts = _core::testing::tcp_mesh(n, SECRET).unwrap();
    for len in [1usize, 1000, 300_001] {
        let ok = run(&mut ts, |t| all_pairs(t, len));
        assert!(ok.iter().all(|&b| b), "len={len}: {ok:?}");
    }
}

#[test]
fn repeated_small_exchanges_keep_order() {
    let mut ts = _core::testing::tcp_mesh(2, SECRET).unwrap();
    let ok = run(&mut ts, |t| {
        let other = 1 - t.rank();
        (0..2000u32).all(|i| {
            let send = (i * 2 + t.rank() as u32).to_le_bytes();
            let mut recv = [0u8; 4];
            t.exchange(
                &mut [
                    Xfer::Send {
                        peer: other,
                        buf: &send,
                    },
                    Xfer::Recv {
                        peer: other,
                        buf: &mut recv,
                    },
                ],
                LONG,
            )
            .unwrap();
            u32::from_le_bytes(recv) == i * 2 + other as u32
        })
    });
    assert_eq!(ok, vec![true, true]);
}

#[test]
fn dropped_peer_is_reported_as_lost() {
    // Rank 2 of 3 takes the others' data and leaves without sending its own: ranks 0 and 1,
    // waiting in the exchange for it, must name it. Their idle timeout is 30 s, so an error
    // from waiting it out would be a Timeout, not PeerLost.
    let n = 3;
    let ts = _core::testing::tcp_mesh(n, SECRET).unwrap();
    let barrier = Barrier::new(n - 1);
    let results = thread::scope(|s| {
        let hs: Vec<_> = ts
            .into_iter()
            .map(|mut t| {
                let barrier = &barrier;
                s.spawn(move || {
                    if t.rank() == 2 {
                        // The others are in the exchange once their data has arrived.
                        let (mut from0, mut from1) = (vec![0u8; 1024], vec![0u8; 1024]);
                        t.exchange(
                            &mut [
                                Xfer::Recv {
                                    peer: 0,
                                    buf: &mut from0,
                                },
                                Xfer::Recv {
                                    peer: 1,
                                    buf: &mut from1,
                                },
                            ],
                            LONG,
                        )
                        .unwrap();
                        drop(t);
                        assert!(from0 == pattern(seed(0, 2, 1024), 1024));
                        assert!(from1 == pattern(seed(1, 2, 1024), 1024));
                        return None;
                    }
                    let r = t.rank();
                    let sends: Vec<Vec<u8>> =
                        (0..n).map(|p| pattern(seed(r, p, 1024), 1024)).collect();
                    let mut recvs = vec![vec![0u8; 1024]; n];
                    let mut xfers = Vec::new();
                    for (p, (sb, rb)) in sends.iter().zip(recvs.iter_mut()).enumerate() {
                        if p != r {
                            xfers.push(Xfer::Send { peer: p, buf: sb });
                            xfers.push(Xfer::Recv { peer: p, buf: rb });
                        }
                    }
                    let res = t.exchange(&mut xfers, LONG);
                    barrier.wait(); // keep the link between 0 and 1 open until both are done
                    Some(res)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for (r, res) in results.into_iter().enumerate().take(2) {
        let res = res.unwrap();
        assert!(
            matches!(res, Err(Error::PeerLost { rank: 2, .. })),
            "rank {r}: {res:?}"
        );
    }
}

#[test]
fn peer_dropping_mid_transfer_of_64_mib() {
    const LEN: usize = 64 << 20;
    let ts = _core::testing::tcp_mesh(2, SECRET).unwrap();
    let mut it = ts.into_iter();
    let (mut t0, mut t1) = (it.next().unwrap(), it.next().unwrap());
    let quitter = thread::spawn(move || {
        // Take the first MiB of rank 0's message, then vanish without sending anything.
        let mut part = vec![0u8; 1 << 20];
        t1.exchange(
            &mut [Xfer::Recv {
                peer: 0,
                buf: &mut part,
            }],
            LONG,
        )
        .unwrap();
        drop(t1);
        assert!(part == pattern(1, 1 << 20));
    });
    let send = pattern(1, LEN);
    let mut recv = vec![0u8; LEN];
    // The idle timeout is 30 s: waiting it out would be a Timeout, not PeerLost.
    let res = t0.exchange(
        &mut [
            Xfer::Send {
                peer: 1,
                buf: &send,
            },
            Xfer::Recv {
                peer: 1,
                buf: &mut recv,
            },
        ],
        LONG,
    );
    quitter.join().unwrap();
    assert!(
        matches!(res, Err(Error::PeerLost { rank: 1, .. })),
        "{res:?}"
    );
}

#[test]
fn abort_fails_the_peer_and_the_aborted_side_stays_failed() {
    // Rank 0 waits in an exchange, with a 30 s idle timeout, for bytes rank 1 never sends:
    // rank 1's abort, not the timeout, must end that wait (PeerLost, not Timeout).
    let mut ts = _core::testing::tcp_mesh(2, SECRET).unwrap();
    let res = run(&mut ts, |t| {
        if t.rank() == 1 {
            // Rank 0's first byte: it is in its exchange.
            let mut first = [0u8; 1];
            t.exchange(
                &mut [Xfer::Recv {
                    peer: 0,
                    buf: &mut first,
                }],
                LONG,
            )
            .unwrap();
            t.abort();
            let mut b = [0u8; 1];
            let after = t.exchange(
                &mut [Xfer::Recv {
                    peer: 0,
                    buf: &mut b,
                }],
                LONG,
            );
            assert!(matches!(after, Err(Error::Shutdown(_))), "{after:?}");
            return None;
        }
        let mut b = [0u8; 16];
        let res = t.exchange(
            &mut [
                Xfer::Send { peer: 1, buf: &[7] },
                Xfer::Recv {
                    peer: 1,
                    buf: &mut b,
                },
            ],
            LONG,
        );
        Some(res)
    });
    let res = res[0].as_ref().unwrap();
    assert!(
        matches!(res, Err(Error::PeerLost { rank: 1, .. })),
        "{res:?}"
    );
}

#[test]
fn idle_timeout_names_the_silent_rank() {
    let mut ts = _core::testing::tcp_mesh(3, SECRET).unwrap();
    let idle = Duration::from_millis(300);
    let barrier = Barrier::new(3);
    let res = run(&mut ts, |t| {
        let out = if t.rank() == 0 {
            // Rank 1 answers, rank 2 never does.
            let mut a = [0u8; 8];
            let mut b = [0u8; 8];
            let start = Instant::now();
            let res = t.exchange(
                &mut [
                    Xfer::Recv {
                        peer: 1,
                        buf: &mut a,
                    },
                    Xfer::Recv {
                        peer: 2,
                        buf: &mut b,
                    },
                ],
                idle,
            );
            Some((res, start.elapsed(), a))
        } else {
            if t.rank() == 1 {
                t.exchange(
                    &mut [Xfer::Send {
                        peer: 0,
                        buf: &[5u8; 8],
                    }],
                    LONG,
                )
                .unwrap();
            }
            None
        };
        barrier.wait();
        out
    });
    let (res, dt, a) = res[0].as_ref().unwrap();
    assert_eq!(*a, [5u8; 8]);
    match res {
        Err(Error::Timeout { what, after }) => {
            assert!(what.starts_with("waiting for rank 2"), "{what}");
            assert_eq!(*after, idle);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // Not before its time; how soon after is a loaded machine's business (the error above
    // says the idle timeout ended the wait).
    assert!(*dt >= idle, "took {dt:?}");
}

#[test]
fn invalid_transfers_are_rejected() {
    let mut ts = _core::testing::tcp_mesh(2, SECRET).unwrap();
    let t = &mut ts[0];
    let res = t.exchange(&mut [Xfer::Send { peer: 2, buf: &[1] }], LONG);
    assert!(matches!(res, Err(Error::InvalidArgument(_))), "{res:?}");
    let res = t.exchange(
        &mut [
            Xfer::Send { peer: 1, buf: &[1] },
            Xfer::Send { peer: 1, buf: &[2] },
        ],
        LONG,
    );
    assert!(matches!(res, Err(Error::InvalidArgument(_))), "{res:?}");
    let mut b = [0u8; 2];
    let res = t.exchange(
        &mut [
            Xfer::Send { peer: 0, buf: &[1] },
            Xfer::Recv {
                peer: 0,
                buf: &mut b,
            },
        ],
        LONG,
    );
    assert!(matches!(res, Err(Error::InvalidArgument(_))), "{res:?}");
    // Empty transfers touch no link and complete at once.
    let mut e = [0u8; 0];
    t.exchange(
        &mut [Xfer::Recv {
            peer: 1,
            buf: &mut e,
        }],
        Duration::ZERO,
    )
    .unwrap();
}

#[test]
fn size_one_needs_no_peer() {
    let (ls, addrs) = _core::testing::loopback_listeners(1).unwrap();
    let mut t = TcpTransport::connect_mesh(&Mesh {
        rank: 0,
        size: 1,
        listener: &ls[0],
        addrs: &addrs,
        secret: SECRET,
        timeout: LONG,
    })
    .unwrap();
    let mut out = [0u8; 3];
    t.exchange(
        &mut [
            Xfer::Recv {
                peer: 0,
                buf: &mut out,
            },
            Xfer::Send {
                peer: 0,
                buf: b"abc",
            },
        ],
        LONG,
    )
    .unwrap();
    assert_eq!(&out, b"abc");
}

#[test]
fn late_peer_is_waited_for() {
    // Rank 0's port is bound from the start but not listening, so rank 1's connects are refused
    // and retried until rank 0 listens; nobody else can take the port meanwhile, and a
    // connect cannot pick it as its own source port and meet itself.
    let s0 = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s0.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let port = s0.local_addr().unwrap().as_socket().unwrap();
    let l1 = TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = vec![port, l1.local_addr().unwrap()];
    let a1 = addrs.clone();
    let h1 = thread::spawn(move || {
        TcpTransport::connect_mesh(&Mesh {
            rank: 1,
            size: 2,
            listener: &l1,
            addrs: &a1,
            secret: SECRET,
            timeout: LONG,
        })
    });
    // Let rank 1 meet at least one refusal before rank 0 listens.
    thread::sleep(Duration::from_millis(300));
    assert!(TcpStream::connect(port).is_err(), "rank 0's port refuses");
    s0.listen(16).unwrap();
    let l0: TcpListener = s0.into();
    let t0 = TcpTransport::connect_mesh(&Mesh {
        rank: 0,
        size: 2,
        listener: &l0,
        addrs: &addrs,
        secret: SECRET,
        timeout: LONG,
    })
    .unwrap();
    let t1 = h1.join().unwrap().unwrap();
    let mut ts = vec![t0, t1];
    let got = run(&mut ts, |t| ring_step(t, 100));
    assert_eq!(got[0], pattern(seed(1, 0, 100), 100));
}

#[test]
fn wrong_secret_is_rejected_on_both_sides() {
    let (ls, addrs) = _core::testing::loopback_listeners(2).unwrap();
    let res: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = ls
            .iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = &addrs;
                s.spawn(move || {
                    let secret: &[u8] = if r == 0 { b"right" } else { b"wrong" };
                    TcpTransport::connect_mesh(&Mesh {
                        rank: r,
                        size: 2,
                        listener: l,
                        addrs,
                        secret,
                        timeout: Duration::from_secs(2),
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The connector learns it was rejected; the acceptor drops it and keeps waiting.
    assert!(matches!(res[1], Err(Error::Auth(_))), "{:?}", res[1]);
    assert!(matches!(res[0], Err(Error::Timeout { .. })), "{:?}", res[0]);
}

#[test]
fn strangers_do_not_take_a_slot() {
    let (ls, addrs) = _core::testing::loopback_listeners(3).unwrap();
    // Before the mesh starts, every listener gets a garbage sender, a silent connection and a
    // client with the wrong secret.
    let mut keep = Vec::new();
    let mut liars = Vec::new();
    for (r, &a) in addrs.iter().enumerate() {
        let mut g = TcpStream::connect(a).unwrap();
        g.write_all(&[0xAB; 300]).unwrap();
        keep.push(g);
        keep.push(TcpStream::connect(a).unwrap());
        if r < 2 {
            // Rank 2 accepts nobody, so only ranks 0 and 1 ever answer a client.
            let mut s = TcpStream::connect(a).unwrap();
            liars.push(thread::spawn(move || {
                authenticate(&mut s, b"not the secret", true, Duration::from_secs(5))
            }));
        }
    }
    // An acceptor that handled one connection at a time would spend the mesh's whole 30 s on
    // the silent stranger's handshake (its deadline is 30 s from its accept), and the mesh
    // would fail with a Timeout below.
    let mut ts: Vec<TcpTransport> = thread::scope(|s| {
        let hs: Vec<_> = ls
            .iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = &addrs;
                s.spawn(move || {
                    TcpTransport::connect_mesh(&Mesh {
                        rank: r,
                        size: 3,
                        listener: l,
                        addrs,
                        secret: SECRET,
                        timeout: LONG,
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    for l in liars {
        let res = l.join().unwrap();
        assert!(matches!(res, Err(Error::Auth(_))), "{res:?}");
    }
    let got = run(&mut ts, |t| ring_step(t, 5000));
    for (r, g) in got.iter().enumerate() {
        assert_eq!(*g, pattern(seed((r + 2) % 3, r, 5000), 5000));
    }
    drop(keep);
}

#[test]
fn misplaced_address_is_reported() {
    // Rank 2 is told that rank 0 lives at rank 1's address.
    let (ls, addrs) = _core::testing::loopback_listeners(3).unwrap();
    let wrong = vec![addrs[1], addrs[0], addrs[2]];
    let res = thread::scope(|s| {
        let h: Vec<_> = ls
            .iter()
            .enumerate()
            .map(|(r, l)| {
                let a = if r == 2 { &wrong } else { &addrs };
                s.spawn(move || {
                    TcpTransport::connect_mesh(&Mesh {
                        rank: r,
                        size: 3,
                        listener: l,
                        addrs: a,
                        secret: SECRET,
                        timeout: Duration::from_secs(2),
                    })
                })
            })
            .collect();
        h.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    match &res[2] {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("expected rank 0"), "{m}"),
        other => panic!("{other:?}"),
    }
}

/// `n` transports over 127.0.0.1 that link only when a transfer needs it.
fn lazy_mesh(n: usize) -> (Vec<TcpTransport>, Vec<TcpListener>) {
    let (ls, addrs) = _core::testing::loopback_listeners(n).unwrap();
    let ts = thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (l, a) = (&ls[r], &addrs);
                s.spawn(move || {
                    TcpTransport::connect(
                        &Mesh {
                            rank: r,
                            size: n,
                            listener: l,
                            addrs: a,
                            secret: SECRET,
                            timeout: LONG,
                        },
                        &|_| false,
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    (ts, ls)
}

/// One exchange with every rank, this one included (a send/receive pair to self is a copy);
/// whether every received block is its sender's pattern.
fn all_pairs(t: &mut TcpTransport, len: usize) -> bool {
    let (r, n) = (t.rank(), t.size());
    let sends: Vec<Vec<u8>> = (0..n).map(|p| pattern(seed(r, p, len), len)).collect();
    let mut recvs: Vec<Vec<u8>> = vec![vec![0u8; len]; n];
    let mut xfers = Vec::new();
    for (p, (s, rv)) in sends.iter().zip(recvs.iter_mut()).enumerate() {
        xfers.push(Xfer::Send { peer: p, buf: s });
        xfers.push(Xfer::Recv { peer: p, buf: rv });
    }
    t.exchange(&mut xfers, LONG).unwrap();
    drop(xfers);
    (0..n).all(|p| recvs[p] == pattern(seed(p, r, len), len))
}

#[test]
fn links_are_made_on_first_use_and_only_where_used() {
    let n = 5;
    let (mut ts, _ls) = lazy_mesh(n);
    assert!(ts.iter().all(|t| t.linked_peers().is_empty()));
    for len in [1usize, 4096, 300_001] {
        let got = run(&mut ts, |t| ring_step(t, len));
        for (r, g) in got.iter().enumerate() {
            let prev = (r + n - 1) % n;
            assert_eq!(
                *g,
                pattern(seed(prev, r, len), len),
                "rank {r}, {len} bytes"
            );
        }
    }
    // A ring talks to two neighbours: two links per rank, one per pair.
    for (r, t) in ts.iter().enumerate() {
        assert_eq!(t.linked_peers(), {
            let mut v = vec![(r + 1) % n, (r + n - 1) % n];
            v.sort_unstable();
            v
        });
    }
    // Every pair at once, each side dialling the other in the same exchange.
    for len in [1usize, 1000, 300_001] {
        let ok = run(&mut ts, |t| all_pairs(t, len));
        assert!(ok.iter().all(|&b| b), "len={len}: {ok:?}");
    }
    for (r, t) in ts.iter().enumerate() {
        let others: Vec<usize> = (0..n).filter(|&p| p != r).collect();
        assert_eq!(t.linked_peers(), others, "rank {r}");
    }
}

#[test]
fn two_ranks_dialling_each_other_at_once_keep_one_link() {
    // Both ranks send and receive in their first exchange, so both dial at the same moment;
    // the verdicts must leave exactly one connection, whichever side's it is.
    for round in 0..40 {
        let (mut ts, _ls) = lazy_mesh(2);
        let ok = run(&mut ts, |t| all_pairs(t, 1 + round * 997));
        assert!(ok.iter().all(|&b| b), "round {round}: {ok:?}");
        let ok = run(&mut ts, |t| all_pairs(t, 65_536));
        assert!(ok.iter().all(|&b| b), "round {round}: {ok:?}");
        assert_eq!(ts[0].linked_peers(), vec![1]);
        assert_eq!(ts[1].linked_peers(), vec![0]);
    }
}

#[test]
fn a_link_to_a_gone_peer_is_peer_lost_at_once() {
    let (mut ts, mut ls) = lazy_mesh(3);
    // Rank 2 goes away before anyone linked with it: its listener closes with it.
    drop(ts.pop());
    drop(ls.pop());
    let t0 = &mut ts[0];
    // A refused connection retried until the deadline would end in a Timeout after 30 s.
    let err = t0
        .exchange(
            &mut [Xfer::Send {
                peer: 2,
                buf: &[1, 2, 3],
            }],
            LONG,
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::PeerLost { rank: 2, .. }),
        "unexpected error: {err}"
    );
    // The others still link and talk.
    let got = run(&mut ts, |t| {
        let peer = 1 - t.rank();
        let send = pattern(seed(t.rank(), peer, 10), 10);
        let mut recv = vec![0u8; 10];
        t.exchange(
            &mut [
                Xfer::Send { peer, buf: &send },
                Xfer::Recv {
                    peer,
                    buf: &mut recv,
                },
            ],
            LONG,
        )
        .unwrap();
        recv == pattern(seed(peer, t.rank(), 10), 10)
    });
    assert_eq!(got, vec![true, true]);
}
