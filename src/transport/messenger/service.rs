//! The messenger's thread: every connection's bytes, the matching of messages with receives,
//! and their deadlines (see the module above).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::super::dial::{Finish, Made};
use super::conn::Conn;
use super::frame::{self, read_to_receiver, Ack, Header, ToReceiver};
use super::held::{
    answer, fail_in, fail_out, flush, mismatch, progress_out, take_first, Arrived, In, Into, Out,
    Pending, Reading, CHUNK,
};
use super::{Message, ANY_PEER};
use crate::error::{Error, Result};
use crate::spin::Spin;
use crate::sys::{poll, poll_fd, PollFd, Waker, POLL_IN};

/// What callers and helper threads tell the service.
pub(super) enum Cmd {
    Send(Message),
    Recv(Message),
    /// A peer's connection to send to this rank, from the acceptor.
    Incoming(usize, Result<Made>),
    /// This rank's connection to send to a peer, made (or not) on a thread of its own.
    Dialed(usize, Result<Made>),
    Fail(Error),
    Stop,
}

impl Cmd {
    /// Fails what the command carries, which the service will never see.
    pub(super) fn refuse(self, err: Error) {
        if let Cmd::Send(m) | Cmd::Recv(m) = self {
            drop(m.payload);
            (m.done)(Err(err));
        }
    }
}

/// How this rank reaches its peers: who it is, where they listen, the job's secret, how long
/// making a connection may take, and what a new connection becomes (shared memory with a peer
/// on this host), as for the data links.
#[derive(Clone)]
pub(super) struct Reach {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) addrs: Arc<[SocketAddr]>,
    pub(super) secret: Arc<[u8]>,
    pub(super) handshake: Duration,
    pub(super) finish: Option<Finish>,
    /// How long the thread polls before it sleeps (`FERROVOD_SPIN_US`).
    pub(super) spin: Duration,
}

pub(super) struct Service {
    rank: usize,
    reach: Reach,
    tx: mpsc::Sender<Cmd>,
    rx: mpsc::Receiver<Cmd>,
    /// Rung by every command.
    waker: Arc<Waker>,
    outs: HashMap<usize, Out>,
    ins: HashMap<usize, In>,
    posted: HashMap<(usize, String), VecDeque<Pending>>,
    /// Receives from any rank, by name.
    posted_any: HashMap<String, VecDeque<Pending>>,
    arrived: HashMap<(usize, String), VecDeque<Arrived>>,
    arrivals: u64,
    /// Peers whose connection closed, and how.
    gone: HashMap<usize, Error>,
    failed: Option<Error>,
}

impl Service {
    pub(super) fn new(
        reach: Reach,
        (tx, rx): (mpsc::Sender<Cmd>, mpsc::Receiver<Cmd>),
        waker: Arc<Waker>,
    ) -> Service {
        Service {
            rank: reach.rank,
            reach,
            tx,
            rx,
            waker,
            outs: HashMap::new(),
            ins: HashMap::new(),
            posted: HashMap::new(),
            posted_any: HashMap::new(),
            arrived: HashMap::new(),
            arrivals: 0,
            gone: HashMap::new(),
            failed: None,
        }
    }

    /// Records a failure before any message started the thread: every message fails with it.
    pub(super) fn fail_unstarted(&mut self, err: Error) {
        self.failed.get_or_insert(err);
    }

    pub(super) fn set_spin(&mut self, spin: Duration) {
        self.reach.spin = spin;
    }

