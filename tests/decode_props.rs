//! Property tests for everything that decodes bytes read from a socket: the `wire` codec, the
//! control messages (`ToCoordinator`, `FromCoordinator`), the frame readers (`read_frame`,
//! the control connection's `FrameConn`), the rendezvous store's request decoding (through a
//! real server, since the decoder is private to it), the store client's reply decoding and the
//! authentication handshake.
//!
//! Inputs are random bytes, truncations and mutations of valid encodings, and valid encodings
//! with a huge value written over any four bytes (so every length field gets hit). Decoding
//! must return an error, never panic, and never allocate more than a bound proportional to the
//! input: a counting global allocator records the largest single allocation made by the
//! thread under test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use _core::bootstrap::tcp_store::{TcpStore, TcpStoreServer, MAX_STORE_FRAME};
use _core::bootstrap::{authenticate, read_frame, write_frame, Store};
use _core::control::connection::{ControlStream, FrameConn, MAX_FRAME};
use _core::control::message::{
    DeviceKind, FromCoordinator, Item, Op, Request, Response, Submit, TensorMeta, ToCoordinator,
};
use _core::error::Error;
use _core::wire::{Reader, Writer, MAX_FIELD};
use _core::{DType, OpKind, ReduceOp};
use proptest::prelude::*;

// ------------------------------------------------------------------ allocation accounting

/// The system allocator, recording per thread the largest single request since the last reset.
struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: the slot is gone while a thread's locals are being destroyed.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract holds exactly as it does for `System`; `note` neither allocates nor
// unwinds (a const-initialised thread-local `Cell`).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller upholds `alloc`'s contract, which is `System::alloc`'s.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr` was allocated by this allocator, i.e. by `System`, with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the largest single allocation it made on this thread.
fn largest_alloc<R>(f: impl FnOnce() -> R) -> (R, usize) {
    LARGEST.with(|l| l.set(0));
    let r = f();
    (r, LARGEST.with(Cell::get))
}

/// What decoding `len` input bytes may allocate at most in one piece: a vector of decoded
/// structs holds at most one element per input byte (every decoder checks counts against the
/// bytes left), so the bound is the largest decoded struct per byte, plus slack for error
/// messages.
fn decode_bound(len: usize) -> usize {
    let per_byte = [
        std::mem::size_of::<Submit>(),
        std::mem::size_of::<Item>(),
        std::mem::size_of::<Response>(),
        std::mem::size_of::<TensorMeta>(),
        std::mem::size_of::<Vec<usize>>(),
    ]
    .into_iter()
    .max()
    .unwrap();
    4096 + len * per_byte
}

/// `cases` cases, and no failure-persistence files (an integration test has no `lib.rs` for
/// proptest to put them beside).
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ------------------------------------------------------------------ strategies

fn arb_dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn arb_kind() -> impl Strategy<Value = OpKind> {
    (0u8..7).prop_map(|c| OpKind::from_code(c).unwrap())
}

fn arb_reduce() -> impl Strategy<Value = ReduceOp> {
    (0u8..6).prop_map(|c| ReduceOp::from_code(c).unwrap())
}

/// Any f64 but NaN (NaN != NaN would break the round-trip equality, not the codec).
fn arb_f64() -> impl Strategy<Value = f64> {
    any::<f64>().prop_filter("NaN", |x| !x.is_nan())
}

fn arb_usizes(max: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(any::<usize>(), 0..max)
}

fn arb_request() -> impl Strategy<Value = Request> {
    (
        (
            any::<u32>(),
            ".{0,16}",
            arb_kind(),
            arb_reduce(),
            any::<usize>(),
        ),
        (arb_f64(), arb_f64()),
        prop::collection::vec(
            (arb_dtype(), arb_usizes(4)).prop_map(|(dtype, shape)| TensorMeta { dtype, shape }),
            0..3,
        ),
        arb_usizes(4),
        prop_oneof![Just(DeviceKind::Host), Just(DeviceKind::Cuda)],
    )
        .prop_map(
            |((set_id, name, kind, op, root), (prescale, postscale), tensors, splits, device)| {
                Request {
                    spec: Op {
                        set_id,
                        name,
                        base_at: 0,
                        kind,
                        op,
                        root,
                        prescale,
                        postscale,
                        tensors,
                        splits,
                    },
                    device,
                }
            },
        )
}

