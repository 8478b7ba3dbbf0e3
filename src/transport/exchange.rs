//! The exchange loop every transport runs ([`run`]), written once.
//!
//! What is the same whatever the links: checking the [`Transport`](super::Transport) contract
//! on the transfers, copying transfers to this rank itself, progressing all the others in
//! passes, the waiting rhythm between passes ([`Pacer`]) and the error of a stalled exchange.
//! What a transport brings is its [`Links`]: how to move bytes on one transfer's link, and how
//! to sleep until some link of the unfinished transfers can move.

use std::time::{Duration, Instant};

use super::Xfer;
use crate::error::{Error, Result};
use crate::spin::Spin;

/// One transport's links, borrowed for one [`run`], together with whatever [`Links::wait`]
/// reuses from one sleep to the next.
pub(super) trait Links {
    /// Moves what can move now on `x` without blocking, advancing `off` (bytes of `x` done);
    /// returns whether any byte moved. `x` is with another rank and has bytes left. An error
    /// (a lost peer is `Error::PeerLost`) ends the exchange with that error.
    fn progress(&mut self, x: &mut Xfer<'_>, off: &mut usize) -> Result<bool>;

    /// Sleeps, for at most `left`, until one of the transfers `active` names (index into
    /// `xfers`, bytes done) may move again or fail (its peer gone). Waking early costs only
    /// another pass; a missed wake-up costs the whole of `left`. Runs on every sleep of an
    /// exchange, so it reuses its buffers instead of allocating.
    fn wait(&mut self, xfers: &[Xfer<'_>], active: &[(usize, usize)], left: Duration)
        -> Result<()>;
}

/// Runs `xfers` to completion on `links` for rank `rank` of `size`: the whole of
/// [`Transport::exchange`](super::Transport::exchange) except the check for an aborted
/// transport.
///
/// - `InvalidArgument` for transfers that break the contract (a rank out of range, a second
///   send or receive with one peer, a send to this rank that the receive does not match), with
///   nothing moved; transfers to this rank are copied before any other moves.
/// - Each pass calls [`Links::progress`] once for every unfinished transfer, in `xfers` order.
/// - After a pass that moved nothing, passes go on (yielding the core) for `spin`, then
///   [`Links::wait`] sleeps for what is left of `idle_timeout` since the last byte moved.
/// - `Error::Timeout` naming every peer still waited for, and how far each transfer got, once
///   nothing moved for `idle_timeout`.
/// - An error from `links` ends the call at once, as it is, the other transfers left part done.
///
/// The list of unfinished transfers is allocated once per call; a pass allocates nothing.
pub(super) fn run(
    rank: usize,
    size: usize,
    spin: Duration,
    links: &mut impl Links,
    xfers: &mut [Xfer<'_>],
    idle_timeout: Duration,
) -> Result<()> {
    check_and_copy_self(rank, size, xfers)?;
    // (index into xfers, bytes done) for every transfer that needs a link.
    let mut active: Vec<(usize, usize)> = xfers
        .iter()
        .enumerate()
        .filter(|(_, x)| x.peer() != rank && xfer_len(x) > 0)
        .map(|(i, _)| (i, 0))
        .collect();
    let mut pacer = Pacer::new(spin, idle_timeout);
    loop {
        let mut moved = false;
        for (i, off) in active.iter_mut() {
            moved |= links.progress(&mut xfers[*i], off)?;
        }
        active.retain(|&(i, off)| off < xfer_len(&xfers[i]));
        if active.is_empty() {
            return Ok(());
        }
        let left = match pacer.after_pass(moved) {
            Pace::Again => continue,
            Pace::TimedOut => return Err(stalled_error(xfers, &active, idle_timeout)),
            Pace::Block(left) => left,
        };
        links.wait(xfers, &active, left)?;
    }
}

/// Checks the contract on `xfers` for rank `rank` of `size` and performs transfers to `rank`
/// itself (a matching send/receive pair is a copy).
fn check_and_copy_self(rank: usize, size: usize, xfers: &mut [Xfer<'_>]) -> Result<()> {
    let mut seen = vec![0u8; size];
    let (mut self_send, mut self_recv) = (None, None);
    for (i, x) in xfers.iter().enumerate() {
        let peer = x.peer();
        if peer >= size {
            return Err(Error::InvalidArgument(format!(
                "transfer with rank {peer} in a job of {size} ranks"
            )));
        }
        let bit = if matches!(x, Xfer::Send { .. }) { 1 } else { 2 };
        if seen[peer] & bit != 0 {
            return Err(Error::InvalidArgument(format!(
                "more than one {} with rank {peer} in one exchange",
                if bit == 1 { "send" } else { "receive" }
            )));
        }
        seen[peer] |= bit;
        if peer == rank {
            if bit == 1 {
                self_send = Some(i);
            } else {
                self_recv = Some(i);
            }
        }
    }
    let len = |i: Option<usize>| i.map_or(0, |i| xfer_len(&xfers[i]));
    let (ls, lr) = (len(self_send), len(self_recv));
    if ls != lr {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} sends {ls} bytes to itself but receives {lr}"
        )));
    }
    if let (Some(s), Some(r)) = (self_send, self_recv) {
        let src: &[u8] = match &xfers[s] {
            Xfer::Send { buf, .. } => buf,
            Xfer::Recv { .. } => unreachable!(),
        };
        if let Xfer::Recv { buf, .. } = &mut xfers[r] {
            crate::sys::copy::copy(buf, src);
        }
    }
    Ok(())
}

fn xfer_len(x: &Xfer<'_>) -> usize {
    match x {
        Xfer::Send { buf, .. } => buf.len(),
        Xfer::Recv { buf, .. } => buf.len(),
    }
}

/// What the exchange loop does after one pass over its transfers (see [`Pacer`]).
#[derive(Debug, PartialEq, Eq)]
enum Pace {
    /// Make another pass at once.
    Again,
    /// Block (in poll) for at most this long.
    Block(Duration),
    /// Nothing moved for the whole idle timeout.
    TimedOut,
}

/// The waiting rhythm of the exchange loop: after a pass that moved bytes, go again;
/// otherwise spin (yielding) for `spin`, then block until the idle timeout runs out.
struct Pacer {
    spin: Duration,
    idle_timeout: Duration,
    last_progress: Instant,
    /// The spin after the last pass that moved bytes; `None` until a pass moves none.
    spinning: Option<Spin>,
}

impl Pacer {
    fn new(spin: Duration, idle_timeout: Duration) -> Pacer {
        Pacer {
            spin,
            idle_timeout,
            last_progress: Instant::now(),
            spinning: None,
        }
    }