    pub(super) fn run(mut self) {
        let mut fds: Vec<PollFd> = Vec::new();
        let mut who: Vec<(bool, usize)> = Vec::new();
        loop {
            while let Ok(cmd) = self.rx.try_recv() {
                if !self.command(cmd) {
                    self.fail_everything(Error::Shutdown(
                        "ferrovod was shut down on this rank".into(),
                    ));
                    return;
                }
            }
            self.progress();
            let now = Instant::now();
            self.expire(now);
            fds.clear();
            who.clear();
            fds.push(poll_fd(&self.waker.fd(), POLL_IN));
            let mut ready = false;
            for (&peer, o) in &self.outs {
                if let Some(c) = &o.conn {
                    let (fd, now) = c.sleep_on(o.writing());
                    fds.push(fd);
                    ready |= now;
                    who.push((true, peer));
                }
            }
            for (&peer, i) in &self.ins {
                let (fd, now) = i.conn.sleep_on(!i.wbuf.is_empty());
                fds.push(fd);
                ready |= now;
                who.push((false, peer));
            }
            // A message's next step (the peer's answer, the next message of an exchange) often
            // comes within microseconds, and a wake-up from poll costs tens of them: poll for
            // the job's spin first, yielding the core between polls, as the engine's waits do.
            let ready = ready || self.spin_until_ready(&mut fds);
            let wait = match ready {
                true => Some(Duration::ZERO),
                false => self
                    .next_deadline()
                    .map(|d| d.saturating_duration_since(now)),
            };
            let polled = poll(&mut fds, wait);
            for (fd, &(out, peer)) in fds[1..].iter().zip(&who) {
                let revents = if polled.is_ok() { fd.revents } else { 0 };
                let conn = match out {
                    true => self.outs.get_mut(&peer).and_then(|o| o.conn.as_mut()),
                    false => self.ins.get_mut(&peer).map(|i| &mut i.conn),
                };
                if let Some(c) = conn {
                    c.woke(revents);
                }
            }
            self.waker.clear();
        }
    }

    /// Polls `fds` (as set up for the sleep) for at most the job's spin: whether one is ready,
    /// so that the thread must not sleep. Polling them is enough: a shared-memory link is
    /// armed by then, so its peer rings the doorbell once it writes or frees space.
    fn spin_until_ready(&self, fds: &mut [PollFd]) -> bool {
        if self.reach.spin.is_zero() {
            return false;
        }
        let mut spin = Spin::new(self.reach.spin);
        while spin.yield_core() {
            if matches!(poll(fds, Some(Duration::ZERO)), Ok(n) if n > 0) {
                return true;
            }
        }
        false
    }

