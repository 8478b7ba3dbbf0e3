//! What the messenger holds of each message and connection, and the bytes of a connection
//! that sends: its queued messages written (a large one announced, its payload written once
//! the receiver clears it), the receiver's answers read (see the module above).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

use super::conn::Conn;
use super::frame::{self, read_to_sender, Header, ToSender};
use super::{Message, Payload};
use crate::error::{Error, Result};

/// A message waiting for its other side or moving.
pub(super) struct Pending {
    /// The peer: the one named, or for a receive from any rank the one whose message it took.
    pub(super) peer: usize,
    pub(super) name: String,
    pub(super) desc: String,
    pub(super) payload: Box<dyn Payload>,
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) done: super::Done,
}

impl Pending {
    pub(super) fn of(m: Message) -> (usize, Pending) {
        let deadline = Instant::now()
            .checked_add(m.timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
        let p = Pending {
            peer: m.peer,
            name: m.name,
            desc: m.desc,
            payload: m.payload,
            deadline,
            timeout: m.timeout,
            done: m.done,
        };
        (m.peer, p)
    }

    /// Tells the caller (with the peer, on success); the payload is let go of first (the
    /// caller's memory is its own again once told).
    pub(super) fn finish(self, result: Result<()>) {
        let peer = self.peer;
        drop(self.payload);
        (self.done)(result.map(|()| peer));
    }
}

/// Payloads of more bytes than this are announced and wait at their sender until a receive
/// takes them, then go straight into its memory: a receiver holds at most this much of each
/// message nobody has received yet, and a large payload is never copied out of a buffer. A
/// smaller one follows its header at once (eager), which spares it the clearance's round
/// trip: 64 KiB costs about that round trip on loopback.
pub(super) const EAGER_BYTES: usize = 256 * 1024;

/// A message that arrived before its receive.
pub(super) struct Arrived {
    /// When it arrived among this rank's messages: a receive from any rank takes the first.
    pub(super) order: u64,
    pub(super) seq: u64,
    pub(super) desc: String,
    pub(super) len: usize,
    /// The payload; `None` for a message announced, whose payload its sender still holds.
    pub(super) data: Option<Vec<u8>>,
}

/// This rank's connection to send to one peer.
#[derive(Default)]
pub(super) struct Out {
    /// `None` while it is being made.
    pub(super) conn: Option<Conn>,
    pub(super) next_seq: u64,
    pub(super) queue: VecDeque<(u64, Pending)>,
    /// Announced messages whose receive cleared them: their payloads go before the queue.
    pub(super) cleared: VecDeque<(u64, Pending)>,
    /// What is being written: a message's header, then its payload unless it was announced;
    /// or a cleared payload's frame, then the payload.
    pub(super) current: Option<Writing>,
    /// Written, waiting for the receiver's answer.
    pub(super) sent: HashMap<u64, Pending>,
    pub(super) rbuf: Vec<u8>,
}

/// A frame being written, and the payload after it (unless `payload` is false).
pub(super) struct Writing {
    pub(super) seq: u64,
    pub(super) p: Pending,
    pub(super) frame: Vec<u8>,
    pub(super) payload: bool,
    /// Bytes of frame and payload written.
    pub(super) at: usize,
}

impl Out {
    /// Whether bytes wait to be written.
    pub(super) fn writing(&self) -> bool {
        self.current.is_some() || !self.queue.is_empty() || !self.cleared.is_empty()
    }
}

/// Where the payload of the message being read goes.
pub(super) enum Into {
    Posted(Pending),
    Buffer(String, Vec<u8>),
    /// A receive refused it (and was failed): its bytes are read and dropped.
    Discard,
}

pub(super) struct Reading {
    pub(super) seq: u64,
    pub(super) name: String,
    pub(super) len: usize,
    pub(super) got: usize,
    pub(super) into: Into,
}

/// A peer's connection to send to this rank.
pub(super) struct In {
    pub(super) conn: Conn,
    pub(super) rbuf: Vec<u8>,
    pub(super) reading: Option<Reading>,
    /// Answers not written yet.
    pub(super) wbuf: Vec<u8>,
    /// Receives that took an announced message and cleared it, by its seq: its payload comes
    /// straight into them.
    pub(super) cleared: HashMap<u64, Pending>,
}

/// Read size when no payload has its own memory to read into.
pub(super) const CHUNK: usize = 64 * 1024;

/// Writes the messages queued to `peer` (cleared payloads first) and reads its answers.
pub(super) fn progress_out(o: &mut Out, peer: usize) -> Result<()> {
    let Some(conn) = &mut o.conn else {
        return Ok(());
    };
    loop {
        loop {
            if o.current.is_none() {
                o.current = if let Some((seq, p)) = o.cleared.pop_front() {
                    let frame = frame::data(seq, p.payload.bytes().len() as u64);
                    Some(Writing {
                        seq,
                        p,
                        frame,
                        payload: true,
                        at: 0,
                    })
                } else if let Some((seq, p)) = o.queue.pop_front() {
                    let len = p.payload.bytes().len();
                    let header = Header {
                        seq,
                        len: len as u64,
                        name: p.name.clone(),
                        desc: p.desc.clone(),
                        announced: len > EAGER_BYTES,
                    };
                    Some(Writing {
                        seq,
                        frame: header.encode(),
                        payload: !header.announced,
                        p,
                        at: 0,
                    })
                } else {
                    break;
                };
            }
            let w = o.current.as_mut().expect("current");
            let payload = if w.payload { w.p.payload.bytes() } else { &[] };
            let total = w.frame.len() + payload.len();
            while w.at < total {
                let bytes = if w.at < w.frame.len() {
                    &w.frame[w.at..]
                } else {
                    &payload[w.at - w.frame.len()..]
                };
                match conn.write_some(bytes, peer)? {
                    Some(n) => w.at += n,
                    None => break,
                }
            }
            if w.at < total {
                break;
            }
            let w = o.current.take().expect("current");
            o.sent.insert(w.seq, w.p);
        }
        let mut cleared = false;
        loop {
            let n = conn.fill(&mut o.rbuf, 4096, peer)?;
            while let Some((answer, used)) = read_to_sender(&o.rbuf)? {
                o.rbuf.drain(..used);
                match answer {
                    ToSender::Ack(ack) => {
                        if let Some(p) = o.sent.remove(&ack.seq) {
                            let name = p.name.clone();
                            p.finish(ack.error.map_or(Ok(()), |m| mismatch(&name, m)));
                        }
                    }
                    // A message given up on (its deadline passed) is not written: its receive
                    // fails at its own deadline.
                    ToSender::Clear(seq) => {
                        if let Some(p) = o.sent.remove(&seq) {
                            o.cleared.push_back((seq, p));
                            cleared = true;
                        }
                    }
                }
            }
            if n == 0 {
                break;
            }
        }
        if !cleared {
            return Ok(());
        }
    }
}

/// Queues an answer to `i`'s sender and writes what it can at once, before the receive is
/// told: a receiver that goes on to shut down must not take the sender's answer with it. A
/// failure to write shows on the connection's next turn.
pub(super) fn answer(i: &mut In, peer: usize, ack: Vec<u8>) {
    i.wbuf.extend(ack);
    let _ = flush(i, peer);
}

/// Writes what it can of `i`'s answers to `peer` without waiting.
pub(super) fn flush(i: &mut In, peer: usize) -> Result<()> {
    while !i.wbuf.is_empty() {
        match i.conn.write_some(&i.wbuf, peer)? {
            Some(n) => drop(i.wbuf.drain(..n)),
            None => break,
        }
    }
    Ok(())
}

pub(super) fn mismatch(name: &str, message: String) -> Result<()> {
    Err(Error::Mismatch {
        name: name.to_string(),
        message,
    })
}

/// The first value queued under `key`, the queue dropped once empty.
pub(super) fn take_first<K: Hash + Eq, V>(map: &mut HashMap<K, VecDeque<V>>, key: &K) -> Option<V> {
    let q = map.get_mut(key)?;
    let v = q.pop_front();
    if q.is_empty() {
        map.remove(key);
    }
    v
}

/// Fails the receive a closing connection was reading into, if any, and those that cleared a
/// message whose payload will now never come.
pub(super) fn fail_in(i: In, err: &Error) {
    if let Some(Reading {
        into: Into::Posted(p),
        ..
    }) = i.reading
    {
        p.finish(Err(err.clone()));
    }
    for (_, p) in i.cleared {
        p.finish(Err(err.clone()));
    }
}

pub(super) fn fail_out(o: Out, err: &Error) {
    for (_, p) in o.queue.into_iter().chain(o.cleared) {
        p.finish(Err(err.clone()));
    }
    if let Some(w) = o.current {
        w.p.finish(Err(err.clone()));
    }
    for (_, p) in o.sent {
        p.finish(Err(err.clone()));
    }
}
