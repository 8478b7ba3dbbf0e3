//! Mutual HMAC-SHA256 challenge-response on a fresh connection, and the job secret.
//!
//! Every connection of a job (rendezvous and data) runs [`authenticate`] before anything else
//! is read from it. The exchange, with `I` the initiator (the side that connected) and `R`
//! the responder:
//!
//! ```text
//! I -> R   "FVA1" || nonce_I (32 random bytes)
//! R -> I   "FVA1" || nonce_R
//! I -> R   HMAC(secret, "ferrovod-auth-v1" || 'I' || nonce_I || nonce_R)
//! R        verifies (constant time); on failure sends 0x00 and closes
//! R -> I   0x01 || HMAC(secret, "ferrovod-auth-v1" || 'R' || nonce_R || nonce_I)
//! I        verifies
//! ```
//!
//! The responder proves itself only after the initiator has, so a stranger never obtains a
//! MAC computed with the secret. Fresh nonces on both sides defeat replay, and the role byte
//! stops a proof being reflected back. Every read has a fixed size and the whole exchange
//! finishes within the caller's timeout.

use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::net::{deadline_after, read_exact_until, write_all_until, Stream};
// The frame helpers live in `net`; re-exported here because every authenticated connection
// speaks frames right after the handshake.
pub use super::net::{read_frame, read_frame_until, write_frame};
use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

const MAGIC: &[u8; 4] = b"FVA1";
const LABEL: &[u8] = b"ferrovod-auth-v1";
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const ACCEPTED: u8 = 1;
const REJECTED: u8 = 0;

/// Length in bytes of the secrets made by [`random_secret`].
pub const SECRET_LEN: usize = 32;

/// A fresh random job secret of [`SECRET_LEN`] bytes from the OS generator.
pub fn random_secret() -> Vec<u8> {
    let mut s = vec![0u8; SECRET_LEN];
    // The OS generator failing means the machine cannot make any secret at all; no caller
    // could do anything sensible with an error here.
    getrandom::fill(&mut s).expect("the OS random number generator failed");
    s
}