fn arb_to() -> impl Strategy<Value = ToCoordinator> {
    let submit = prop_oneof![
        arb_request().prop_map(Submit::Full),
        (any::<u32>(), any::<u64>()).prop_map(|(set_id, id)| Submit::Cached { set_id, id }),
    ];
    prop_oneof![
        any::<usize>().prop_map(|rank| ToCoordinator::Hello { rank }),
        prop::collection::vec(submit, 0..4).prop_map(ToCoordinator::Submit),
        Just(ToCoordinator::Join),
        arb_usizes(6).prop_map(|ranks| ToCoordinator::AddSet { ranks }),
        (arb_usizes(6), any::<u64>())
            .prop_map(|(ranks, timeout_ms)| ToCoordinator::AddMemberSet { ranks, timeout_ms }),
        any::<u32>().prop_map(|id| ToCoordinator::RemoveSet { id }),
        Just(ToCoordinator::Leave),
        (any::<usize>(), ".{0,24}")
            .prop_map(|(rank, detail)| ToCoordinator::Stalled { rank, detail }),
    ]
}

fn arb_response() -> impl Strategy<Value = Response> {
    let item = (
        arb_request(),
        any::<Option<u64>>(),
        prop::collection::vec(arb_usizes(4), 0..3),
        arb_usizes(6),
    )
        .prop_map(|(request, cache_id, first_dims, split_matrix)| Item {
            request,
            cache_id,
            first_dims,
            split_matrix,
        });
    (
        (any::<u32>(), arb_kind()),
        prop::collection::vec(item, 0..3),
        arb_usizes(4),
        any::<usize>(),
        any::<Option<(u8, String)>>(),
    )
        .prop_map(
            |((set_id, kind), items, joined, last_joined, error)| Response {
                set_id,
                kind,
                items,
                joined,
                last_joined,
                error,
            },
        )
}

fn arb_from() -> impl Strategy<Value = FromCoordinator> {
    prop_oneof![
        Just(FromCoordinator::Ready),
        prop::collection::vec(arb_response(), 0..3).prop_map(FromCoordinator::Responses),
        (any::<u32>(), any::<u64>())
            .prop_map(|(set_id, id)| FromCoordinator::CacheMiss { set_id, id }),
        (
            arb_usizes(5),
            any::<u64>(),
            prop_oneof![any::<u32>().prop_map(Ok), ".{0,20}".prop_map(Err)]
        )
            .prop_map(|(ranks, timeout_ms, result)| FromCoordinator::SetAdded {
                ranks,
                timeout_ms,
                result
            }),
        (
            any::<u32>(),
            prop_oneof![any::<bool>().prop_map(Ok), ".{0,20}".prop_map(Err)]
        )
            .prop_map(|(id, result)| FromCoordinator::SetRemoved { id, result }),
        any::<usize>().prop_map(|rank| FromCoordinator::RankLeft { rank }),
        (any::<usize>(), ".{0,20}", any::<bool>()).prop_map(|(rank, detail, stalled)| {
            FromCoordinator::RankFailed {
                rank,
                detail,
                stalled,
            }
        }),
    ]
}

/// Values written over four bytes of a valid encoding: lengths and counts far beyond the input.
fn arb_huge() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(u32::MAX),
        Just(0x8000_0000),
        Just(MAX_FIELD as u32),
        Just(MAX_FIELD as u32 + 1),
        Just(1 << 24),
        Just(0xFFFF),
        (1u32 << 16..=u32::MAX),
    ]
}

/// Byte-level damage to a valid encoding.
#[derive(Debug, Clone)]
enum Damage {
    /// Keep only the first `cut` bytes (modulo the length).
    Truncate(usize),
    /// Overwrite bytes at (index modulo the length).
    Flip(Vec<(usize, u8)>),
    /// Write a huge u32 at an offset (modulo the length).
    Huge(usize, u32),
    /// Insert a byte.
    Insert(usize, u8),
}

fn arb_damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        any::<usize>().prop_map(Damage::Truncate),
        prop::collection::vec((any::<usize>(), any::<u8>()), 1..4).prop_map(Damage::Flip),
        (any::<usize>(), arb_huge()).prop_map(|(at, v)| Damage::Huge(at, v)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Damage::Insert(at, b)),
    ]
}

