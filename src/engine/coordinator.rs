//! The coordinator thread (rank 0 only): accepts every rank's control connection, feeds their
//! messages to the [`Negotiator`], and sends its responses back. It runs beside rank 0's own
//! engine thread, so negotiation for other process sets goes on while rank 0 is busy in a
//! collective.

use std::net::{TcpListener, TcpStream};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bootstrap::{auth, net};
use crate::error::{Error, Result};

use super::autotune::{AutotuneConfig, Autotuner, Knobs};
use super::control::FrameConn;
use super::message::{FromCoordinator, ToCoordinator};
use super::negotiate::{Gone, Negotiator, Outbox};
use super::sys::{wait_readable, Waker};

/// Settings the coordinator needs.
pub struct CoordinatorConfig {
    /// Ranks in the job.
    pub size: usize,
    /// Job secret.
    pub secret: Vec<u8>,
    /// Static process sets (ids 1..).
    pub process_sets: Vec<Vec<usize>>,
    /// Fusion limit in bytes.
    pub fusion_threshold: usize,
    /// Response cache capacity per set.
    pub cache_capacity: usize,
    /// Batching window.
    pub cycle_time: Duration,
    /// Bound on authentication and sends.
    pub timeout: Duration,
    /// Stall inspector warning time (`None`: disabled).
    pub stall_check: Option<Duration>,
    /// Stall shutdown time.
    pub stall_shutdown: Option<Duration>,
    /// Online tuning of the fusion threshold and cycle time.
    pub autotune: Option<AutotuneConfig>,
    /// How long an idle wait polls (yielding) before it blocks.
    pub spin: Duration,
}

