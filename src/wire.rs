//! The message codec. Everything read from the network is decoded here, through a bounds-checked
//! [`Reader`] that returns `Error::Decode` (never panics) on truncated or garbage input.
//! Integers are little-endian; byte strings and strings carry a u32 length prefix.

use crate::error::{Error, Result};

/// Largest single length-prefixed field or frame we accept (guards allocations on garbage).
pub const MAX_FIELD: usize = 1 << 30;

/// Appends fields to a byte vector.
#[derive(Debug, Default, Clone)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Writer::default()
    }
    /// Appends one byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    /// Appends a bool as one byte.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(v as u8)
    }
    /// Appends a u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a usize as u64.
    pub fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }
    /// Appends an i64.
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends an f64.
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a length-prefixed byte string.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.buf.extend_from_slice(v);
        self
    }
    /// Appends a length-prefixed UTF-8 string.
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    /// Appends a length-prefixed list of u64s.
    pub fn usizes(&mut self, v: &[usize]) -> &mut Self {
        self.u32(v.len() as u32);
        for &x in v {
            self.usize(x);
        }
        self
    }
    /// The encoded bytes.
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads fields from a byte slice, checking every bound.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Starts reading `data` from its first byte.
    pub fn new(data: &'a [u8]) -> Self {
        Reader { data, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| {
                Error::Decode(format!(
                    "truncated: wanted {n} bytes at offset {}, have {}",
                    self.pos,
                    self.data.len() - self.pos
                ))
            })?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    /// Reads a bool (0 or 1).
    pub fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(Error::Decode(format!("bad bool byte {b}"))),
        }
    }
    /// Reads a u32.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    /// Reads a u64.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// Reads a u64 that must fit a usize.
    pub fn usize(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| Error::Decode(format!("value {v} does not fit usize")))
    }
    /// Reads an i64.
    pub fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    /// Reads an f64.
    pub fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array()?))
    }
    /// Reads a length-prefixed byte string.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        if n > MAX_FIELD {
            return Err(Error::Decode(format!("field of {n} bytes is too long")));
        }
        self.take(n)
    }
    /// Reads a length-prefixed UTF-8 string.
    pub fn str(&mut self) -> Result<&'a str> {
        std::str::from_utf8(self.bytes()?).map_err(|e| Error::Decode(format!("bad UTF-8: {e}")))
    }
    /// Reads a length-prefixed list of u64s.
    pub fn usizes(&mut self) -> Result<Vec<usize>> {
        let n = self.u32()? as usize;
        // Each element needs 8 bytes: refuse counts the remaining input cannot hold before
        // allocating, so garbage cannot make us reserve gigabytes.
        if n > (self.data.len() - self.pos) / 8 {
            return Err(Error::Decode(format!(
                "list of {n} u64s exceeds the message"
            )));
        }
        (0..n).map(|_| self.usize()).collect()
    }
    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }
    /// Fails unless every byte was consumed.
    pub fn finish(self) -> Result<()> {
        if self.pos == self.data.len() {
            Ok(())
        } else {
            Err(Error::Decode(format!(
                "{} trailing bytes",
                self.data.len() - self.pos
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut w = Writer::new();
        w.u8(7)
            .bool(true)
            .u32(0xdead_beef)
            .u64(u64::MAX)
            .i64(-5)
            .f64(0.25)
            .str("grad/layer1")
            .bytes(&[])
            .usizes(&[1, 2, 3]);
        let buf = w.finish();
        let mut r = Reader::new(&buf);
        assert_eq!(r.u8().unwrap(), 7);
        assert!(r.bool().unwrap());
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.i64().unwrap(), -5);
        assert_eq!(r.f64().unwrap(), 0.25);
        assert_eq!(r.str().unwrap(), "grad/layer1");
        assert_eq!(r.bytes().unwrap(), &[] as &[u8]);
        assert_eq!(r.usizes().unwrap(), vec![1, 2, 3]);
        r.finish().unwrap();
    }

    #[test]
    fn every_truncation_is_an_error() {
        let mut w = Writer::new();
        w.u32(3).str("abc").usizes(&[9, 8]).f64(1.5);
        let buf = w.finish();
        for cut in 0..buf.len() {
            let mut r = Reader::new(&buf[..cut]);
            let res = (|| -> Result<()> {
                r.u32()?;
                r.str()?;
                r.usizes()?;
                r.f64()?;
                Ok(())
            })();
            assert!(matches!(res, Err(Error::Decode(_))), "cut at {cut}");
        }
    }

    #[test]
    fn garbage_never_panics() {
        // A cheap deterministic generator: enough to sweep many shapes of garbage.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 40) as usize;
            let bytes: Vec<u8> = (0..len).map(|i| (x >> (i % 8 * 8)) as u8).collect();
            let mut r = Reader::new(&bytes);
            let _ = r.str();
            let _ = r.usizes();
            let _ = r.bool();
            let _ = r.bytes();
        }
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let r = Reader::new(&[1]);
        assert!(r.finish().is_err());
    }
}