fn damage(mut b: Vec<u8>, d: &Damage) -> Vec<u8> {
    if b.is_empty() {
        return b;
    }
    let n = b.len();
    match d {
        Damage::Truncate(cut) => b.truncate(cut % n),
        Damage::Flip(flips) => {
            for &(i, v) in flips {
                b[i % n] = v;
            }
        }
        Damage::Huge(at, v) => {
            let at = at % n;
            for (k, byte) in v.to_le_bytes().into_iter().enumerate() {
                if at + k < n {
                    b[at + k] = byte;
                }
            }
        }
        Damage::Insert(at, v) => b.insert(at % (n + 1), *v),
    }
    b
}

// ------------------------------------------------------------------ wire::Reader

/// One read of a `Reader`, with the bytes it consumes on success.
#[derive(Debug, Clone, Copy)]
enum ReadOp {
    U8,
    Bool,
    U32,
    U64,
    Usize,
    I64,
    F64,
    Bytes,
    Str,
    Usizes,
}

fn arb_read_op() -> impl Strategy<Value = ReadOp> {
    use ReadOp::*;
    prop::sample::select(vec![
        U8, Bool, U32, U64, Usize, I64, F64, Bytes, Str, Usizes,
    ])
}

/// Applies `op`; Ok(bytes consumed) or the error.
fn apply(r: &mut Reader<'_>, op: ReadOp) -> Result<usize, Error> {
    Ok(match op {
        ReadOp::U8 => r.u8().map(|_| 1)?,
        ReadOp::Bool => r.bool().map(|_| 1)?,
        ReadOp::U32 => r.u32().map(|_| 4)?,
        ReadOp::U64 => r.u64().map(|_| 8)?,
        ReadOp::Usize => r.usize().map(|_| 8)?,
        ReadOp::I64 => r.i64().map(|_| 8)?,
        ReadOp::F64 => r.f64().map(|_| 8)?,
        ReadOp::Bytes => r.bytes().map(|b| 4 + b.len())?,
        ReadOp::Str => r.str().map(|s| 4 + s.len())?,
        ReadOp::Usizes => r.usizes().map(|v| 4 + 8 * v.len())?,
    })
}

proptest! {
    #![proptest_config(config(1024))]

    /// Any sequence of reads on any bytes: each read consumes exactly its size or fails with
    /// `Decode`; nothing panics and no allocation exceeds the input.
    #[test]
    fn reader_on_random_bytes(
        data in prop::collection::vec(any::<u8>(), 0..96),
        ops in prop::collection::vec(arb_read_op(), 1..12),
    ) {
        let (res, largest) = largest_alloc(|| -> Result<(), TestCaseError> {
            let mut r = Reader::new(&data);
            for &op in &ops {
                let before = r.remaining();
                match apply(&mut r, op) {
                    Ok(n) => prop_assert_eq!(before - r.remaining(), n, "{:?}", op),
                    Err(e) => prop_assert!(matches!(e, Error::Decode(_)), "{:?}: {:?}", op, e),
                }
                prop_assert!(r.remaining() <= before);
            }
            Ok(())
        });
        res?;
        // Error messages allocate a little; decoded data never more than the input holds.
        prop_assert!(largest <= 2 * data.len() + 256, "allocated {} for {} bytes", largest, data.len());
    }

    /// A huge length or count prefix is refused without allocating for it.
    #[test]
    fn reader_huge_prefixes(n in arb_huge(), tail in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut data = n.to_le_bytes().to_vec();
        data.extend_from_slice(&tail);
        for op in [ReadOp::Bytes, ReadOp::Str, ReadOp::Usizes] {
            let (res, largest) = largest_alloc(|| apply(&mut Reader::new(&data), op));
            prop_assert!(matches!(res, Err(Error::Decode(_))), "{:?}: {:?}", op, res);
            prop_assert!(largest <= 256, "{:?} allocated {}", op, largest);
        }
    }
}

// ------------------------------------------------------------------ control messages