    /// Carries out one command; false to stop.
    fn command(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Send(m) => self.post_send(m),
            Cmd::Recv(m) => self.post_recv(m),
            Cmd::Incoming(peer, made) => match (&self.failed, made.and_then(Conn::new)) {
                (None, Ok(conn)) => {
                    log::debug!(
                        target: crate::LOG_TARGET,
                        "rank {}: point-to-point messages from rank {peer} over {}",
                        self.rank,
                        conn.kind()
                    );
                    let i = In {
                        conn,
                        rbuf: Vec::new(),
                        reading: None,
                        wbuf: Vec::new(),
                        cleared: HashMap::new(),
                    };
                    self.ins.insert(peer, i);
                }
                (_, Err(e)) => self.lose(peer, e),
                (Some(_), Ok(_)) => {}
            },
            Cmd::Dialed(peer, made) => match (made.and_then(Conn::new), self.outs.get_mut(&peer)) {
                (Ok(c), Some(o)) => {
                    log::debug!(
                        target: crate::LOG_TARGET,
                        "rank {}: point-to-point messages to rank {peer} over {}",
                        self.rank,
                        c.kind()
                    );
                    o.conn = Some(c);
                }
                (Err(e), Some(_)) => self.lose(peer, e),
                (_, None) => {}
            },
            Cmd::Fail(err) => {
                self.failed.get_or_insert(err.clone());
                self.fail_everything(err);
            }
            Cmd::Stop => return false,
        }
        true
    }

    fn post_send(&mut self, m: Message) {
        let (peer, p) = Pending::of(m);
        if let Some(e) = self.failed.as_ref().or(self.gone.get(&peer)) {
            p.finish(Err(e.clone()));
            return;
        }
        let o = self.outs.entry(peer).or_insert_with(|| {
            let reach = self.reach.clone();
            let rank = reach.rank;
            let (tx, waker) = (self.tx.clone(), self.waker.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("ferrovod-p2p-dial-{rank}"))
                .spawn(move || {
                    let deadline = Instant::now() + reach.handshake;
                    let made = crate::transport::dial::connect_messages(
                        (rank, reach.size),
                        (peer, reach.addrs[peer]),
                        &reach.secret,
                        reach.finish.as_ref(),
                        deadline,
                    );
                    if tx.send(Cmd::Dialed(peer, made)).is_ok() {
                        waker.wake();
                    }
                });
            if let Err(e) = spawned {
                let _ = self.tx.send(Cmd::Dialed(peer, Err(e.into())));
            }
            Out::default()
        });
        let seq = o.next_seq;
        o.next_seq += 1;
        o.queue.push_back((seq, p));
    }

    fn post_recv(&mut self, m: Message) {
        let (peer, p) = Pending::of(m);
        if let Some(e) = &self.failed {
            p.finish(Err(e.clone()));
            return;
        }
        if peer == ANY_PEER {
            // The first message of the name to arrive, from whichever rank.
            let first = self
                .arrived
                .iter()
                .filter(|((_, name), q)| *name == p.name && !q.is_empty())
                .min_by_key(|(_, q)| q[0].order)
                .map(|(k, _)| k.0);
            match first {
                Some(from) => self.take_arrived(from, p),
                None => self
                    .posted_any
                    .entry(p.name.clone())
                    .or_default()
                    .push_back(p),
            }
            return;
        }
        let key = (peer, p.name.clone());
        if self.arrived.get(&key).is_some_and(|q| !q.is_empty()) {
            self.take_arrived(peer, p);
            return;
        }
        if let Some(e) = self.gone.get(&peer) {
            p.finish(Err(e.clone()));
            return;
        }
        self.posted.entry(key).or_default().push_back(p);
    }

    /// Receive `p` takes the first message of its name that arrived from `peer`.
    fn take_arrived(&mut self, peer: usize, mut p: Pending) {
        let Some(a) = take_first(&mut self.arrived, &(peer, p.name.clone())) else {
            return;
        };
        p.peer = peer;
        if a.data.is_none() {
            // Announced: its payload comes once cleared, over a connection still there.
            match self.ins.get_mut(&peer) {
                Some(i) => clear(self.rank, i, peer, (a.seq, &a.desc, a.len), p),
                None => {
                    let e = self
                        .gone
                        .get(&peer)
                        .cloned()
                        .unwrap_or_else(|| super::conn::closed(peer));
                    p.finish(Err(e));
                }
            }
            return;
        }
        let (ack, p, result) = self.deliver(peer, a, p);
        if let Some(i) = self.ins.get_mut(&peer) {
            answer(i, peer, ack);
        }
        p.finish(result);
    }

    /// The receive posted for message `name` from `peer`: one that named it, else one from
    /// any rank (which then has its peer).
    fn take_posted(&mut self, peer: usize, name: &str) -> Option<Pending> {
        if let Some(p) = take_first(&mut self.posted, &(peer, name.to_string())) {
            return Some(p);
        }
        let mut p = take_first(&mut self.posted_any, &name.to_string())?;
        p.peer = peer;
        Some(p)
    }

    /// Hands a message that waited in a buffer to its receive: the answer to send back, and
    /// the receive with its outcome, to be told once the answer is on its way.
    fn deliver(&self, peer: usize, a: Arrived, mut p: Pending) -> (Vec<u8>, Pending, Result<()>) {
        let verdict = disagreement(self.rank, peer, &a.desc, a.len, &p);
        if let (None, Some(data)) = (&verdict, &a.data) {
            p.payload.bytes_mut().copy_from_slice(data);
        }
        let ack = Ack {
            seq: a.seq,
            error: verdict.clone(),
        }
        .encode();
        let result = verdict.map_or(Ok(()), |message| mismatch(&p.name, message));
        (ack, p, result)
    }

    /// Moves whatever bytes can move on every connection.
    fn progress(&mut self) {
        let failed: Vec<_> = self
            .outs
            .iter_mut()
            .filter_map(|(&peer, o)| progress_out(o, peer).err().map(|e| (peer, e)))
            .collect();
        for (peer, e) in failed {
            self.lose(peer, e);
        }
        let ins: Vec<usize> = self.ins.keys().copied().collect();
        for peer in ins {
            let Some(mut i) = self.ins.remove(&peer) else {
                continue;
            };
            match self.progress_in(&mut i, peer) {
                Ok(()) => drop(self.ins.insert(peer, i)),
                Err(e) => {
                    self.ins.insert(peer, i);
                    self.lose(peer, e);
                }
            }
        }
    }

    /// Writes this rank's answers to `peer` and reads its messages.
    fn progress_in(&mut self, i: &mut In, peer: usize) -> Result<()> {
        flush(i, peer)?;
        loop {
            if let Some(r) = &mut i.reading {
                let n = {
                    let mut scratch = [0u8; 4096];
                    let target: &mut [u8] = match &mut r.into {
                        Into::Posted(p) => &mut p.payload.bytes_mut()[r.got..r.len],
                        Into::Buffer(_, v) => &mut v[r.got..r.len],
                        Into::Discard => {
                            let n = (r.len - r.got).min(scratch.len());
                            &mut scratch[..n]
                        }
                    };
                    match i.conn.read_some(target, peer)? {
                        Some(n) => n,
                        None => return Ok(()),
                    }
                };
                r.got += n;
                if r.got == r.len {
                    let r = i.reading.take().expect("reading");
                    self.arrive(i, peer, r);
                }
                continue;
            }
            let n = i.conn.fill(&mut i.rbuf, CHUNK, peer)?;
            self.parse(i, peer)?;
            if n == 0 {
                return Ok(());
            }
        }
    }

    /// Starts the messages and payloads whose frames lie in `i.rbuf`, with the payload bytes
    /// after them.
    fn parse(&mut self, i: &mut In, peer: usize) -> Result<()> {
        while i.reading.is_none() {
            let Some((frame, used)) = read_to_receiver(&i.rbuf)? else {
                return Ok(());
            };
            i.rbuf.drain(..used);
            let mut r = match frame {
                ToReceiver::Header(h) if h.announced => {
                    self.announced(i, peer, h);
                    continue;
                }
                ToReceiver::Header(h) => self.start_reading(i, peer, h),
                ToReceiver::Data { seq, len } => cleared_payload(i, seq, len as usize)?,
            };
            let take = (r.len - r.got).min(i.rbuf.len());
            match &mut r.into {
                Into::Posted(p) => p.payload.bytes_mut()[..take].copy_from_slice(&i.rbuf[..take]),
                Into::Buffer(_, v) => v[..take].copy_from_slice(&i.rbuf[..take]),
                Into::Discard => {}
            }
            i.rbuf.drain(..take);
            r.got = take;
            if r.got == r.len {
                self.arrive(i, peer, r);
            } else {
                i.reading = Some(r);
            }
        }
        Ok(())
    }

    /// Where the payload of message `h` from `peer` goes: the receive posted for it, or a
    /// buffer until one is.
    fn start_reading(&mut self, i: &mut In, peer: usize, h: Header) -> Reading {
        let len = h.len as usize;
        let posted = self.take_posted(peer, &h.name);
        let into = match posted {
            None => Into::Buffer(h.desc, vec![0u8; len]),
            Some(p) => match disagreement(self.rank, peer, &h.desc, len, &p) {
                None => Into::Posted(p),
                Some(message) => {
                    refuse(i, peer, h.seq, p, message);
                    Into::Discard
                }
            },
        };
        Reading {
            seq: h.seq,
            name: h.name,
            len,
            got: 0,
            into,
        }
    }

    /// Announced message `h` from `peer` (its payload still at the sender): cleared for the
    /// receive posted for it, or kept until one is.
    fn announced(&mut self, i: &mut In, peer: usize, h: Header) {
        let len = h.len as usize;
        match self.take_posted(peer, &h.name) {
            Some(p) => clear(self.rank, i, peer, (h.seq, &h.desc, len), p),
            None => {
                self.arrivals += 1;
                let a = Arrived {
                    order: self.arrivals,
                    seq: h.seq,
                    desc: h.desc,
                    len,
                    data: None,
                };
                self.arrived.entry((peer, h.name)).or_default().push_back(a);
            }
        }
    }

    /// A message's last byte arrived.
    fn arrive(&mut self, i: &mut In, peer: usize, r: Reading) {
        match r.into {
            Into::Posted(p) => {
                let ack = Ack {
                    seq: r.seq,
                    error: None,
                };
                answer(i, peer, ack.encode());
                p.finish(Ok(()));
            }
            Into::Buffer(desc, data) => {
                self.arrivals += 1;
                let a = Arrived {
                    order: self.arrivals,
                    seq: r.seq,
                    desc,
                    len: data.len(),
                    data: Some(data),
                };
                // A receive posted while the payload was still arriving takes it now.
                match self.take_posted(peer, &r.name) {
                    Some(p) => {
                        let (ack, p, result) = self.deliver(peer, a, p);
                        answer(i, peer, ack);
                        p.finish(result);
                    }
                    None => self.arrived.entry((peer, r.name)).or_default().push_back(a),
                }
            }
            Into::Discard => {}
        }
    }

    /// `peer`'s connection (either way) closed or failed with `err`: every message with it
    /// in flight, and every receive from it, fails, as does every later one.
    fn lose(&mut self, peer: usize, err: Error) {
        self.gone.entry(peer).or_insert_with(|| err.clone());
        if let Some(o) = self.outs.remove(&peer) {
            fail_out(o, &err);
        }
        if let Some(i) = self.ins.remove(&peer) {
            fail_in(i, &err);
        }
        let keys: Vec<_> = self
            .posted
            .keys()
            .filter(|k| k.0 == peer)
            .cloned()
            .collect();
        for k in keys {
            for p in self.posted.remove(&k).unwrap_or_default() {
                p.finish(Err(err.clone()));
            }
        }
    }

    fn fail_everything(&mut self, err: Error) {
        for (_, o) in self.outs.drain() {
            fail_out(o, &err);
        }
        for (peer, mut i) in self.ins.drain() {
            // Answers written so far still reach their senders.
            let _ = flush(&mut i, peer);
            fail_in(i, &err);
        }
        let any = self.posted_any.drain().map(|(_, ps)| ps);
        for ps in self
            .posted
            .drain()
            .map(|(_, ps)| ps)
            .chain(any)
            .collect::<Vec<_>>()
        {
            for p in ps {
                p.finish(Err(err.clone()));
            }
        }
        self.arrived.clear();
    }

    /// Fails the messages whose deadline passed.
    fn expire(&mut self, now: Instant) {
        let rank = self.rank;
        let late = |p: &Pending| p.deadline <= now;
        let timeout = |p: &Pending, what: String| Error::Timeout {
            what,
            after: p.timeout,
        };
        for ((peer, name), ps) in self.posted.iter_mut() {
            while ps.front().is_some_and(late) {
                let p = ps.pop_front().expect("front");
                let e = timeout(
                    &p,
                    format!("rank {rank} receiving '{name}' from rank {peer}"),
                );
                p.finish(Err(e));
            }
        }
        self.posted.retain(|_, ps| !ps.is_empty());
        for (name, ps) in self.posted_any.iter_mut() {
            while ps.front().is_some_and(late) {
                let p = ps.pop_front().expect("front");
                let e = timeout(&p, format!("rank {rank} receiving '{name}' from any rank"));
                p.finish(Err(e));
            }
        }
        self.posted_any.retain(|_, ps| !ps.is_empty());
        // A receive that cleared a message whose payload has not come (its sender gave up on
        // it, or is slow): the payload is dropped if it comes later.
        for (&peer, i) in self.ins.iter_mut() {
            for p in remove_late(&mut i.cleared, now) {
                let what = format!(
                    "rank {rank} receiving '{}' from rank {peer}: its payload did not come",
                    p.name
                );
                let e = timeout(&p, what);
                p.finish(Err(e));
            }
        }
        let mut broken = Vec::new();
        for (&peer, o) in self.outs.iter_mut() {
            let what = |p: &Pending| {
                format!(
                    "rank {rank} sending '{}' to rank {peer}: no receive of rank {peer} took it",
                    p.name
                )
            };
            let (keep, gone): (VecDeque<_>, VecDeque<_>) =
                o.queue.drain(..).partition(|(_, p)| !late(p));
            o.queue = keep;
            for (_, p) in gone {
                let e = timeout(&p, what(&p));
                p.finish(Err(e));
            }
            for p in remove_late(&mut o.sent, now) {
                let e = timeout(&p, what(&p));
                p.finish(Err(e));
            }
            // A message cut off half-written leaves the connection unusable: it closes.
            if let Some(w) = o.current.as_ref().filter(|w| late(&w.p)) {
                broken.push((peer, timeout(&w.p, what(&w.p))));
            }
        }
        for (peer, e) in broken {
            if let Some(o) = self.outs.remove(&peer) {
                fail_out(o, &e);
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let any = self.posted_any.values().flatten();
        let cleared = self.ins.values().flat_map(|i| i.cleared.values());
        let posted = self
            .posted
            .values()
            .flatten()
            .chain(any)
            .chain(cleared)
            .map(|p| p.deadline);
        let outs = self.outs.values().flat_map(|o| {
            let queued = o.queue.iter().map(|(_, p)| p.deadline);
            let current = o.current.iter().map(|w| w.p.deadline);
            let sent = o.sent.values().map(|p| p.deadline);
            queued.chain(current).chain(sent)
        });
        posted.chain(outs).min()
    }
}

/// The messages of `map` whose deadline has passed at `now`, taken out of it.
fn remove_late(map: &mut HashMap<u64, Pending>, now: Instant) -> Vec<Pending> {
    let seqs: Vec<u64> = map
        .iter()
        .filter(|(_, p)| p.deadline <= now)
        .map(|(s, _)| *s)
        .collect();
    seqs.iter().filter_map(|s| map.remove(s)).collect()
}

/// Where the payload of announced message `seq` (`len` bytes) goes: straight into the receive
/// that cleared it, or nowhere when that receive has given up meanwhile.
fn cleared_payload(i: &mut In, seq: u64, len: usize) -> Result<Reading> {
    let into = match i.cleared.remove(&seq) {
        Some(p) if p.payload.bytes().len() == len => Into::Posted(p),
        Some(p) => {
            return Err(Error::Decode(format!(
                "the payload of point-to-point message '{}' has {len} bytes where {} were \
                 announced",
                p.name,
                p.payload.bytes().len()
            )))
        }
        None => Into::Discard,
    };
    Ok(Reading {
        seq,
        name: String::new(),
        len,
        got: 0,
        into,
    })
}

/// Receive `p` of rank `rank` takes announced message `seq` (`desc`, `len` bytes) from
/// `peer`: cleared, its payload to come straight into the receive, or both sides failed on a
/// disagreement.
fn clear(rank: usize, i: &mut In, peer: usize, (seq, desc, len): (u64, &str, usize), p: Pending) {
    match disagreement(rank, peer, desc, len, &p) {
        None => {
            answer(i, peer, frame::clear(seq));
            i.cleared.insert(seq, p);
        }
        Some(message) => refuse(i, peer, seq, p, message),
    }
}

/// Fails receive `p`, which message `seq` from `peer` cannot go into (`message` says why), and
/// answers the sender with the same text, with which it fails too.
fn refuse(i: &mut In, peer: usize, seq: u64, p: Pending, message: String) {
    let ack = Ack {
        seq,
        error: Some(message.clone()),
    };
    answer(i, peer, ack.encode());
    let name = p.name.clone();
    p.finish(mismatch(&name, message));
}

/// Why a message from `peer` described as `desc`, of `len` bytes, cannot go into
/// receive `p` (the text both sides fail with), or `None`.
fn disagreement(rank: usize, peer: usize, desc: &str, len: usize, p: &Pending) -> Option<String> {
    let mine = p.payload.bytes().len();
    (desc != p.desc || len != mine).then(|| {
        format!(
            "point-to-point message '{}': rank {peer} sends {desc} ({len} bytes) but rank {} \
             receives into {} ({mine} bytes)",
            p.name, rank, p.desc
        )
    })
}
