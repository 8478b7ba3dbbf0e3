//! What travels on a point-to-point connection. From the sender: a message's header, with
//! its payload after it (an eager message) or alone (a message announced, whose payload waits
//! for its receive), and the payload of an announced message once its receive has cleared it.
//! From the receiver: the clearance of an announced message, and an acknowledgement once a
//! receive has taken a message, or failed to.

use crate::error::{Error, Result};
use crate::wire::{Reader, Writer};

const MESSAGE: u8 = 1;
const ACK: u8 = 2;
const ANNOUNCE: u8 = 3;
const CLEAR: u8 = 4;
const DATA: u8 = 5;

/// The header of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Header {
    /// The sender's count of its messages to this receiver, which the answers name.
    pub(super) seq: u64,
    /// Payload bytes.
    pub(super) len: u64,
    /// The name both sides gave the message: a receive takes the message of its name.
    pub(super) name: String,
    /// What the sender says the payload is (dtype and shape), compared with the receive's.
    pub(super) desc: String,
    /// The payload does not follow: it comes in a [`ToReceiver::Data`] frame once the
    /// receiver has cleared it ([`ToSender::Clear`]).
    pub(super) announced: bool,
}

/// The receiver's answer to message `seq`: `None` when a receive took it, else why the
/// receive failed (both sides then fail with that text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Ack {
    pub(super) seq: u64,
    pub(super) error: Option<String>,
}

/// A frame from the sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ToReceiver {
    Header(Header),
    /// The payload of announced message `seq`, `len` bytes, follows.
    Data {
        seq: u64,
        len: u64,
    },
}

/// A frame from the receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ToSender {
    Ack(Ack),
    /// A receive took announced message `seq`: its payload may come.
    Clear(u64),
}

/// Bytes of a frame's length prefix: every frame is `u32 length` then that many bytes.
const PREFIX: usize = 4;

fn framed(w: Writer) -> Vec<u8> {
    let body = w.finish();
    let mut out = Vec::with_capacity(PREFIX + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

impl Header {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u8(if self.announced { ANNOUNCE } else { MESSAGE })
            .u64(self.seq)
            .u64(self.len)
            .str(&self.name)
            .str(&self.desc);
        framed(w)
    }
}

/// The frame that precedes the payload of announced message `seq`.
pub(super) fn data(seq: u64, len: u64) -> Vec<u8> {
    let mut w = Writer::new();
    w.u8(DATA).u64(seq).u64(len);
    framed(w)
}

/// The receiver's clearance of announced message `seq`.
pub(super) fn clear(seq: u64) -> Vec<u8> {
    let mut w = Writer::new();
    w.u8(CLEAR).u64(seq);
    framed(w)
}

impl Ack {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u8(ACK).u64(self.seq);
        match &self.error {
            None => w.u8(0),
            Some(e) => w.u8(1).str(e),
        };
        framed(w)
    }
}

/// The first whole frame at the start of `buf`: its body and the bytes it took, or `None`
/// when `buf` does not hold all of it yet.
fn split(buf: &[u8]) -> Result<Option<(&[u8], usize)>> {
    if buf.len() < PREFIX {
        return Ok(None);
    }
    let len = u32::from_le_bytes(buf[..PREFIX].try_into().expect("4 bytes")) as usize;
    // A header holds two names; anything near this is not one of ours.
    if len > 1 << 20 {
        return Err(Error::Decode(format!(
            "a point-to-point frame of {len} bytes"
        )));
    }
    Ok((buf.len() >= PREFIX + len).then(|| (&buf[PREFIX..PREFIX + len], PREFIX + len)))
}

/// The sender's frame at the start of `buf` and the bytes it took, once all of it has
/// arrived (a payload after it is not part of it).
pub(super) fn read_to_receiver(buf: &[u8]) -> Result<Option<(ToReceiver, usize)>> {
    let Some((body, used)) = split(buf)? else {
        return Ok(None);
    };
    let mut r = Reader::new(body);
    let frame = match r.u8()? {
        kind @ (MESSAGE | ANNOUNCE) => ToReceiver::Header(Header {
            seq: r.u64()?,
            len: r.u64()?,
            name: r.str()?.to_string(),
            desc: r.str()?.to_string(),
            announced: kind == ANNOUNCE,
        }),
        DATA => ToReceiver::Data {
            seq: r.u64()?,
            len: r.u64()?,
        },
        kind => {
            return Err(Error::Decode(format!(
                "expected a point-to-point message, got a frame of kind {kind}"
            )))
        }
    };
    r.finish()?;
    Ok(Some((frame, used)))
}

/// The receiver's frame at the start of `buf` and the bytes it took, once all of it has
/// arrived.
pub(super) fn read_to_sender(buf: &[u8]) -> Result<Option<(ToSender, usize)>> {
    let Some((body, used)) = split(buf)? else {
        return Ok(None);
    };
    let mut r = Reader::new(body);
    let frame = match r.u8()? {
        ACK => {
            let seq = r.u64()?;
            let error = match r.u8()? {
                0 => None,
                _ => Some(r.str()?.to_string()),
            };
            ToSender::Ack(Ack { seq, error })
        }
        CLEAR => ToSender::Clear(r.u64()?),
        kind => {
            return Err(Error::Decode(format!(
                "expected a point-to-point answer, got a frame of kind {kind}"
            )))
        }
    };
    r.finish()?;
    Ok(Some((frame, used)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_wait_for_their_last_byte() {
        for announced in [false, true] {
            let h = Header {
                seq: 7,
                len: 1 << 33,
                name: "pg0.p2p.0to1.t3.2".into(),
                desc: "float32 [2, 3]".into(),
                announced,
            };
            let mut bytes = h.encode();
            bytes.extend_from_slice(b"payload");
            let (got, used) = read_to_receiver(&bytes).unwrap().unwrap();
            assert_eq!(got, ToReceiver::Header(h.clone()));
            assert_eq!(&bytes[used..], b"payload");
            for cut in 0..used {
                assert!(
                    read_to_receiver(&bytes[..cut]).unwrap().is_none(),
                    "cut at {cut}"
                );
            }
            assert!(read_to_sender(&h.encode()).is_err());
        }
        let bytes = data(9, 1 << 40);
        assert_eq!(
            read_to_receiver(&bytes).unwrap().unwrap(),
            (
                ToReceiver::Data {
                    seq: 9,
                    len: 1 << 40
                },
                bytes.len()
            )
        );
        for ack in [
            Ack {
                seq: 3,
                error: None,
            },
            Ack {
                seq: 4,
                error: Some("shapes differ".into()),
            },
        ] {
            let bytes = ack.encode();
            assert_eq!(
                read_to_sender(&bytes).unwrap().unwrap(),
                (ToSender::Ack(ack), bytes.len())
            );
            assert!(read_to_receiver(&bytes).is_err());
        }
        let bytes = clear(5);
        assert_eq!(
            read_to_sender(&bytes).unwrap().unwrap(),
            (ToSender::Clear(5), bytes.len())
        );
        assert!(read_to_receiver(&[0xff, 0xff, 0xff, 0xff]).is_err());
    }
}