/// Decodes `bytes` both ways; any message accepted must re-encode to exactly `bytes` (the
/// encoding is canonical, so nothing is silently ignored), and allocation stays bounded.
fn check_message_decoders(bytes: &[u8]) -> Result<(), TestCaseError> {
    let bound = decode_bound(bytes.len());
    let (to, largest) = largest_alloc(|| ToCoordinator::decode(bytes));
    prop_assert!(
        largest <= bound,
        "ToCoordinator allocated {} for {} bytes",
        largest,
        bytes.len()
    );
    match to {
        Ok(m) => prop_assert_eq!(m.encode(), bytes, "accepted {:?}", m),
        Err(e) => prop_assert!(matches!(e, Error::Decode(_)), "{:?}", e),
    }
    let (from, largest) = largest_alloc(|| FromCoordinator::decode(bytes));
    prop_assert!(
        largest <= bound,
        "FromCoordinator allocated {} for {} bytes",
        largest,
        bytes.len()
    );
    match from {
        Ok(m) => prop_assert_eq!(m.encode(), bytes, "accepted {:?}", m),
        Err(e) => prop_assert!(matches!(e, Error::Decode(_)), "{:?}", e),
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(1024))]

    #[test]
    fn to_coordinator_round_trips(m in arb_to()) {
        let b = m.encode();
        prop_assert_eq!(ToCoordinator::decode(&b).unwrap(), m);
        let mut longer = b.clone();
        longer.push(0);
        prop_assert!(ToCoordinator::decode(&longer).is_err(), "trailing byte accepted");
        for cut in 0..b.len() {
            prop_assert!(ToCoordinator::decode(&b[..cut]).is_err(), "prefix of {} accepted", cut);
        }
    }

    #[test]
    fn from_coordinator_round_trips(m in arb_from()) {
        let b = m.encode();
        prop_assert_eq!(FromCoordinator::decode(&b).unwrap(), m);
        let mut longer = b.clone();
        longer.push(0);
        prop_assert!(FromCoordinator::decode(&longer).is_err(), "trailing byte accepted");
        for cut in 0..b.len() {
            prop_assert!(FromCoordinator::decode(&b[..cut]).is_err(), "prefix of {} accepted", cut);
        }
    }

    #[test]
    fn messages_from_random_bytes(
        tag in 0u8..8,
        body in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        // A valid tag first, so decoding gets past the first byte most of the time.
        let mut bytes = vec![tag];
        bytes.extend_from_slice(&body);
        check_message_decoders(&bytes)?;
        check_message_decoders(&body)?;
    }

    #[test]
    fn damaged_to_coordinator(m in arb_to(), d in arb_damage()) {
        check_message_decoders(&damage(m.encode(), &d))?;
    }

    #[test]
    fn damaged_from_coordinator(m in arb_from(), d in arb_damage()) {
        check_message_decoders(&damage(m.encode(), &d))?;
    }
}

// ------------------------------------------------------------------ frame readers

/// An independent model of the frame format: the complete frames of `stream` in order, and
/// whether it then stops at an over-long length prefix (`Some(len)`).
fn model_frames(stream: &[u8], max_len: usize) -> (Vec<Vec<u8>>, Option<usize>) {
    let mut frames = Vec::new();
    let mut at = 0;
    while stream.len() - at >= 4 {
        let len = u32::from_le_bytes(stream[at..at + 4].try_into().unwrap()) as usize;
        if len > max_len {
            return (frames, Some(len));
        }
        if stream.len() - at - 4 < len {
            break;
        }
        frames.push(stream[at + 4..at + 4 + len].to_vec());
        at += 4 + len;
    }
    (frames, None)
}

/// A stream of frames, some possibly with a huge or lying length prefix, in pieces.
fn arb_frame_stream() -> impl Strategy<Value = Vec<u8>> {
    let frame = prop_oneof![
        4 => prop::collection::vec(any::<u8>(), 0..40).prop_map(|p| {
            let mut f = (p.len() as u32).to_le_bytes().to_vec();
            f.extend_from_slice(&p);
            f
        }),
        1 => (arb_huge(), prop::collection::vec(any::<u8>(), 0..16)).prop_map(|(n, p)| {
            let mut f = n.to_le_bytes().to_vec();
            f.extend_from_slice(&p);
            f
        }),
        1 => prop::collection::vec(any::<u8>(), 0..12),
    ];
    prop::collection::vec(frame, 0..6).prop_map(|fs| fs.concat())
}

fn loopback_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    (c, l.accept().unwrap().0)
}

