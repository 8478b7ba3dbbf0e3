//! A node of the control tree, on its own thread beside the rank's engine thread. Rank 0's
//! node is the root: it feeds every message that reaches it to the [`Negotiator`] and sends its
//! responses back down. Any other node (a rank with ranks below it) is a relay: it accepts the
//! control connections of the ranks below, passes their requests up and the responses down.
//! Beside the engine thread, negotiation for other process sets goes on while the rank is busy
//! in a collective.
//!
//! This file holds the node's thread and its turn; `handle.rs` what the engine holds of it,
//! `below.rs` what travels on the links below (messages in, answers out, a link lost),
//! `root.rs` what the root does with what reaches it, `up.rs` a relay's way up to its parent,
//! `accept.rs` how new control connections are taken in.

mod accept;
mod below;
mod handle;
mod root;
mod up;

use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use crate::bootstrap::ControlTree;
use crate::error::Result;
use crate::spin::Spin;

use super::autotune::{Autotuner, Knobs};
use super::connection::{ControlStream, FrameConn, OUTPUT_RETRY};
use super::lease::Lease;
use super::negotiate::{Gone, Negotiator, Outbox};
use super::relay::{self, Held, Links, Up};
use crate::sys::{wait_readable, Waker};

use accept::accept_all;
pub use handle::{Assist, Coordinator, CoordinatorConfig};

/// The coordinator thread: turn while there is work; when idle, spin only after work it did
/// itself (when rank 0's caller did it, stay out of that caller's way), then block. While
/// rank 0's caller holds the lease, sleep instead. A blocking wake-up costs 40-60 µs on the
/// VMs we measure; a small op's negotiation is a few of them in a row.
fn run(state: &Mutex<State>, stop: &AtomicBool, waker: &Waker, lease: &Lease) {
    let spin = state.lock().cfg.spin;
    let mut idle = Spin::new(spin);
    loop {
        let stopping = stop.load(Ordering::Acquire) && state.lock().may_stop();
        if let (false, Some(left)) = (stopping, lease.remaining()) {
            let _ = wait_readable(&[waker.fd()], left);
            waker.clear();
            continue;
        }
        let (fds, timeout) = {
            let st = state.lock();
            (st.fds(), st.timeout(stopping))
        };
        let start = Instant::now();
        let mut input = false;
        while !idle.over() && start.elapsed() < timeout {
            input = state.lock().has_input()
                || !wait_readable(&fds, Duration::ZERO)
                    .unwrap_or_default()
                    .is_empty();
            if input || !idle.yield_core() {
                break;
            }
        }
        if !input && !timeout.is_zero() && state.lock().arm() {
            let _ = wait_readable(&fds, timeout);
        }
        waker.clear();
        let mut st = state.lock();
        st.disarm();
        // Another thread may have turned the coordinator while we waited: poll afresh.
        if st.poll_and_turn(stopping, false) {
            idle = Spin::new(spin);
        }
        if stopping {
            st.close();
            return;
        }
    }
}

/// How often rank 0's caller, turning a coordinator whose connections are all rings, polls its
/// descriptors: new connections and hang-ups may wait this long to be seen while it spins.
const ASSIST_POLL: Duration = Duration::from_micros(50);

/// How long a node that was asked to stop serves ranks still running before it says so.
const LINGER_NOTICE: Duration = Duration::from_secs(5);

/// What rank 0's node does with what reaches it: negotiate.
struct Root {
    neg: Negotiator,
    ready_since: Option<Instant>,
    last_inspection: Instant,
    cycle_time: Duration,
    tuner: Option<Autotuner>,
    /// Ranks that sent `Leave`.
    left: Vec<bool>,
}

/// What any other node does: pass messages up and down.
struct Relay {
    /// The link to the parent's node, once every link below has connected.
    parent: Option<FrameConn>,
    /// How to make that link (it returns once every rank of the job has connected).
    connect: Option<ConnectUp>,
    /// Messages of the ranks below for the parent, sent once per turn.
    up: Up,
    /// Cached submissions held until every link below has made them.
    held: Held,
    /// The parent shut down cleanly (its `RankLeft` passed by).
    parent_left: bool,
    /// The path above is gone: links below were told and closed; nothing more runs.
    cut: bool,
}

/// A relay's connection to its parent's node (see [`CoordinatorConfig::parent`]).
pub type ConnectUp = Box<dyn FnOnce() -> Result<FrameConn> + Send>;

