//! The rendezvous store client (`bootstrap::TcpStore`) against a server that knows the secret
//! but answers with arbitrary bytes (frame prefix included): every call returns, with an error
//! or a value, and never panics. The client's reply decoder is private, so the bytes arrive
//! the way a hostile server's would: over a socket.
//!
//! Input: one byte choosing the call (get, set, add), then the server's raw answer.
#![no_main]

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::Duration;

use _core::bootstrap::{authenticate, read_frame, Store, TcpStore};
use libfuzzer_sys::fuzz_target;

const SECRET: &[u8] = b"fuzz-secret";

/// The answer the fake server sends on its next connection.
static ANSWER: Mutex<Vec<u8>> = Mutex::new(Vec::new());

fn fake_server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut s) = conn else { continue };
                if authenticate(&mut s, SECRET, false, Duration::from_secs(10)).is_err() {
                    continue;
                }
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                if read_frame(&mut s, 1 << 20).is_ok() {
                    let answer = ANSWER.lock().unwrap().clone();
                    let _ = s.write_all(&answer);
                }
                // Dropping `s` closes it: the client sees end of stream after the answer.
            }
        });
        addr
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&call, answer)) = data.split_first() else {
        return;
    };
    let addr = fake_server();
    *ANSWER.lock().unwrap() = answer.to_vec();
    let c = TcpStore::connect(addr, SECRET, Duration::from_secs(10)).unwrap();
    let _ = match call % 3 {
        0 => c.get("key", Duration::ZERO).map(drop),
        1 => c.set("key", b"value"),
        _ => c.add("key", 1).map(drop),
    };
});