proptest! {
    #![proptest_config(config(1024))]

    /// `read_frame` yields exactly the model's frames, refuses an over-long prefix without
    /// allocating for it, and never allocates more than the limit.
    #[test]
    fn read_frame_matches_the_model(stream in arb_frame_stream(), max_len in 0usize..64) {
        let (frames, over) = model_frames(&stream, max_len);
        let mut r = &stream[..];
        for f in &frames {
            prop_assert_eq!(&read_frame(&mut r, max_len).unwrap(), f);
        }
        let (res, largest) = largest_alloc(|| read_frame(&mut r, max_len));
        match over {
            Some(_) => prop_assert!(matches!(res, Err(Error::Decode(_))), "{:?}", res),
            None => prop_assert!(matches!(res, Err(Error::Io(_))), "{:?}", res),
        }
        prop_assert!(largest <= max_len + 256, "allocated {}", largest);
    }
}

proptest! {
    #![proptest_config(config(48))]

    /// The control connection's non-blocking frame reader, fed over a real socket in pieces,
    /// yields the model's frames and then reports an over-long prefix as `Decode`.
    #[test]
    fn control_frames_match_the_model(stream in arb_frame_stream(), pieces in 1usize..5) {
        let (frames, over) = model_frames(&stream, MAX_FRAME);
        let (mut tx, rx) = loopback_pair();
        let mut conn = FrameConn::new(ControlStream::Tcp(rx), 1).unwrap();
        let writer = {
            let stream = stream.clone();
            thread::spawn(move || {
                for piece in stream.chunks(stream.len().div_ceil(pieces).max(1)) {
                    tx.write_all(piece).unwrap();
                    thread::sleep(Duration::from_millis(1));
                }
                tx.shutdown(Shutdown::Write).unwrap();
            })
        };
        let mut got = Vec::new();
        let mut error = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        let (res, largest) = largest_alloc(|| -> Result<(), TestCaseError> {
            'outer: loop {
                prop_assert!(Instant::now() < deadline, "no end of stream");
                let open = conn.fill().unwrap();
                loop {
                    match conn.next_frame() {
                        Ok(Some(f)) => got.push(f),
                        Ok(None) => break,
                        Err(e) => {
                            error = Some(e);
                            break 'outer;
                        }
                    }
                }
                if !open {
                    break;
                }
                thread::sleep(Duration::from_micros(200));
            }
            Ok(())
        });
        res?;
        writer.join().unwrap();
        prop_assert_eq!(got, frames);
        match over {
            Some(_) => prop_assert!(matches!(error, Some(Error::Decode(_))), "{:?}", error),
            None => prop_assert!(error.is_none(), "{:?}", error),
        }
        // It buffers what arrived (64 KiB reads), never what a prefix claims.
        prop_assert!(largest <= 256 * 1024 + 2 * stream.len(), "allocated {}", largest);
    }
}

// ------------------------------------------------------------------ rendezvous store

const SECRET: &[u8] = b"decode-props-secret";
const IO: Duration = Duration::from_secs(10);
/// Longest GET wait the tests send: a GET of a missing key legitimately waits this long.
const GET_MS: u64 = 20;

fn store_server() -> SocketAddr {
    static SERVER: OnceLock<TcpStoreServer> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), SECRET.to_vec()).unwrap()
        })
        .local_addr()
}

/// What the store protocol (tcp_store.rs module doc) says a request body is.
#[derive(Debug, PartialEq)]
enum StoreReq {
    Set,
    Get(u64),
    Add,
    Bad,
}

fn model_store(body: &[u8]) -> StoreReq {
    let mut r = Reader::new(body);
    let parsed = (|| -> Result<StoreReq, Error> {
        let op = r.u8()?;
        r.str()?;
        let req = match op {
            1 => {
                r.bytes()?;
                StoreReq::Set
            }
            2 => StoreReq::Get(r.u64()?),
            3 => {
                r.i64()?;
                StoreReq::Add
            }
            _ => StoreReq::Bad,
        };
        Ok(req)
    })();
    match parsed {
        Ok(req) if r.finish().is_ok() => req,
        _ => StoreReq::Bad,
    }
}