enum Role {
    Root(Box<Root>),
    Relay(Box<Relay>),
}

/// Everything a node keeps between turns.
struct State {
    cfg: CoordinatorConfig,
    listener: TcpListener,
    local: Option<UnixListener>,
    waker: Arc<Waker>,
    role: Role,
    /// Empty until the tree is known (`cfg.tree`): connections wait in the channel until then.
    links: Links,
    /// Indexed by the link's rank.
    conns: Vec<Option<FrameConn>>,
    registered: Vec<bool>,
    tx: mpsc::Sender<(usize, ControlStream)>,
    rx: mpsc::Receiver<(usize, ControlStream)>,
    out: Outbox,
    stopped: bool,
    /// When [`State::poll_and_turn`] last polled the descriptors.
    last_poll: Instant,
    /// When this node was asked to stop (it waits for the links below to close first).
    stop_asked: Option<Instant>,
    /// When a message last came from a link below.
    last_heard: Instant,
    /// Whether this node has said that it stays for ranks still running.
    lingering_told: bool,
}

impl State {
    fn new(
        listener: TcpListener,
        local: Option<UnixListener>,
        mut cfg: CoordinatorConfig,
        waker: Arc<Waker>,
    ) -> State {
        let links = match &cfg.tree {
            Some(tree) => Links::new(tree, cfg.rank),
            None => Links::none(cfg.rank),
        };
        let role = match cfg.parent.take() {
            Some(connect) => Role::Relay(Box::new(Relay {
                parent: None,
                connect: Some(connect),
                up: Vec::new(),
                held: Held::new(
                    cfg.size,
                    &cfg.process_sets,
                    relay::hold_for(cfg.stall_check),
                ),
                parent_left: false,
                cut: false,
            })),
            None => {
                let mut neg = Negotiator::new(
                    cfg.size,
                    &cfg.process_sets,
                    cfg.fusion_threshold,
                    cfg.cache_capacity,
                );
                let mut cycle_time = cfg.cycle_time;
                let tuner = cfg.autotune.clone().map(|a| {
                    neg.record_emitted();
                    Autotuner::new(
                        a,
                        Knobs {
                            fusion_threshold: cfg.fusion_threshold,
                            cycle_time: cfg.cycle_time,
                        },
                    )
                });
                if let Some(t) = &tuner {
                    let k = t.knobs();
                    neg.set_fusion_threshold(k.fusion_threshold);
                    cycle_time = k.cycle_time;
                }
                Role::Root(Box::new(Root {
                    neg,
                    ready_since: None,
                    last_inspection: Instant::now(),
                    cycle_time,
                    tuner,
                    left: vec![false; cfg.size],
                }))
            }
        };
        let (tx, rx) = mpsc::channel::<(usize, ControlStream)>();
        State {
            conns: (0..cfg.size).map(|_| None).collect(),
            registered: vec![false; cfg.size],
            cfg,
            listener,
            local,
            waker,
            role,
            links,
            tx,
            rx,
            out: Vec::new(),
            stopped: false,
            last_poll: Instant::now(),
            stop_asked: None,
            last_heard: Instant::now(),
            lingering_told: false,
        }
    }

    /// Links with an open connection, in the order [`State::fds`] lists them after the waker
    /// and the listeners.
    fn ranks(&self) -> Vec<usize> {
        (0..self.cfg.size)
            .filter(|&r| self.conns[r].is_some())
            .collect()
    }

    fn tree(&self) -> &ControlTree {
        tree_of(&self.cfg)
    }

    fn parent(&self) -> Option<&FrameConn> {
        match &self.role {
            Role::Relay(r) => r.parent.as_ref(),
            Role::Root(_) => None,
        }
    }

    /// Descriptors to wait on: the waker, the listeners (TCP, then the local one, if any),
    /// each open connection, then a relay's link to its parent.
    fn fds(&self) -> Vec<RawFd> {
        let mut fds = vec![self.waker.fd(), self.listener.as_raw_fd()];
        fds.extend(self.local.as_ref().map(AsRawFd::as_raw_fd));
        fds.extend(self.conns.iter().flatten().map(FrameConn::fd));
        fds.extend(self.parent().map(FrameConn::fd));
        fds
    }

    /// Index in [`State::fds`] of the first connection.
    fn first_conn(&self) -> usize {
        2 + usize::from(self.local.is_some())
    }

