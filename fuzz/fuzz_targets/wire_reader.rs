//! Any sequence of `wire::Reader` reads on any bytes: each read either consumes exactly the
//! bytes its value took or fails with `Error::Decode`; nothing panics or overflows.
//!
//! Input: one byte giving the number of reads (mod 16), one byte per read naming it, then the
//! bytes to read from.
#![no_main]

use _core::error::Error;
use _core::wire::Reader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 16).min(rest.len());
    let (ops, buf) = rest.split_at(n);
    let mut r = Reader::new(buf);
    for &op in ops {
        let before = r.remaining();
        let res: Result<usize, Error> = match op % 10 {
            0 => r.u8().map(|_| 1),
            1 => r.bool().map(|_| 1),
            2 => r.u32().map(|_| 4),
            3 => r.u64().map(|_| 8),
            4 => r.usize().map(|_| 8),
            5 => r.i64().map(|_| 8),
            6 => r.f64().map(|_| 8),
            7 => r.bytes().map(|b| 4 + b.len()),
            8 => r.str().map(|s| 4 + s.len()),
            _ => r.usizes().map(|v| 4 + 8 * v.len()),
        };
        match res {
            Ok(k) => assert_eq!(
                before - r.remaining(),
                k,
                "read {op} consumed the wrong size"
            ),
            Err(e) => assert!(matches!(e, Error::Decode(_)), "read {op}: {e:?}"),
        }
        assert!(r.remaining() <= before);
    }
    let _ = r.finish();
});