fn arb_store_body() -> impl Strategy<Value = Vec<u8>> {
    let key = "[a-z/0-9]{0,6}";
    let valid = prop_oneof![
        (key, prop::collection::vec(any::<u8>(), 0..20)).prop_map(|(k, v)| {
            let mut w = Writer::new();
            w.u8(1).str(&k).bytes(&v);
            w.finish()
        }),
        (key, 0..=GET_MS).prop_map(|(k, ms)| {
            let mut w = Writer::new();
            w.u8(2).str(&k).u64(ms);
            w.finish()
        }),
        (key, any::<i64>()).prop_map(|(k, d)| {
            let mut w = Writer::new();
            w.u8(3).str(&k).i64(d);
            w.finish()
        }),
    ];
    let body = prop_oneof![
        2 => valid.clone(),
        3 => (valid, arb_damage()).prop_map(|(b, d)| damage(b, &d)),
        1 => prop::collection::vec(any::<u8>(), 0..48),
    ];
    // A damaged GET may now ask to wait for years: cap its wait, since a GET of a missing key
    // legitimately blocks for as long as it asks.
    body.prop_map(|mut b| {
        if let StoreReq::Get(ms) = model_store(&b) {
            if ms > GET_MS {
                let n = b.len();
                b[n - 8..].copy_from_slice(&GET_MS.to_le_bytes());
            }
        }
        b
    })
}

fn connect_authenticated(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    authenticate(&mut s, SECRET, true, IO).unwrap();
    s.set_read_timeout(Some(IO)).unwrap();
    s
}

/// Reads until the peer closes; true when it closed without sending anything more.
fn closes_silently(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => rest.is_empty(),
        Err(e) => e.kind() == ErrorKind::ConnectionReset && rest.is_empty(),
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Each request body gets the reply the protocol prescribes; a malformed one gets
    /// "bad request" and the connection is closed; a well-formed one leaves it usable.
    #[test]
    fn store_server_decodes_requests(body in arb_store_body()) {
        let mut s = connect_authenticated(store_server());
        write_frame(&mut s, &body).unwrap();
        let reply = read_frame(&mut s, MAX_STORE_FRAME).unwrap();
        prop_assert!(!reply.is_empty());
        let mut r = Reader::new(&reply[1..]);
        match model_store(&body) {
            StoreReq::Set => prop_assert_eq!(&reply[..], &[0u8][..]),
            StoreReq::Get(_) => match reply[0] {
                0 => { r.bytes().unwrap(); r.finish().unwrap(); }
                1 => r.finish().unwrap(),
                s => prop_assert!(false, "GET answered with status {}", s),
            },
            StoreReq::Add => match reply[0] {
                0 => { r.i64().unwrap(); r.finish().unwrap(); }
                2 => { r.str().unwrap(); r.finish().unwrap(); }
                s => prop_assert!(false, "ADD answered with status {}", s),
            },
            StoreReq::Bad => {
                prop_assert_eq!(reply[0], 4, "malformed request {:?} answered {:?}", body, reply);
                r.str().unwrap();
                r.finish().unwrap();
                prop_assert!(closes_silently(&mut s), "connection kept after a bad request");
                return Ok(());
            }
        }
        // Still serving this connection.
        let mut w = Writer::new();
        w.u8(1).str("probe").bytes(b"x");
        write_frame(&mut s, &w.finish()).unwrap();
        prop_assert_eq!(read_frame(&mut s, 16).unwrap(), vec![0u8]);
    }

    /// Raw bytes after the handshake (frames with lying or huge prefixes, then end of stream):
    /// the server answers each complete frame the model finds, then closes.
    #[test]
    fn store_server_frame_reader(frames in prop::collection::vec(arb_store_body(), 0..3),
                                 tail in arb_frame_stream()) {
        let mut stream = Vec::new();
        for b in &frames {
            stream.extend_from_slice(&(b.len() as u32).to_le_bytes());
            stream.extend_from_slice(b);
        }
        stream.extend_from_slice(&tail);
        let (model, _) = model_frames(&stream, MAX_STORE_FRAME);
        // The server stops at the first bad request, so answers stop there too.
        let answered = model.iter().position(|b| model_store(b) == StoreReq::Bad)
            .map_or(model.len(), |i| i + 1);
        let mut s = connect_authenticated(store_server());
        // The server may drop us before taking everything (a bad request ends the connection).
        let _ = s.write_all(&stream);
        let _ = s.shutdown(Shutdown::Write);
        for body in &model[..answered] {
            let reply = read_frame(&mut s, MAX_STORE_FRAME).unwrap();
            let bad = model_store(body) == StoreReq::Bad;
            prop_assert_eq!(reply[0] == 4, bad, "request {:?} answered {:?}", body, reply);
        }
        prop_assert!(closes_silently(&mut s), "more replies than complete requests");
    }

    /// Bytes instead of a handshake: the server sends its greeting and nothing else, ever,
    /// and keeps serving clients that know the secret.
    #[test]
    fn store_server_rejects_unauthenticated_bytes(junk in prop::collection::vec(any::<u8>(), 0..120),
                                                  framed in any::<bool>()) {
        let addr = store_server();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(IO)).unwrap();
        let junk = if framed {
            // A well-formed store request where the handshake should be.
            let mut w = Writer::new();
            w.u8(1).str("STOLEN!").bytes(&junk);
            let mut f = Vec::new();
            write_frame(&mut f, &w.finish()).unwrap();
            f
        } else {
            junk
        };
        // The server may drop us before taking everything: that is the point.
        let _ = s.write_all(&junk);
        let _ = s.shutdown(Shutdown::Write);
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        prop_assert!(got.len() <= 36, "server sent {} bytes to a stranger", got.len());
        if !got.is_empty() {
            prop_assert_eq!(&got[..4], b"FVA1");
        }
        let c = TcpStore::connect(addr, SECRET, IO).unwrap();
        prop_assert!(matches!(c.get("STOLEN!", Duration::ZERO), Err(Error::Timeout { .. })),
                     "an unauthenticated SET reached the store");
    }
}

