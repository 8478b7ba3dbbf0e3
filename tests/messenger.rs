//! Point-to-point messages between the ranks of loopback meshes made as a job makes them:
//! matched by name whichever side comes first, in any order of names, compared on both sides,
//! failed on both sides when they disagree, when a peer goes and when nobody answers.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use _core::error::Error;
use _core::testing::hybrid_unlinked;
use _core::transport::hybrid::ShmOptions;
use _core::transport::messenger::{Message, Messenger, Payload, ANY_PEER};

const SECRET: &[u8] = b"messenger-test";
const LONG: Duration = Duration::from_secs(60);

/// Bytes that go back to the test when the messenger lets go of them.
struct Buf {
    bytes: Vec<u8>,
    back: Option<mpsc::Sender<Vec<u8>>>,
}

impl Payload for Buf {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(back) = self.back.take() {
            let _ = back.send(std::mem::take(&mut self.bytes));
        }
    }
}

/// A message's outcome, and for a receive the bytes it received.
struct Pending {
    outcome: mpsc::Receiver<Result<usize, Error>>,
    bytes: mpsc::Receiver<Vec<u8>>,
}

impl Pending {
    fn wait(&self) -> Result<Vec<u8>, Error> {
        Ok(self.wait_from()?.1)
    }

    /// The peer the message went to or came from, and the bytes.
    fn wait_from(&self) -> Result<(usize, Vec<u8>), Error> {
        let peer = self
            .outcome
            .recv_timeout(LONG)
            .expect("an outcome in time")?;
        Ok((
            peer,
            self.bytes.recv_timeout(LONG).expect("the payload back"),
        ))
    }
}

fn post(
    m: &Messenger,
    sending: bool,
    peer: usize,
    name: &str,
    desc: &str,
    bytes: Vec<u8>,
    timeout: Duration,
) -> Pending {
    let (tx, outcome) = mpsc::channel();
    let (back, bytes_rx) = mpsc::channel();
    let msg = Message {
        peer,
        name: name.into(),
        desc: desc.into(),
        payload: Box::new(Buf {
            bytes,
            back: Some(back),
        }),
        timeout,
        done: Box::new(move |r| drop(tx.send(r))),
    };
    if sending {
        m.send(msg);
    } else {
        m.recv(msg);
    }
    Pending {
        outcome,
        bytes: bytes_rx,
    }
}

fn send(m: &Messenger, peer: usize, name: &str, bytes: Vec<u8>) -> Pending {
    post(
        m,
        true,
        peer,
        name,
        &format!("uint8 [{}]", bytes.len()),
        bytes,
        LONG,
    )
}

fn recv(m: &Messenger, peer: usize, name: &str, len: usize) -> Pending {
    post(
        m,
        false,
        peer,
        name,
        &format!("uint8 [{len}]"),
        vec![0; len],
        LONG,
    )
}

