//! The rendezvous store server (`bootstrap::TcpStoreServer`) against arbitrary clients. Its
//! request decoder is private, so the bytes go where an attacker's would: over a socket.
//!
//! Input: one flag byte, then the stream the client sends. Flag bit 0 set: the client first
//! completes the handshake with the job secret, and the server must answer each complete
//! request frame with a well-formed reply, stop after the first malformed one, and close at
//! end of stream. Bit 0 clear: the client sends the bytes instead of a handshake, and must get
//! nothing but the server's 36-byte greeting.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use _core::bootstrap::tcp_store::{TcpStoreServer, MAX_STORE_FRAME};
use _core::bootstrap::{authenticate, read_frame};
use _core::wire::Reader;
use libfuzzer_sys::fuzz_target;

const SECRET: &[u8] = b"fuzz-secret";

fn server() -> SocketAddr {
    static S: OnceLock<TcpStoreServer> = OnceLock::new();
    S.get_or_init(|| {
        TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), SECRET.to_vec()).unwrap()
    })
    .local_addr()
}

/// The protocol of tcp_store.rs's module doc, written independently: is `body` a well-formed
/// request, and if it is a GET, where its wait (u64 ms) sits.
fn model(body: &[u8]) -> (bool, Option<usize>) {
    let mut r = Reader::new(body);
    let parsed = (|| -> Option<Option<usize>> {
        let op = r.u8().ok()?;
        r.str().ok()?;
        match op {
            1 => r.bytes().ok().map(|_| None),
            2 => {
                let at = body.len() - r.remaining();
                r.u64().ok().map(|_| Some(at))
            }
            3 => r.i64().ok().map(|_| None),
            _ => None,
        }
    })();
    match parsed {
        Some(get) if r.remaining() == 0 => (true, get),
        _ => (false, None),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let mut stream = rest.to_vec();
    let mut s = TcpStream::connect(server()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    if flags & 1 == 0 {
        let _ = s.write_all(&stream);
        let _ = s.shutdown(Shutdown::Write);
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        assert!(
            got.len() <= 36,
            "{} bytes sent to an unauthenticated client",
            got.len()
        );
        return;
    }
    authenticate(&mut s, SECRET, true, Duration::from_secs(20)).unwrap();

    // Walk the complete frames the server will see; make every GET wait 0 ms (a GET of a
    // missing key legitimately blocks as long as it asks), and count the answers due.
    let mut due = 0;
    let mut at = 0;
    while stream.len() - at >= 4 {
        let len = u32::from_le_bytes(stream[at..at + 4].try_into().unwrap()) as usize;
        if len > MAX_STORE_FRAME || stream.len() - at - 4 < len {
            break;
        }
        let body = at + 4..at + 4 + len;
        let (ok, get) = model(&stream[body.clone()]);
        if let Some(off) = get {
            let w = body.start + off;
            stream[w..w + 8].copy_from_slice(&0u64.to_le_bytes());
        }
        due += 1;
        if !ok {
            break;
        }
        at = body.end;
    }

    let _ = s.write_all(&stream);
    let _ = s.shutdown(Shutdown::Write);
    for i in 0..due {
        let reply = read_frame(&mut s, MAX_STORE_FRAME)
            .unwrap_or_else(|e| panic!("no answer to request {i} of {due}: {e:?}"));
        assert!(!reply.is_empty() && reply[0] <= 4, "bad reply {reply:?}");
    }
    let mut more = Vec::new();
    let _ = s.read_to_end(&mut more);
    assert!(more.is_empty(), "more answers than requests: {more:?}");
});