    /// Decides the next step after a pass; `moved` says whether it moved any byte.
    fn after_pass(&mut self, moved: bool) -> Pace {
        let now = Instant::now();
        if moved {
            self.last_progress = now;
            self.spinning = None;
            return Pace::Again;
        }
        match &mut self.spinning {
            None => {
                self.spinning = Some(Spin::new(self.spin));
                return Pace::Again;
            }
            // Yield rather than pause: when ranks outnumber free cores the peer we wait for
            // may be queued on this very core (measured: 4-byte round trip 15 µs with yield,
            // 80-105 µs with a pure spin, on a loaded 2-core VM).
            Some(spin) => {
                if spin.yield_core() {
                    return Pace::Again;
                }
            }
        }
        // Spun long enough, the core is wanted, or we just woke from poll with nothing to do:
        // block.
        let left = self.idle_timeout.saturating_sub(now - self.last_progress);
        if left.is_zero() {
            Pace::TimedOut
        } else {
            Pace::Block(left)
        }
    }
}

/// The error of an exchange whose `active` transfers (index into `xfers`, bytes done) made no
/// progress for `idle`: names every peer waited for and how far each transfer got.
fn stalled_error(xfers: &[Xfer<'_>], active: &[(usize, usize)], idle: Duration) -> Error {
    let waits: Vec<String> = active
        .iter()
        .map(|&(i, off)| match &xfers[i] {
            Xfer::Send { peer, buf } => format!("rank {peer} (sent {off} of {} bytes)", buf.len()),
            Xfer::Recv { peer, buf } => {
                format!("rank {peer} (received {off} of {} bytes)", buf.len())
            }
        })
        .collect();
    Error::Timeout {
        what: format!("waiting for {}", waits.join(", ")),
        after: idle,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Links that move one byte after each sleep (a receive reads its peer's rank), none at
    /// all when `stuck`, or fail with `PeerLost { rank: fail }` after the first byte; and that
    /// check what the loop asks of them.
    struct Trickle {
        rank: usize,
        stuck: bool,
        fail: Option<usize>,
        budget: usize,
        moved: usize,
        sleeps: usize,
    }

    impl Trickle {
        fn new(rank: usize) -> Trickle {
            Trickle {
                rank,
                stuck: false,
                fail: None,
                budget: 1,
                moved: 0,
                sleeps: 0,
            }
        }
    }

    impl Links for Trickle {
        fn progress(&mut self, x: &mut Xfer<'_>, off: &mut usize) -> Result<bool> {
            assert!(
                x.peer() != self.rank && *off < xfer_len(x),
                "{x:?} at {off}"
            );
            if let Some(rank) = self.fail.filter(|_| self.moved > 0) {
                let detail = "test".into();
                return Err(Error::PeerLost { rank, detail });
            }
            if self.stuck || self.budget == 0 {
                return Ok(false);
            }
            if let Xfer::Recv { peer, buf } = x {
                buf[*off] = *peer as u8;
            }
            *off += 1;
            self.budget -= 1;
            self.moved += 1;
            Ok(true)
        }

        fn wait(
            &mut self,
            xfers: &[Xfer<'_>],
            active: &[(usize, usize)],
            left: Duration,
        ) -> Result<()> {
            assert!(!active.is_empty());
            for &(i, off) in active {
                assert!(xfers[i].peer() != self.rank && off < xfer_len(&xfers[i]));
            }
            self.sleeps += 1;
            if self.stuck {
                std::thread::sleep(left);
            }
            self.budget = 1;
            Ok(())
        }
    }

    const LONG: Duration = Duration::from_secs(60);

    #[test]
    fn every_transfer_runs_to_the_end_and_only_those_with_a_peer_touch_links() {
        let (to_1, mut from_2, to_me, mut from_me) = ([7u8; 3], [0u8; 4], [9u8; 2], [0u8; 2]);
        let mut xfers = [
            Xfer::Send {
                peer: 1,
                buf: &to_1,
            },
            Xfer::Recv {
                peer: 2,
                buf: &mut from_2,
            },
            Xfer::Send {
                peer: 0,
                buf: &to_me,
            },
            Xfer::Recv {
                peer: 0,
                buf: &mut from_me,
            },
            Xfer::Send { peer: 3, buf: &[] },
        ];
        let mut links = Trickle::new(0);
        run(0, 4, Duration::ZERO, &mut links, &mut xfers, LONG).unwrap();
        assert_eq!(links.moved, 7);
        // One byte per sleep: the loop slept between bytes, and not after the last.
        assert_eq!(links.sleeps, 6);
        assert_eq!(from_2, [2; 4]);
        assert_eq!(from_me, to_me);
    }

    #[test]
    fn a_broken_contract_moves_nothing() {
        let (a, b) = ([1u8; 2], [2u8; 2]);
        let mut xfers = [
            Xfer::Send { peer: 1, buf: &a },
            Xfer::Send { peer: 1, buf: &b },
        ];
        let mut links = Trickle::new(0);
        let e = run(0, 2, Duration::ZERO, &mut links, &mut xfers, LONG).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(links.moved, 0);
    }

    #[test]
    fn a_link_error_ends_the_exchange_as_it_is() {
        let mut into = [0u8; 4];
        let mut xfers = [Xfer::Recv {
            peer: 1,
            buf: &mut into,
        }];
        let mut links = Trickle::new(0);
        links.fail = Some(1);
        let e = run(0, 2, Duration::ZERO, &mut links, &mut xfers, LONG).unwrap_err();
        assert!(matches!(e, Error::PeerLost { rank: 1, .. }), "{e}");
    }

    #[test]
    fn nothing_moving_for_the_idle_timeout_is_a_timeout_naming_the_peers() {
        let data = [0u8; 5];
        let mut xfers = [Xfer::Send {
            peer: 1,
            buf: &data,
        }];
        let mut links = Trickle::new(0);
        links.stuck = true;
        let idle = Duration::from_millis(30);
        let start = Instant::now();
        let e = run(0, 2, Duration::from_millis(1), &mut links, &mut xfers, idle).unwrap_err();
        assert!(start.elapsed() >= idle);
        match e {
            Error::Timeout { what, after } => {
                assert_eq!(what, "waiting for rank 1 (sent 0 of 5 bytes)");
                assert_eq!(after, idle);
            }
            e => panic!("expected a timeout, got {e}"),
        }
        assert!(links.sleeps >= 1);
    }

    #[test]
    fn pacer_spins_then_blocks_then_times_out() {
        let mut p = Pacer::new(Duration::ZERO, Duration::from_millis(50));
        assert_eq!(p.after_pass(true), Pace::Again);
        // The first idle pass starts the (empty) spin; the next one blocks for what is left.
        assert_eq!(p.after_pass(false), Pace::Again);
        match p.after_pass(false) {
            Pace::Block(left) => assert!(left <= Duration::from_millis(50) && !left.is_zero()),
            other => panic!("expected Block, got {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(p.after_pass(false), Pace::TimedOut);
        // Progress resets the idle clock.
        assert_eq!(p.after_pass(true), Pace::Again);
        assert_eq!(p.after_pass(false), Pace::Again);
        assert!(matches!(p.after_pass(false), Pace::Block(_)));
    }

    #[test]
    fn a_stall_names_each_peer_and_how_far_it_got() {
        let data = [0u8; 8];
        let mut into = [0u8; 4];
        let xfers = [
            Xfer::Send {
                peer: 1,
                buf: &data,
            },
            Xfer::Recv {
                peer: 2,
                buf: &mut into,
            },
        ];
        let e = stalled_error(&xfers, &[(0, 3), (1, 0)], Duration::from_secs(2)).to_string();
        assert!(e.contains("rank 1 (sent 3 of 8 bytes)"), "{e}");
        assert!(e.contains("rank 2 (received 0 of 4 bytes)"), "{e}");
    }
}