/// Ranks 0 and 1 share a host (shared-memory data links), rank 2 is on another.
fn three() -> (
    Vec<_core::transport::hybrid::HybridTransport>,
    Vec<Messenger>,
) {
    let ts = hybrid_unlinked(&[0, 0, 1], &|_| ShmOptions::default(), SECRET).unwrap();
    let ms = ts.iter().map(|t| t.messenger().unwrap()).collect();
    (ts, ms)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn messages_arrive_whichever_side_comes_first_in_any_order_of_names() {
    let (_ts, ms) = three();
    // Sizes around the service's read chunk, and empty.
    for (k, len) in [0usize, 1, 7, 65_535, 65_536, 65_537, 3 << 20]
        .into_iter()
        .enumerate()
    {
        let seed = k as u8;
        // Receive posted first.
        let r = recv(&ms[2], 0, &format!("a{k}"), len);
        let s = send(&ms[0], 2, &format!("a{k}"), pattern(len, seed));
        assert_eq!(r.wait().unwrap(), pattern(len, seed));
        s.wait().unwrap();
        // Send first: the message waits at the receiver until its receive comes. A later
        // message on the same connection received means the first one has arrived.
        let s = send(&ms[1], 0, &format!("b{k}"), pattern(len, seed ^ 0x55));
        let sync = send(&ms[1], 0, &format!("sync{k}"), vec![k as u8]);
        assert_eq!(
            recv(&ms[0], 1, &format!("sync{k}"), 1).wait().unwrap(),
            vec![k as u8]
        );
        sync.wait().unwrap();
        let r = recv(&ms[0], 1, &format!("b{k}"), len);
        assert_eq!(r.wait().unwrap(), pattern(len, seed ^ 0x55));
        s.wait().unwrap();
    }
    // A receive posted while its message's payload is still arriving (a large message,
    // received as soon as it is sent: its header usually comes first, alone).
    for k in 0..3u8 {
        let big = pattern(32 << 20, k);
        let s = send(&ms[2], 1, &format!("big{k}"), big.clone());
        assert!(
            recv(&ms[1], 2, &format!("big{k}"), big.len())
                .wait()
                .unwrap()
                == big
        );
        s.wait().unwrap();
    }
    // Several in flight each way, received in another order than sent.
    let sends: Vec<_> = (0..6)
        .map(|i| send(&ms[2], 1, &format!("t{}", i % 3), pattern(100 + i, i as u8)))
        .chain((0..6).map(|i| send(&ms[1], 2, &format!("u{i}"), pattern(10 * i, 9))))
        .collect();
    let mut recvs = Vec::new();
    for name in ["t2", "t0", "t1", "t2", "t0", "t1"] {
        let i: usize = name[1..].parse().unwrap();
        let first = recvs.iter().filter(|(n, _, _)| *n == name).count() == 0;
        let idx = if first { i } else { i + 3 };
        recvs.push((name, idx, recv(&ms[1], 2, name, 100 + idx)));
    }
    for (_, idx, r) in &recvs {
        assert_eq!(r.wait().unwrap(), pattern(100 + idx, *idx as u8));
    }
    for i in (0..6).rev() {
        assert_eq!(
            recv(&ms[2], 1, &format!("u{i}"), 10 * i).wait().unwrap(),
            pattern(10 * i, 9)
        );
    }
    for s in sends {
        s.wait().unwrap();
    }
}

#[test]
fn a_receive_from_any_rank_takes_the_first_message_of_its_name_and_says_whose() {
    let (_ts, ms) = three();
    // Posted first: the first message of the name from either rank, each taken once.
    let any: Vec<_> = (0..2).map(|_| recv(&ms[0], ANY_PEER, "any", 2)).collect();
    let s1 = send(&ms[1], 0, "any", vec![1, 1]);
    let s2 = send(&ms[2], 0, "any", vec![2, 2]);
    let mut got: Vec<_> = any.iter().map(|r| r.wait_from().unwrap()).collect();
    got.sort();
    assert_eq!(got, vec![(1, vec![1, 1]), (2, vec![2, 2])]);
    assert_eq!(
        (s1.wait_from().unwrap().0, s2.wait_from().unwrap().0),
        (0, 0)
    );
    // Arrived first: taken in the order they arrived, after a receive that names its peer.
    let s2 = send(&ms[2], 0, "late", vec![2]);
    let sync = send(&ms[2], 0, "sync", vec![0]);
    recv(&ms[0], 2, "sync", 1).wait().unwrap();
    let s1 = send(&ms[1], 0, "late", vec![1]);
    let sync1 = send(&ms[1], 0, "sync", vec![0]);
    recv(&ms[0], 1, "sync", 1).wait().unwrap();
    assert_eq!(
        recv(&ms[0], ANY_PEER, "late", 1).wait_from().unwrap(),
        (2, vec![2])
    );
    assert_eq!(
        recv(&ms[0], ANY_PEER, "late", 1).wait_from().unwrap(),
        (1, vec![1])
    );
    for s in [s1, s2, sync, sync1] {
        s.wait().unwrap();
    }
    // Nobody sends: a timeout that says so; a send cannot go to any rank.
    let r = post(
        &ms[1],
        false,
        ANY_PEER,
        "none",
        "uint8 [1]",
        vec![0],
        Duration::from_millis(100),
    );
    let e = r.wait().unwrap_err();
    assert!(e.to_string().contains("from any rank"), "{e}");
    assert!(matches!(
        send(&ms[1], ANY_PEER, "x", vec![0]).wait(),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn a_disagreement_fails_both_sides_naming_both_ranks() {
    let (_ts, ms) = three();
    let s = post(&ms[0], true, 2, "m", "float32 [4]", vec![1; 16], LONG);
    let r = post(&ms[2], false, 0, "m", "int32 [4]", vec![0; 16], LONG);
    for e in [s.wait().unwrap_err(), r.wait().unwrap_err()] {
        match e {
            Error::Mismatch { name, message } => {
                assert_eq!(name, "m");
                assert!(
                    message.contains("rank 0 sends float32 [4] (16 bytes)"),
                    "{message}"
                );
                assert!(
                    message.contains("rank 2 receives into int32 [4] (16 bytes)"),
                    "{message}"
                );
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
    // A receive posted first, of another length; the connection goes on carrying messages.
    let r = recv(&ms[1], 0, "n", 3);
    let s = send(&ms[0], 1, "n", vec![5; 4]);
    assert!(matches!(r.wait(), Err(Error::Mismatch { .. })));
    assert!(matches!(s.wait(), Err(Error::Mismatch { .. })));
    let s = send(&ms[0], 1, "after", vec![6; 4]);
    assert_eq!(recv(&ms[1], 0, "after", 4).wait().unwrap(), vec![6; 4]);
    s.wait().unwrap();
}

#[test]
fn a_peer_gone_fails_what_waits_for_it_naming_it() {
    let (mut ts, mut ms) = three();
    // Linked both ways first.
    let s = send(&ms[2], 0, "hello", vec![1]);
    recv(&ms[0], 2, "hello", 1).wait().unwrap();
    s.wait().unwrap();
    let r = recv(&ms[0], 2, "never", 8);
    let s = send(&ms[0], 2, "unread", vec![0; 8]);
    // Rank 2 goes: its transport and messenger with it.
    drop(ms.pop());
    drop(ts.pop());
    let begun = Instant::now();
    for e in [r.wait().unwrap_err(), s.wait().unwrap_err()] {
        assert!(matches!(e, Error::PeerLost { rank: 2, .. }), "{e:?}");
    }
    assert!(begun.elapsed() < LONG / 2);
    // Later messages with it fail at once.
    assert!(matches!(
        recv(&ms[0], 2, "later", 1).wait(),
        Err(Error::PeerLost { rank: 2, .. })
    ));
}

#[test]
fn nobody_answering_is_a_timeout_and_the_job_failing_fails_everything() {
    let (_ts, ms) = three();
    let short = Duration::from_millis(200);
    let r = post(&ms[1], false, 2, "late", "uint8 [1]", vec![0], short);
    let s = post(&ms[0], true, 1, "unwanted", "uint8 [1]", vec![0], short);
    for e in [r.wait().unwrap_err(), s.wait().unwrap_err()] {
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        assert!(e.to_string().contains("rank"), "{e}");
    }
    let r = recv(&ms[2], 0, "x", 1);
    ms[2].fail(Error::Shutdown("the job failed".into()));
    assert!(matches!(r.wait(), Err(Error::Shutdown(_))));
    assert!(matches!(
        send(&ms[2], 0, "y", vec![1]).wait(),
        Err(Error::Shutdown(_))
    ));
    // Its connections closed: rank 0's messages with rank 2 fail too.
    let s = send(&ms[0], 2, "z", vec![1]);
    assert!(s.wait().is_err());
    // A rank cannot message itself or a rank outside the job.
    assert!(matches!(
        send(&ms[0], 0, "self", vec![1]).wait(),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        recv(&ms[0], 3, "out", 1).wait(),
        Err(Error::InvalidArgument(_))
    ));
}

/// Larger than the messenger's eager limit (256 KiB): announced, its payload sent only once a
/// receive has taken it.
const LARGE: usize = 1 << 20;

#[test]
fn a_large_message_waits_at_its_sender_for_its_receive_and_others_overtake_it() {
    let (_ts, ms) = three();
    for (from, to) in [(0, 1), (2, 0)] {
        // Nobody receives the large one yet: a small message sent after it is received, and
        // the large send is still waiting.
        let big = send(&ms[from], to, "big", pattern(LARGE, 1));
        let small = send(&ms[from], to, "small", vec![7; 3]);
        assert_eq!(recv(&ms[to], from, "small", 3).wait().unwrap(), vec![7; 3]);
        small.wait().unwrap();
        assert!(big.outcome.try_recv().is_err(), "sent before its receive");
        assert_eq!(
            recv(&ms[to], from, "big", LARGE).wait().unwrap(),
            pattern(LARGE, 1)
        );
        assert_eq!(big.wait_from().unwrap().0, to);
        // One name, large and small in turn, whichever side comes first: the n-th receive
        // takes the n-th message.
        let sends = [
            send(&ms[from], to, "mixed", pattern(LARGE + 1, 2)),
            send(&ms[from], to, "mixed", pattern(5, 3)),
            send(&ms[from], to, "mixed", pattern(LARGE - 1, 4)),
        ];
        let first = recv(&ms[to], from, "mixed", LARGE + 1);
        let rest = [
            recv(&ms[to], from, "mixed", 5),
            recv(&ms[to], from, "mixed", LARGE - 1),
        ];
        assert_eq!(first.wait().unwrap(), pattern(LARGE + 1, 2));
        assert_eq!(rest[0].wait().unwrap(), pattern(5, 3));
        assert_eq!(rest[1].wait().unwrap(), pattern(LARGE - 1, 4));
        for s in sends {
            s.wait().unwrap();
        }
    }
    // From any rank: announced messages of two ranks, each taken once.
    let sends = [
        send(&ms[1], 0, "anybig", pattern(LARGE, 5)),
        send(&ms[2], 0, "anybig", pattern(LARGE, 6)),
    ];
    let mut got: Vec<_> = (0..2)
        .map(|_| {
            post(
                &ms[0],
                false,
                ANY_PEER,
                "anybig",
                &format!("uint8 [{LARGE}]"),
                vec![0; LARGE],
                LONG,
            )
        })
        .map(|r| r.wait_from().unwrap())
        .collect();
    got.sort();
    assert_eq!(got, vec![(1, pattern(LARGE, 5)), (2, pattern(LARGE, 6))]);
    for s in sends {
        s.wait().unwrap();
    }
}

#[test]
fn a_large_message_that_disagrees_or_is_given_up_fails_both_sides_and_the_connection_goes_on() {
    let (_ts, ms) = three();
    // Announced, then a receive of another length: both fail, naming both ranks.
    let s = send(&ms[0], 2, "m", vec![1; LARGE]);
    let r = recv(&ms[2], 0, "m", LARGE / 2);
    for e in [s.wait().unwrap_err(), r.wait().unwrap_err()] {
        match e {
            Error::Mismatch { message, .. } => {
                assert!(
                    message.contains(&format!("rank 0 sends uint8 [{LARGE}]")),
                    "{message}"
                );
                assert!(message.contains("rank 2 receives into"), "{message}");
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
    // The sender gives up on one nobody received: a receive that takes it later fails at its
    // own deadline, saying the payload did not come, and later messages still arrive.
    let short = Duration::from_millis(200);
    let s = post(
        &ms[1],
        true,
        0,
        "late",
        &format!("uint8 [{LARGE}]"),
        vec![3; LARGE],
        short,
    );
    assert!(matches!(s.wait(), Err(Error::Timeout { .. })));
    let r = post(
        &ms[0],
        false,
        1,
        "late",
        &format!("uint8 [{LARGE}]"),
        vec![0; LARGE],
        short,
    );
    let e = r.wait().unwrap_err();
    assert!(
        matches!(e, Error::Timeout { .. }) && e.to_string().contains("did not come"),
        "{e}"
    );
    for (from, to) in [(0, 2), (1, 0)] {
        let s = send(&ms[from], to, "after", pattern(LARGE, 9));
        assert_eq!(
            recv(&ms[to], from, "after", LARGE).wait().unwrap(),
            pattern(LARGE, 9)
        );
        s.wait().unwrap();
    }
}
