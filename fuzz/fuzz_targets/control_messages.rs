//! The control-plane decoders (`ToCoordinator`, `FromCoordinator`) on arbitrary bytes: an
//! error or a message, never a panic; and a message accepted must re-encode to exactly the
//! input (the encoding is canonical, so no byte is silently ignored or misread).
#![no_main]

use _core::control::message::{FromCoordinator, ToCoordinator};
use _core::error::Error;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match ToCoordinator::decode(data) {
        Ok(m) => assert_eq!(m.encode(), data, "ToCoordinator {m:?} is not canonical"),
        Err(e) => assert!(matches!(e, Error::Decode(_)), "{e:?}"),
    }
    match FromCoordinator::decode(data) {
        Ok(m) => assert_eq!(m.encode(), data, "FromCoordinator {m:?} is not canonical"),
        Err(e) => assert!(matches!(e, Error::Decode(_)), "{e:?}"),
    }
});
