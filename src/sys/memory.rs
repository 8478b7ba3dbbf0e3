//! Memory maps: anonymous private pages (the engine's buffer pool), and sealed memfd segments
//! that other processes of the host map as well (shared-memory links, host memory, the fast
//! path's offer records). Both lend their bytes as slices, so the layers above need no
//! `unsafe` to use them.

use std::fs::File;
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use parking_lot::{Mutex, MutexGuard};

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
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// Held while [`Mapping::bytes_mut`] lends bytes: one `&mut` into the mapping at a time.
    loan: Mutex<()>,
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
    /// A new sealed memfd named `name` (as `/proc/<pid>/fd` shows it; no NUL) of `len` zero
    /// bytes, and its mapping. `inherit`: a forked child keeps the mapping (memory that torch
    /// tensors view, which a data-loader worker's copy of them may touch); else a fork does
    /// not inherit it.
    pub fn create(name: &str, len: usize, inherit: bool) -> io::Result<(OwnedFd, Mapping)> {
        let name = std::ffi::CString::new(name)
            .map_err(|_| io::Error::other("a segment name with a NUL byte"))?;
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
    /// descriptor is closed on return; the mapping keeps the memory alive. `inherit` as for
    /// [`Mapping::create`].
    pub fn open(fd: OwnedFd, len: usize, inherit: bool) -> io::Result<Mapping> {
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
            loan: Mutex::new(()),
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
    pub fn len(&self) -> usize {
        self.len
    }

    /// The first mapped byte (the mapping lives as long as `self`).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The 8-byte header word at `off`.
    pub fn atomic(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.len, "header offset {off}");
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned) as asserted; the
        // memory lives as long as `self`. AtomicU64 has interior mutability, so other
        // processes changing the word concurrently is exactly what atomics allow, and
        // any bit pattern is a valid u64.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// The 4-byte word at `off` (a futex word).
    pub fn atomic32(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.len, "header offset {off}");
        // SAFETY: as for `atomic`, with a 4-aligned in-bounds u32.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
    }

    /// Copies `src` into the mapping at `off`.
    pub fn write(&self, off: usize, src: &[u8]) {
        assert!(
            off <= self.len && src.len() <= self.len - off,
            "write out of range"
        );
        // SAFETY: the destination range is inside the mapping (asserted) and cannot overlap
        // `src`, a Rust slice outside it; no reference to this range exists (see the type's
        // doc for the peer's side).
        unsafe { super::copy::copy_raw(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) };
    }

    /// The `len` bytes at `off`, lent while `self` is: only for bytes the other process
    /// published and, by the protocol of their region, does not write until this side says it
    /// is done with them (a peer's offer).
    pub fn bytes(&self, off: usize, len: usize) -> &[u8] {
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

    /// The `len` bytes at `off`, writable while the returned loan lives: the caller's own
    /// region of a segment (this rank's host memory), which no other process writes, nor reads
    /// while the caller's protocol says it is being written. A second loan from this mapping
    /// waits until the first ends, so no two `&mut` overlap.
    pub fn bytes_mut(&self, off: usize, len: usize) -> BytesMut<'_> {
        assert!(
            off <= self.len && len <= self.len - off,
            "bytes_mut out of range"
        );
        let loan = self.loan.lock();
        // SAFETY: in bounds as asserted, and the mapping lives as long as the borrow of
        // `self`. `loan` makes this the only `&mut` this mapping lends until it drops; the
        // other processes keep off the region by its protocol (see the method's doc), and one
        // that breaks it tears values, and any bit pattern is a valid u8.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) };
        BytesMut { bytes, _loan: loan }
    }

    /// Copies from the mapping at `off` into `dst`.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off <= self.len && dst.len() <= self.len - off,
            "read out of range"
        );
        // SAFETY: as for `write`, with the source inside the mapping and `dst` an exclusive
        // Rust slice outside it.
        unsafe { super::copy::copy_raw(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len()) };
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range mapped in `map`, once; references handed out by
        // `atomic` borrow `self` and so are gone.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Bytes of a [`Mapping`] lent for writing by [`Mapping::bytes_mut`], until this drops.
pub struct BytesMut<'a> {
    bytes: &'a mut [u8],
    _loan: MutexGuard<'a, ()>,
}

impl Deref for BytesMut<'_> {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl DerefMut for BytesMut<'_> {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

/// Private anonymous pages, read-write, owned like a `Box<[u8]>` and unmapped on drop: zeros
/// when first mapped, then whatever was written to them.
pub struct Pages {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the pages are plain memory that only this value refers to (like a `Box<[u8]>`):
// moving it to another thread moves the only handle to them.
unsafe impl Send for Pages {}
// SAFETY: shared access only reads the bytes (`as_slice`); writing needs `&mut self`.
unsafe impl Sync for Pages {}

impl Pages {
    /// `len` bytes (more than 0) of new pages, at an address of the kernel's choosing.
    pub fn map(len: usize) -> io::Result<Pages> {
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
        // no existing memory; the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast()).expect("mmap returned null without MAP_FIXED");
        Ok(Pages { ptr, len })
    }

    /// Bytes mapped.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Read access to every byte.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, initialized (zero pages or earlier
        // writes), and only this value refers to it until it drops.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Write access to every byte.
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and writable; `&mut self` makes this the only live view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range mapped in `map`, once; the slices lent borrow
        // `self` and so are gone.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