/// Lower-case hex encoding of a secret (how the launcher passes it in `FERROVOD_SECRET`).
pub fn secret_to_hex(secret: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(secret.len() * 2);
    for &b in secret {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

/// Decodes [`secret_to_hex`]'s output (either case; surrounding whitespace ignored).
/// Anything else is `Error::InvalidArgument` — the message never echoes the input.
pub fn secret_from_hex(hex: &str) -> Result<Vec<u8>> {
    let hex = hex.trim().as_bytes();
    if hex.len() % 2 != 0 {
        return Err(Error::InvalidArgument(
            "job secret: hex string has an odd number of digits".into(),
        ));
    }
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    hex.chunks_exact(2)
        .map(|p| match (digit(p[0]), digit(p[1])) {
            (Some(h), Some(l)) => Ok(h << 4 | l),
            _ => Err(Error::InvalidArgument(
                "job secret: not a hex string".into(),
            )),
        })
        .collect()
}

fn new_mac(secret: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length, so this cannot fail.
    <HmacSha256 as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length")
}

fn proof_mac(secret: &[u8], role: u8, own: &[u8], peer: &[u8]) -> HmacSha256 {
    let mut mac = new_mac(secret);
    mac.update(LABEL);
    mac.update(&[role]);
    mac.update(own);
    mac.update(peer);
    mac
}

/// Proves knowledge of `secret` to the peer on `stream` and checks that the peer knows it too.
///
/// `initiator` is true on the side that opened the connection. The stream is put in blocking
/// mode, and on success is left with no read/write timeouts. Errors: `Error::Auth` when either
/// side used another secret or the peer is not speaking this protocol, `Error::Timeout` when
/// the exchange does not finish within `timeout`, `Error::Io` on a closed connection.
pub fn authenticate(
    stream: &mut impl Stream,
    secret: &[u8],
    initiator: bool,
    timeout: Duration,
) -> Result<()> {
    let deadline = deadline_after(timeout);
    stream.set_nonblocking(false)?;
    let result = exchange_proofs(stream, secret, initiator, deadline);
    if result.is_ok() {
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
    }
    result
}

fn exchange_proofs(
    stream: &mut impl Stream,
    secret: &[u8],
    initiator: bool,
    deadline: Instant,
) -> Result<()> {
    let what = "authenticating a connection";
    let mut own = [0u8; NONCE_LEN];
    getrandom::fill(&mut own).map_err(|e| Error::Io(format!("random nonce: {e}")))?;

    let mut hello = [0u8; 4 + NONCE_LEN];
    hello[..4].copy_from_slice(MAGIC);
    hello[4..].copy_from_slice(&own);
    write_all_until(stream, &hello, deadline, what)?;
    let mut peer_hello = [0u8; 4 + NONCE_LEN];
    read_exact_until(stream, &mut peer_hello, deadline, what)?;
    if &peer_hello[..4] != MAGIC {
        return Err(Error::Auth(
            "peer is not a ferrovod endpoint of this version (bad greeting)".into(),
        ));
    }
    let peer = &peer_hello[4..];
    if peer == own {
        // Only a peer echoing our bytes back can produce this.
        return Err(Error::Auth("peer reflected our challenge".into()));
    }

    if initiator {
        let proof = proof_mac(secret, b'I', &own, peer).finalize().into_bytes();
        write_all_until(stream, &proof, deadline, what)?;
        let mut status = [0u8; 1];
        read_exact_until(stream, &mut status, deadline, what)?;
        match status[0] {
            ACCEPTED => {}
            REJECTED => {
                return Err(Error::Auth(
                    "the peer rejected our proof (different job secret)".into(),
                ))
            }
            _ => return Err(Error::Auth("malformed authentication reply".into())),
        }
        let mut theirs = [0u8; MAC_LEN];
        read_exact_until(stream, &mut theirs, deadline, what)?;
        proof_mac(secret, b'R', peer, &own)
            .verify_slice(&theirs)
            .map_err(|_| Error::Auth("the peer does not know the job secret".into()))
    } else {
        let mut theirs = [0u8; MAC_LEN];
        read_exact_until(stream, &mut theirs, deadline, what)?;
        if proof_mac(secret, b'I', peer, &own)
            .verify_slice(&theirs)
            .is_err()
        {
            // Best effort: tell an honest peer with another secret why it is being dropped.
            let _ = write_all_until(stream, &[REJECTED], deadline, what);
            return Err(Error::Auth(
                "the connecting peer does not know the job secret".into(),
            ));
        }
        let mut reply = [0u8; 1 + MAC_LEN];
        reply[0] = ACCEPTED;
        reply[1..].copy_from_slice(&proof_mac(secret, b'R', &own, peer).finalize().into_bytes());
        write_all_until(stream, &reply, deadline, what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (c, l.accept().unwrap().0)
    }

    /// Runs both sides of the handshake; (initiator's result, responder's result).
    fn handshake(a: &'static [u8], b: &'static [u8]) -> (Result<()>, Result<()>) {
        let (mut c, mut s) = pair();
        let t = Duration::from_secs(5);
        let h = std::thread::spawn(move || authenticate(&mut s, b, false, t));
        let ri = authenticate(&mut c, a, true, t);
        (ri, h.join().unwrap())
    }

    #[test]
    fn same_secret_passes_and_stream_stays_usable() {
        let (mut c, mut s) = pair();
        let t = Duration::from_secs(5);
        let h = std::thread::spawn(move || {
            authenticate(&mut s, b"k", false, t).unwrap();
            super::read_frame(&mut s, 100).unwrap()
        });
        authenticate(&mut c, b"k", true, t).unwrap();
        super::write_frame(&mut c, b"after").unwrap();
        assert_eq!(h.join().unwrap(), b"after");
    }

    #[test]
    fn different_secrets_fail_on_both_sides() {
        for (a, b) in [(&b"k1"[..], &b"k2"[..]), (b"", b"k"), (b"k", b"")] {
            let (ri, rr) = handshake(a, b);
            assert!(matches!(ri, Err(Error::Auth(_))), "{ri:?}");
            assert!(matches!(rr, Err(Error::Auth(_))), "{rr:?}");
        }
        let (ri, rr) = handshake(b"", b"");
        assert!(ri.is_ok() && rr.is_ok());
    }

    #[test]
    fn garbage_and_silence_fail_within_the_timeout() {
        let t = Duration::from_millis(300);
        for junk in [&b""[..], b"FVA1", &[0u8; 36], &[0xAB; 500]] {
            for initiator in [true, false] {
                let (mut me, mut other) = pair();
                other.write_all(junk).unwrap();
                let start = Instant::now();
                let res = authenticate(&mut me, b"k", initiator, t);
                let dt = start.elapsed();
                assert!(
                    matches!(res, Err(Error::Auth(_)) | Err(Error::Timeout { .. })),
                    "{res:?}"
                );
                assert!(dt < t + Duration::from_millis(500), "{dt:?}");
                drop(other);
            }
        }
        // A peer that hangs up is an error at once, not a timeout.
        let (mut me, other) = pair();
        drop(other);
        let res = authenticate(&mut me, b"k", false, Duration::from_secs(5));
        assert!(matches!(res, Err(Error::Io(_))), "{res:?}");
    }

    #[test]
    fn hex_round_trip() {
        let s = random_secret();
        assert_eq!(s.len(), SECRET_LEN);
        assert_ne!(s, random_secret());
        let h = secret_to_hex(&s);
        assert_eq!(h.len(), 64);
        assert_eq!(secret_from_hex(&h).unwrap(), s);
        assert_eq!(secret_to_hex(&[0x00, 0xab, 0x7f]), "00ab7f");
        assert_eq!(
            secret_from_hex(" 00AB7f\n").unwrap(),
            vec![0x00, 0xab, 0x7f]
        );
        assert!(secret_from_hex("abc").is_err());
        assert!(secret_from_hex("zz").is_err());
        assert_eq!(secret_from_hex("").unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn proofs_depend_on_role_secret_and_order() {
        let a = [1u8; 32];
        let b = [2u8; 32];
        let p = |s: &[u8], r, x: &[u8], y: &[u8]| proof_mac(s, r, x, y).finalize().into_bytes();
        assert_ne!(p(b"k", b'I', &a, &b), p(b"k", b'R', &a, &b));
        assert_ne!(p(b"k", b'I', &a, &b), p(b"k", b'I', &b, &a));
        assert_ne!(p(b"k", b'I', &a, &b), p(b"j", b'I', &a, &b));
    }
}