    /// How long an idle wait may block: until the batching window closes, if one is open, and
    /// briefly while answers wait to be written.
    fn timeout(&self, stopping: bool) -> Duration {
        if stopping || !self.out.is_empty() {
            return Duration::ZERO;
        }
        let window = match &self.role {
            Role::Root(root) => match root.ready_since {
                Some(t) => root.cycle_time.saturating_sub(t.elapsed()),
                None => Duration::from_secs(1),
            },
            // A node asked to stop looks again at the links below now and then.
            _ if self.stop_asked.is_some() => Duration::from_millis(20),
            Role::Relay(r) => r.held.deadline().map_or(Duration::from_secs(1), |d| {
                d.saturating_duration_since(Instant::now())
            }),
        };
        if self.has_output() {
            window.min(OUTPUT_RETRY)
        } else {
            window
        }
    }

    /// Whether a connection's ring holds input (no system call).
    fn has_input(&self) -> bool {
        self.conns.iter().flatten().any(FrameConn::has_input)
            || self.parent().is_some_and(FrameConn::has_input)
    }

    /// Before blocking on [`State::fds`]: arms every ring. False when input is already there.
    fn arm(&self) -> bool {
        // Arm them all even when one has input: `disarm` follows either way.
        let mut quiet = true;
        for c in self.conns.iter().flatten().chain(self.parent()) {
            quiet &= c.arm();
        }
        quiet
    }

    /// After a blocking wait: no ring needs ringing any more.
    fn disarm(&mut self) {
        for c in self.conns.iter_mut().flatten() {
            c.disarm(false);
        }
        if let Role::Relay(r) = &mut self.role {
            if let Some(p) = r.parent.as_mut() {
                p.disarm(false);
            }
        }
    }

    /// Whether the thread may stop now: once the links below have closed, or have sent
    /// nothing for the engine's timeout. Ranks finishing later than this one may still need
    /// the node, rank 0's above all, which negotiates every op (ranks of a process set without
    /// rank 0 go on among themselves; torch's destroy_process_group is no barrier), so it
    /// serves them while they use it. The root knows when none can: every set, and every one
    /// being registered, has this rank in it (a Horovod-API job's rank 0 that shuts down
    /// first), and then it stops at once, as its peers' next op fails anyway. Not in a job
    /// whose ranks may still register sets without it (`sets_may_come`): there the others'
    /// next group may be on its way (its members told of this rank's leaving, their ops that
    /// need it fail at once all the same).
    fn may_stop(&mut self) -> bool {
        let asked = *self.stop_asked.get_or_insert_with(Instant::now);
        let me = self.cfg.rank;
        if let Role::Root(root) = &self.role {
            if !root.neg.serves_without(me) && !self.cfg.sets_may_come {
                return true;
            }
        }
        let below_open = (0..self.cfg.size).any(|r| r != me && self.conns[r].is_some());
        let cut = matches!(&self.role, Role::Relay(r) if r.cut);
        let quiet = asked.max(self.last_heard).elapsed() >= self.cfg.timeout;
        if below_open && !quiet && asked.elapsed() >= LINGER_NOTICE && !self.lingering_told {
            self.lingering_told = true;
            let open: Vec<usize> = (0..self.cfg.size)
                .filter(|&r| r != me && self.conns[r].is_some())
                .collect();
            log::info!(
                target: crate::LOG_TARGET,
                "rank {me} has shut down but still serves the ranks that have not: {open:?} \
                 (it leaves once they have, or once they have sent nothing for {:?})",
                self.cfg.timeout
            );
        }
        !below_open || cut || quiet
    }

    /// Polls every descriptor without blocking and handles what is readable. Returns whether
    /// anything was received or sent. `assist`: this rank's caller is turning the node in a
    /// loop; when every connection is a ring, the descriptors (listeners, the waker, ring
    /// hang-ups) are polled at most every [`ASSIST_POLL`], saving a system call per turn.
    fn poll_and_turn(&mut self, stopping: bool, assist: bool) -> bool {
        let rings_only = self
            .conns
            .iter()
            .flatten()
            .chain(self.parent())
            .all(FrameConn::has_ring);
        let polled = if assist && rings_only && self.last_poll.elapsed() < ASSIST_POLL {
            Vec::new()
        } else {
            self.last_poll = Instant::now();
            wait_readable(&self.fds(), Duration::ZERO).unwrap_or_default()
        };
        let received = polled.iter().any(|&i| i > 0) || self.has_input();
        let sent = self.turn(&polled, stopping, !assist);
        received || sent
    }