/// A running coordinator; dropping it (or `stop`) ends the thread.
pub struct Coordinator {
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl Coordinator {
    /// Starts the coordinator on `listener`.
    pub fn start(listener: TcpListener, cfg: CoordinatorConfig) -> Result<Coordinator> {
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let waker = Arc::new(Waker::new()?);
        let (s, w) = (stop.clone(), waker.clone());
        let thread = std::thread::Builder::new()
            .name("ferrovod-coordinator".into())
            .spawn(move || run(listener, cfg, s, w))
            .map_err(|e| Error::Io(format!("spawning the coordinator: {e}")))?;
        Ok(Coordinator {
            stop,
            waker,
            thread: Some(thread),
        })
    }

    /// Processes what is already received (e.g. this rank's `Leave`), then stops.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Which of `fds` are readable within `timeout`: polled without blocking (yielding the core
/// between polls) for up to `spin`, then blocking. A blocking wake-up costs 40-60 µs on the
/// VMs we measure; a small op's negotiation is a few of them in a row.
fn wait_idle(fds: &[RawFd], timeout: Duration, spin: Duration) -> Vec<usize> {
    if !spin.is_zero() && !timeout.is_zero() {
        let start = Instant::now();
        while start.elapsed() < spin.min(timeout) {
            let ready = wait_readable(fds, Duration::ZERO).unwrap_or_default();
            if !ready.is_empty() {
                return ready;
            }
            std::thread::yield_now();
        }
    }
    wait_readable(fds, timeout).unwrap_or_default()
}

fn run(listener: TcpListener, cfg: CoordinatorConfig, stop: Arc<AtomicBool>, waker: Arc<Waker>) {
    let mut neg = Negotiator::new(
        cfg.size,
        &cfg.process_sets,
        cfg.fusion_threshold,
        cfg.cache_capacity,
    );
    let mut conns: Vec<Option<FrameConn>> = (0..cfg.size).map(|_| None).collect();
    let mut left = vec![false; cfg.size];
    let mut registered = vec![false; cfg.size];
    let (tx, rx) = mpsc::channel::<(usize, TcpStream)>();
    let mut out: Outbox = Vec::new();
    let mut ready_since: Option<Instant> = None;
    let mut last_inspection = Instant::now();
    let mut cycle_time = cfg.cycle_time;
    let mut tuner = cfg.autotune.clone().map(|a| {
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
    loop {
        let stopping = stop.load(Ordering::Acquire);
        let mut fds = vec![waker.fd(), std::os::fd::AsRawFd::as_raw_fd(&listener)];
        let ranks: Vec<usize> = (0..cfg.size).filter(|&r| conns[r].is_some()).collect();
        fds.extend(
            ranks
                .iter()
                .map(|&r| conns[r].as_ref().expect("listed").fd()),
        );
        let timeout = if stopping {
            Duration::ZERO
        } else {
            match ready_since {
                Some(t) => cycle_time.saturating_sub(t.elapsed()),
                None => Duration::from_secs(1),
            }
        };
        let readable = wait_idle(&fds, timeout, cfg.spin);
        waker.clear();
        if readable.contains(&1) {
            accept_all(&listener, &cfg, &tx, &waker);
        }
        while let Ok((rank, stream)) = rx.try_recv() {
            if rank < cfg.size && conns[rank].is_none() && !registered[rank] {
                if let Ok(c) = FrameConn::new(stream, rank) {
                    conns[rank] = Some(c);
                    registered[rank] = true;
                    if registered.iter().all(|&r| r) {
                        for r in 0..cfg.size {
                            out.push((r, FromCoordinator::Ready));
                        }
                    }
                }
            }
        }
        for (i, &rank) in ranks.iter().enumerate() {
            if !stopping && !readable.contains(&(i + 2)) {
                continue;
            }
            let Some(conn) = conns[rank].as_mut() else {
                continue;
            };
            let open = conn.fill();
            loop {
                match conn.next_frame() {
                    Ok(Some(frame)) => match ToCoordinator::decode(&frame) {
                        Ok(msg) => {
                            if msg == ToCoordinator::Leave {
                                left[rank] = true;
                            }
                            neg.handle(rank, msg, &mut out);
                        }
                        Err(e) => {
                            neg.rank_gone(
                                rank,
                                Gone::Died,
                                format!("sent a malformed message ({e})"),
                                &mut out,
                            );
                            break;
                        }
                    },
                    Ok(None) => break,
                    Err(e) => {
                        neg.rank_gone(rank, Gone::Died, e.to_string(), &mut out);
                        break;
                    }
                }
            }
            match open {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    let detail = match open {
                        Err(e) => e.to_string(),
                        _ => "its connection closed (the process exited or was killed)".into(),
                    };
                    neg.rank_gone(rank, gone(left[rank]), detail, &mut out);
                    conns[rank] = None;
                }
            }
        }
        if let Some(check) = cfg.stall_check {
            // Cheap, but not worth doing for every message: a few times a second is plenty
            // for limits counted in seconds.
            if last_inspection.elapsed() >= Duration::from_millis(250) {
                last_inspection = Instant::now();
                if let Some(warning) = neg.inspect(last_inspection, check, cfg.stall_shutdown) {
                    log::warn!(target: crate::LOG_TARGET, "{warning}");
                }
            }
        }
        if neg.has_ready() {
            let since = *ready_since.get_or_insert_with(Instant::now);
            if stopping || since.elapsed() >= cycle_time {
                neg.flush(&mut out);
                ready_since = None;
                if let Some(t) = tuner.as_mut() {
                    for (name, bytes) in neg.take_emitted() {
                        if let Some(k) = t.observe(&name, bytes) {
                            neg.set_fusion_threshold(k.fusion_threshold);
                            cycle_time = k.cycle_time;
                        }
                    }
                    if t.settled() {
                        tuner = None;
                        neg.stop_recording_emitted();
                    }
                }
            }
        }
        for (to, msg) in out.drain(..) {
            let bytes = msg.encode();
            if let Some(conn) = conns[to].as_mut() {
                if let Err(e) = conn.send(&bytes, cfg.timeout) {
                    conn.close();
                    conns[to] = None;
                    let mut more = Vec::new();
                    neg.rank_gone(to, gone(left[to]), e.to_string(), &mut more);
                    // Notices about this failure go out on the next turn of the loop.
                    neg.flush(&mut more);
                    for (t, m) in more {
                        if let Some(c) = conns[t].as_mut() {
                            let _ = c.send(&m.encode(), cfg.timeout);
                        }
                    }
                }
            }
        }
        if stopping {
            for c in conns.iter().flatten() {
                c.close();
            }
            return;
        }
    }
}

fn gone(left: bool) -> Gone {
    if left {
        Gone::Left
    } else {
        Gone::Died
    }
}

/// Accepts pending connections; each is authenticated on its own short-lived thread so that a
/// slow or hostile client cannot stall negotiation.
fn accept_all(
    listener: &TcpListener,
    cfg: &CoordinatorConfig,
    tx: &mpsc::Sender<(usize, TcpStream)>,
    waker: &Arc<Waker>,
) {
    while let Ok((mut stream, _)) = listener.accept() {
        let (tx, waker) = (tx.clone(), waker.clone());
        let (secret, timeout) = (cfg.secret.clone(), cfg.timeout);
        let _ = std::thread::Builder::new()
            .name("ferrovod-accept".into())
            .spawn(move || {
                let hello = (|| -> Result<usize> {
                    stream.set_nonblocking(false)?;
                    auth::authenticate(&mut stream, &secret, false, timeout)?;
                    stream.set_read_timeout(Some(timeout))?;
                    let frame = net::read_frame(&mut stream, 1024)?;
                    match ToCoordinator::decode(&frame)? {
                        ToCoordinator::Hello { rank } => Ok(rank),
                        _ => Err(Error::Decode("expected hello".into())),
                    }
                })();
                match hello {
                    Ok(rank) => {
                        let _ = stream.set_read_timeout(None);
                        let _ = super::sys::detect_unreachable_peer(
                            std::os::fd::AsRawFd::as_raw_fd(&stream),
                            timeout,
                        );
                        let _ = tx.send((rank, stream));
                        waker.wake();
                    }
                    Err(e) => log::warn!(
                        target: crate::LOG_TARGET,
                        "coordinator dropped a connection from {}: {e}",
                        stream
                            .peer_addr()
                            .map_or_else(|_| "an unknown address".into(), |a| a.to_string())
                    ),
                }
            });
    }
}
