//! The only `unsafe` of the shared-memory transport: memfd + mmap, copies into and out of the
//! mapping, and descriptor passing.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A shared, read-write mapping of a whole memfd segment, unmapped on drop.
///
/// Within this process one thread at a time copies into or out of a given range (a link's
/// rings are its owner's; a host-memory segment's ranges are its caller's protocol: see the
/// `Sync` impl), so the copies below never race with each other. The *other* processes write
/// the same pages concurrently, but only regions their protocol gives them (the other ring
/// half and their own header words; their own offer record): the bytes we copy are ones the
/// peer published and will not touch until we advance our head, and the payload lent by
/// [`Mapping::bytes`] is one the peer will not touch until this side is done with it. A
/// misbehaving peer could only corrupt payload bytes (any bit pattern is a valid `u8`); indices
/// it writes are range-checked by the caller.
pub(in crate::transport) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value (like a `Box<[u8]>`); moving it
// to another thread moves the only handle to it.
unsafe impl Send for Mapping {}
// SAFETY: a host-memory segment is shared by the threads of this process that use it (the
// fast path under its lock, a sharded optimizer's steps between barriers): they never copy
// into or out of the same bytes at once, and the words they share are atomics. That is the
// same discipline the processes follow with each other (see above).
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A new sealed memfd of `len` zero bytes, and its mapping (not inherited by a fork).
    pub(in crate::transport) fn create(len: usize) -> io::Result<(OwnedFd, Mapping)> {
        Self::create_with(len, false)
    }

    /// [`Mapping::create`]; `inherit`: a forked child keeps the mapping (memory that
    /// torch tensors view, which a data-loader worker's copy of them may touch).
    pub(in crate::transport) fn create_with(
        len: usize,
        inherit: bool,
    ) -> io::Result<(OwnedFd, Mapping)> {
        let name = std::ffi::CString::new(super::shm::NAME_PREFIX).expect("no NUL in the prefix");
        // SAFETY: `name` is a valid NUL-terminated string that outlives the call; the flags
        // are plain integers. A negative return is handled.
        let fd = cvt(unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        })?;
        // SAFETY: `fd` was just returned by memfd_create, is open and owned by nobody else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(len as u64)?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own open descriptor with an integer argument.
        cvt(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
        let map = Self::map(file.as_fd(), len, inherit)?;
        Ok((OwnedFd::from(file), map))
    }

    /// Maps a segment received from a peer, after checking that it is exactly `len` bytes
    /// and sealed against shrinking (a shrink would turn our accesses into SIGBUS). The
    /// descriptor is closed on return; the mapping keeps the memory alive.
    pub(in crate::transport) fn open(fd: OwnedFd, len: usize) -> io::Result<Mapping> {
        Self::open_with(fd, len, false)
    }

    /// [`Mapping::open`]; `inherit` as for [`Mapping::create_with`].
    pub(in crate::transport) fn open_with(
        fd: OwnedFd,
        len: usize,
        inherit: bool,
    ) -> io::Result<Mapping> {
        let file = File::from(fd);
        let size = file.metadata()?.len();
        if size != len as u64 {
            return Err(io::Error::other(format!(
                "segment has {size} bytes, expected {len}"
            )));
        }
        // SAFETY: fcntl on an open descriptor we own, no pointer argument.
        let seals = cvt(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) })?;
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals & need != need {
            return Err(io::Error::other("segment is not sealed against resizing"));
        }
        Self::map(file.as_fd(), len, inherit)
    }

    fn map(fd: BorrowedFd<'_>, len: usize, inherit: bool) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping chosen by the kernel (null hint) of an open
        // descriptor whose size is at least `len` (set or checked by the callers, and
        // sealed); it aliases no Rust object. MAP_FAILED is handled.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = Mapping {
            ptr: NonNull::new(p.cast()).expect("mmap returned null without MAP_FIXED"),
            len,
        };
        if !inherit {
            // A forked child (a data-loader worker) must not inherit a writable view of
            // the rings. Advice only: failure changes nothing else.
            // SAFETY: the range is exactly the mapping created above.
            unsafe { libc::madvise(p, len, libc::MADV_DONTFORK) };
        }
        Ok(map)
    }

    /// Bytes mapped.
    pub(in crate::transport) fn len(&self) -> usize {
        self.len
    }

    /// The first mapped byte (the mapping lives as long as `self`).
    pub(in crate::transport) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The 8-byte header word at `off`.
    pub(super) fn atomic(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.len, "header offset {off}");
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned) as asserted; the
        // memory lives as long as `self`. AtomicU64 has interior mutability, so other
        // processes changing the word concurrently is exactly what atomics allow, and
        // any bit pattern is a valid u64.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// The 4-byte word at `off` (a futex word).
    pub(super) fn atomic32(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.len, "header offset {off}");
        // SAFETY: as for `atomic`, with a 4-aligned in-bounds u32.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
    }

    /// Copies `src` into the mapping at `off`.
    pub(super) fn write(&self, off: usize, src: &[u8]) {
        assert!(
            off <= self.len && src.len() <= self.len - off,
            "write out of range"
        );
        // SAFETY: the destination range is inside the mapping (asserted) and cannot overlap
        // `src`, a Rust slice outside it; no reference to this range exists (see the type's
        // doc for the peer's side).
        unsafe { crate::copy::copy_raw(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) };
    }

    /// The `len` bytes at `off`, lent while `self` is: only for bytes the other process
    /// published and, by the protocol of their region, does not write until this side says it
    /// is done with them (a peer's offer).
    pub(super) fn bytes(&self, off: usize, len: usize) -> &[u8] {
        assert!(
            off <= self.len && len <= self.len - off,
            "bytes out of range"
        );
        // SAFETY: in bounds as asserted, and the mapping lives as long as the borrow of
        // `self`. This process writes the peer's region never, and the peer not while the
        // protocol lends it (see the method's doc); a peer that breaks the protocol tears
        // values, and any bit pattern is a valid u8.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// Copies from the mapping at `off` into `dst`.
    pub(super) fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off <= self.len && dst.len() <= self.len - off,
            "read out of range"
        );
        // SAFETY: as for `write`, with the source inside the mapping and `dst` an exclusive
        // Rust slice outside it.
        unsafe { crate::copy::copy_raw(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len()) };
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range mapped in `map`, once; references handed out by
        // `atomic` borrow `self` and so are gone.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Blocks while `word` holds `seen`, at most `timeout` (a shared futex: the word is in a
