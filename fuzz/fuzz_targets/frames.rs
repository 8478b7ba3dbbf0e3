//! The frame reader (`bootstrap::read_frame`) on an arbitrary byte stream, checked against an
//! independent model of the format: it yields exactly the model's frames, then `Decode` for a
//! length over the limit or `Io` for a truncated frame or end of stream.
//!
//! Input: two bytes of limit (little-endian), then the stream.
#![no_main]

use _core::bootstrap::read_frame;
use _core::error::Error;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let max_len = usize::from(u16::from_le_bytes([data[0], data[1]]));
    let stream = &data[2..];
    let mut r = stream;
    let mut at = 0;
    loop {
        let res = read_frame(&mut r, max_len);
        if stream.len() - at < 4 {
            assert!(matches!(res, Err(Error::Io(_))), "{res:?}");
            return;
        }
        let len = u32::from_le_bytes(stream[at..at + 4].try_into().unwrap()) as usize;
        if len > max_len {
            assert!(matches!(res, Err(Error::Decode(_))), "{res:?}");
            return;
        }
        if stream.len() - at - 4 < len {
            assert!(matches!(res, Err(Error::Io(_))), "{res:?}");
            return;
        }
        assert_eq!(res.unwrap(), &stream[at + 4..at + 4 + len]);
        at += 4 + len;
    }
});
