//! The authentication handshake against an arbitrary peer: whatever the peer sends (it does
//! not know the secret), `authenticate` fails, in either role, without panicking or hanging.
//!
//! Input: one byte whose low bit picks our role (1: we connected), then the peer's bytes.
#![no_main]

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use _core::bootstrap::authenticate;
use libfuzzer_sys::fuzz_target;

fn listener() -> &'static TcpListener {
    static L: OnceLock<TcpListener> = OnceLock::new();
    L.get_or_init(|| TcpListener::bind("127.0.0.1:0").unwrap())
}

fuzz_target!(|data: &[u8]| {
    let Some((&role, peer_bytes)) = data.split_first() else {
        return;
    };
    let l = listener();
    let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut me, _) = l.accept().unwrap();
    // The peer may be gone before we write everything (we reject early): not an error here.
    let _ = peer.write_all(peer_bytes);
    let _ = peer.shutdown(Shutdown::Write);
    let res = authenticate(
        &mut me,
        b"fuzz-secret",
        role & 1 == 1,
        Duration::from_secs(2),
    );
    assert!(res.is_err(), "a peer without the secret was accepted");
});