/// mapping other processes share). Spurious returns are fine: callers re-check.
pub(super) fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT reads the aligned u32 behind `word` (alive for the call) and
    // sleeps; `ts` outlives the call; the unused arguments are null/0.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Wakes every thread (of any process) sleeping on `word`.
pub(super) fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; the other arguments are plain.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Sends `payload` with one descriptor attached (SCM_RIGHTS).
pub(in crate::transport) fn send_with_fd(
    sock: &UnixStream,
    payload: &[u8],
    fd: &OwnedFd,
) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    // u64 storage keeps the control buffer aligned for cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) };
    assert!(space as usize <= std::mem::size_of_val(&control));
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as usize;
    // SAFETY: `msg` points at `control`, large enough for one header with one int (checked
    // above), so CMSG_FIRSTHDR is non-null and CMSG_DATA is inside `control`; the data is
    // written unaligned-safe. sendmsg only reads `payload` (through `iov`) and `control`,
    // both alive for the call.
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
        libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != payload.len() {
        return Err(io::Error::other("short sendmsg"));
    }
    Ok(())
}

/// Receives one message without waiting: (bytes, the first descriptor attached). Any
/// other descriptors are closed. `WouldBlock` when nothing is queued.
pub(in crate::transport) fn recv_with_fd(
    sock: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 16];
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    let flags = libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC;
    // SAFETY: `iov` describes `buf`, exclusively borrowed, and `msg_control` describes
    // `control`; the kernel writes within those lengths only.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut first = None;
    // SAFETY: walks the control messages the kernel wrote into `control` with the CMSG_*
    // macros, which stay within `msg_controllen`; each SCM_RIGHTS payload holds
    // `(cmsg_len - CMSG_LEN(0)) / sizeof(int)` descriptors now owned by this process, each
    // read unaligned and wrapped exactly once (so every one is closed unless kept).
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let bytes = (*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if first.is_none() {
                        first = Some(fd);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, first))
}

/// Writes `bytes` without blocking and without SIGPIPE if the peer is gone.
pub(super) fn send_nosignal(sock: &UnixStream, bytes: &[u8]) -> io::Result<usize> {
    // SAFETY: send only reads `bytes`, alive for the call.
    let n = unsafe {
        libc::send(
            sock.as_raw_fd(),
            bytes.as_ptr().cast(),
            bytes.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
