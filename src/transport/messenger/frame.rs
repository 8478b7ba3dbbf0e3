//! What travels on a point-to-point connection: a message's header (its payload follows it)
//! from the sender, an acknowledgement back from the receiver once a receive has taken the
//! message, or failed to.

use crate::error::{Error, Result};
use crate::wire::{Reader, Writer};

const MESSAGE: u8 = 1;
const ACK: u8 = 2;

/// The header that precedes a message's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Header {
    /// The sender's count of its messages to this receiver, which the acknowledgement names.
    pub(super) seq: u64,
    /// Payload bytes that follow.
    pub(super) len: u64,
    /// The name both sides gave the message: a receive takes the message of its name.
    pub(super) name: String,
    /// What the sender says the payload is (dtype and shape), compared with the receive's.
    pub(super) desc: String,
}

/// The receiver's answer to message `seq`: `None` when a receive took it, else why the
/// receive failed (both sides then fail with that text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Ack {
    pub(super) seq: u64,
    pub(super) error: Option<String>,
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
        w.u8(MESSAGE)
            .u64(self.seq)
            .u64(self.len)
            .str(&self.name)
            .str(&self.desc);
        framed(w)
    }
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

/// The header at the start of `buf` and the bytes it took, once all of it has arrived.
pub(super) fn read_header(buf: &[u8]) -> Result<Option<(Header, usize)>> {
    let Some((body, used)) = split(buf)? else {
        return Ok(None);
    };
    let mut r = Reader::new(body);
    if r.u8()? != MESSAGE {
        return Err(Error::Decode(
            "expected a point-to-point message header".into(),
        ));
    }
    let h = Header {
        seq: r.u64()?,
        len: r.u64()?,
        name: r.str()?.to_string(),
        desc: r.str()?.to_string(),
    };
    r.finish()?;
    Ok(Some((h, used)))
}

/// The acknowledgement at the start of `buf` and the bytes it took, once all of it has
/// arrived.
pub(super) fn read_ack(buf: &[u8]) -> Result<Option<(Ack, usize)>> {
    let Some((body, used)) = split(buf)? else {
        return Ok(None);
    };
    let mut r = Reader::new(body);
    if r.u8()? != ACK {
        return Err(Error::Decode(
            "expected a point-to-point acknowledgement".into(),
        ));
    }
    let seq = r.u64()?;
    let error = match r.u8()? {
        0 => None,
        _ => Some(r.str()?.to_string()),
    };
    r.finish()?;
    Ok(Some((Ack { seq, error }, used)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_wait_for_their_last_byte() {
        let h = Header {
            seq: 7,
            len: 1 << 33,
            name: "pg0.p2p.0to1.t3.2".into(),
            desc: "float32 [2, 3]".into(),
        };
        let mut bytes = h.encode();
        bytes.extend_from_slice(b"payload");
        let (got, used) = read_header(&bytes).unwrap().unwrap();
        assert_eq!(got, h);
        assert_eq!(&bytes[used..], b"payload");
        for cut in 0..used {
            assert!(
                read_header(&bytes[..cut]).unwrap().is_none(),
                "cut at {cut}"
            );
        }
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
            assert_eq!(read_ack(&bytes).unwrap().unwrap(), (ack, bytes.len()));
        }
        assert!(read_ack(&h.encode()).is_err());
        assert!(read_header(&[0xff, 0xff, 0xff, 0xff]).is_err());
    }
}