    /// One turn: accept, read what `readable` (indexes into [`State::fds`]) says arrived,
    /// negotiate or pass on, inspect for stalls, flush and send. Returns whether anything was
    /// sent. `owner`: the node's thread, the only one that may consume a ring's wake-up bytes
    /// and clear its sleeping flag — the thread sleeps on them, so anyone else doing it could
    /// leave it asleep while messages arrive (until its poll times out).
    fn turn(&mut self, readable: &[usize], stopping: bool, owner: bool) -> bool {
        let ranks = self.ranks();
        let first = self.first_conn();
        if readable.iter().any(|&i| (1..first).contains(&i)) {
            accept_all(
                &self.listener,
                self.local.as_ref(),
                &self.cfg,
                &self.tx,
                &self.waker,
            );
        }
        let placed = self.cfg.tree.is_some();
        while let Some((rank, stream)) = placed.then(|| self.rx.try_recv().ok()).flatten() {
            let expected = self.links.expected().any(|l| l == rank);
            if expected && self.conns[rank].is_none() && !self.registered[rank] {
                if let Ok(c) = FrameConn::new(stream, rank) {
                    self.conns[rank] = Some(c);
                    self.registered[rank] = true;
                    if self.links.expected().all(|l| self.registered[l]) {
                        self.all_connected();
                    }
                }
            }
        }
        for (i, &rank) in ranks.iter().enumerate() {
            let rang = readable.contains(&(i + first));
            if let Some(c) = self.conns[rank].as_mut() {
                if rang && owner {
                    c.disarm(true);
                } else if !rang && !stopping && !c.has_input() {
                    continue;
                }
            }
            self.receive(rank);
        }
        let parent_at = first + ranks.len();
        if let Role::Relay(relay) = &mut self.role {
            if let Some(p) = relay.parent.as_mut() {
                let rang = readable.contains(&parent_at);
                if rang && owner {
                    p.disarm(true);
                }
                if rang || p.has_input() || stopping {
                    self.read_parent();
                }
            }
        }
        match &mut self.role {
            Role::Root(root) => root.cycle(&self.cfg, stopping, &mut self.out),
            Role::Relay(relay) => {
                if relay.held.deadline().is_some_and(|d| d <= Instant::now()) {
                    relay
                        .held
                        .expire(&self.links, Instant::now(), &mut relay.up);
                }
            }
        }
        let sent = !self.out.is_empty();
        let flushed = self.flush_pending();
        self.send_out();
        let went_up = self.send_up();
        sent || flushed || went_up
    }

    /// Writes answers that connections could not take on earlier turns. Returns whether any
    /// bytes went out.
    fn flush_pending(&mut self) -> bool {
        let mut moved = false;
        for to in 0..self.conns.len() {
            let Some(conn) = self.conns[to].as_mut().filter(|c| c.has_output()) else {
                continue;
            };
            match conn.flush(self.cfg.timeout) {
                Ok(m) => moved |= m,
                Err(e) => self.drop_conn(to, e),
            }
        }
        if let Role::Relay(relay) = &mut self.role {
            if let Some(p) = relay.parent.as_mut().filter(|p| p.has_output()) {
                match p.flush(self.cfg.timeout) {
                    Ok(m) => moved |= m,
                    Err(e) => self.cut_off(self.path_closed(false, e.to_string())),
                }
            }
        }
        moved
    }

    /// Whether some connection has answers waiting to be written.
    fn has_output(&self) -> bool {
        self.conns
            .iter()
            .flatten()
            .chain(self.parent())
            .any(FrameConn::has_output)
    }

    fn close(&mut self) {
        self.stopped = true;
        // Last messages up before the links below close.
        self.send_up();
        for c in self.conns.iter_mut().flatten() {
            // Last answers (a failure notice, the shutdown) before the hang-up.
            let _ = c.flush_all(self.cfg.timeout);
            c.close();
        }
        if let Role::Relay(relay) = &mut self.role {
            if let Some(mut p) = relay.parent.take() {
                let _ = p.flush_all(self.cfg.timeout);
                p.close();
            }
        }
    }
}

/// The node's control tree: a relay has it from the start, the coordinator before any link
/// registers (nothing that needs it runs earlier).
fn tree_of(cfg: &CoordinatorConfig) -> &ControlTree {
    cfg.tree.as_ref().expect("placed before any link registers")
}

fn gone(left: bool) -> Gone {
    if left {
        Gone::Left
    } else {
        Gone::Died
    }
}