/// A fake store server that authenticates, then answers one request with `reply` (raw bytes,
/// not framed by us) and closes.
fn hostile_store(reply: Vec<u8>) -> (SocketAddr, thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        authenticate(&mut s, SECRET, false, IO).unwrap();
        s.set_read_timeout(Some(IO)).unwrap();
        let _ = read_frame(&mut s, MAX_STORE_FRAME);
        let _ = s.write_all(&reply);
    });
    (addr, h)
}

proptest! {
    #![proptest_config(config(64))]

    /// The store client decodes any reply without panicking or allocating for lying prefixes.
    #[test]
    fn store_client_decodes_hostile_replies(
        body in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..40),
            (0u8..6, prop::collection::vec(any::<u8>(), 0..24)).prop_map(|(s, b)| {
                let mut v = vec![s];
                v.extend_from_slice(&b);
                v
            }),
        ],
        lying_prefix in prop::option::of(arb_huge()),
        which in 0u8..3,
    ) {
        let mut reply = Vec::new();
        match lying_prefix {
            Some(n) => reply.extend_from_slice(&n.to_le_bytes()),
            None => reply.extend_from_slice(&(body.len() as u32).to_le_bytes()),
        }
        reply.extend_from_slice(&body);
        let (addr, server) = hostile_store(reply);
        let c = TcpStore::connect(addr, SECRET, IO).unwrap();
        let (res, largest) = largest_alloc(|| match which {
            0 => c.get("k", Duration::ZERO).map(drop),
            1 => c.set("k", b"v"),
            _ => c.add("k", 1).map(drop),
        });
        server.join().unwrap();
        let bound = match lying_prefix {
            Some(n) if n as usize > MAX_STORE_FRAME => 64 * 1024,
            Some(n) => n as usize + 1024, // a prefix within the limit is read into its buffer
            None => 64 * 1024,
        };
        prop_assert!(largest <= bound, "allocated {}", largest);
        if lying_prefix.is_some_and(|n| n as usize != body.len()) {
            prop_assert!(res.is_err(), "a reply with a lying prefix was accepted");
        }
    }

    /// The initiator's side of the handshake against arbitrary answers: always an error (no
    /// answer made without the secret can be accepted), never a hang past the timeout.
    #[test]
    fn handshake_rejects_arbitrary_answers(answer in prop::collection::vec(any::<u8>(), 0..120),
                                           greet in any::<bool>()) {
        let (mut me, mut other) = loopback_pair();
        let mut answer = answer;
        if greet {
            // A well-formed greeting, so the garbage reaches the proof check.
            let mut g = b"FVA1".to_vec();
            g.extend_from_slice(&answer);
            answer = g;
        }
        other.write_all(&answer).unwrap();
        other.shutdown(Shutdown::Write).unwrap();
        let t = Duration::from_millis(500);
        let start = Instant::now();
        let res = authenticate(&mut me, SECRET, true, t);
        prop_assert!(matches!(res, Err(Error::Auth(_) | Error::Io(_) | Error::Timeout { .. })), "{:?}", res);
        prop_assert!(start.elapsed() < t + Duration::from_secs(1));
    }
}
