//! Copies of host bytes that keep clear of one trap of `memcpy` on current AMD processors.
//!
//! **Why.** glibc copies a block from a few KiB up to about the L2 cache's size with `rep
//! movsb` when the processor says it is fast (ERMS/FSRM, as AMD's Zen 3 and 4 do). On those
//! processors it is 17-25x slower when the destination lies 1-31 bytes after the source
//! modulo 4 KiB: a 64 KiB copy took 23.7 us instead of 1.4 us on the development VM (AMD
//! EPYC). Two buffers the C heap hands out one after the other are exactly that far apart (a
//! 16-byte chunk header), so the engine's copies into fresh outputs, fusion buffers and
//! shared-memory rings hit it by chance, and a benchmark's small and middle sizes swung by
//! 10x between runs. Copied in 2 KiB pieces, below the size glibc uses `rep movsb` for, the
//! same copy takes 1.4 us; every other copy goes to `memcpy` whole, which keeps its
//! non-temporal stores for large blocks.

use std::mem::MaybeUninit;

/// Pieces a copy in the slow band is cut into: below glibc's smallest `rep movsb` size.
const PIECE: usize = 2048;
/// Copies at least this long may be `rep movsb` copies...
const BAND_FROM: usize = PIECE + 1;
/// ...and copies this long no longer are (glibc stops below the L2 cache's size; 1 MiB
/// leaves room for larger caches).
const BAND_TO: usize = 1 << 20;
/// Destination-after-source distances (modulo a page) that are slow, with a margin.
const SLOW_DISTANCE: usize = 64;

/// Whether a `len`-byte copy from `src` to `dst` falls in the slow band.
fn in_slow_band(src: *const u8, dst: *const u8, len: usize) -> bool {
    let distance = (dst as usize).wrapping_sub(src as usize) % 4096;
    (BAND_FROM..BAND_TO).contains(&len) && distance != 0 && distance < SLOW_DISTANCE
}

/// `dst` = `src` (slices of one length; panics otherwise, as `copy_from_slice` does).
pub fn copy(dst: &mut [u8], src: &[u8]) {
    if in_slow_band(src.as_ptr(), dst.as_ptr(), src.len()) {
        for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            d.copy_from_slice(s);
        }
    } else {
        dst.copy_from_slice(src);
    }
}

/// Appends `src` to `dst` (as `extend_from_slice`).
pub fn extend(dst: &mut Vec<u8>, src: &[u8]) {
    dst.reserve(src.len());
    let at = dst.len();
    let spare: &mut [MaybeUninit<u8>] = &mut dst.spare_capacity_mut()[..src.len()];
    // SAFETY: `spare` is `src.len()` bytes of `dst`'s allocation past its length (reserved
    // above), which no one else references, and `src` cannot overlap it (a shared borrow
    // beside the exclusive one of `dst`).
    unsafe { copy_raw(src.as_ptr(), spare.as_mut_ptr().cast(), src.len()) };
    // SAFETY: the `src.len()` bytes past the old length were just written.
    unsafe { dst.set_len(at + src.len()) };
}

/// Copies `len` bytes from `src` to `dst`, as `std::ptr::copy_nonoverlapping`.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping::<u8>`: `src` readable and `dst` writable for `len`
/// bytes, the two ranges not overlapping.
pub(super) unsafe fn copy_raw(src: *const u8, dst: *mut u8, len: usize) {
    if !in_slow_band(src, dst, len) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let mut at = 0;
    while at < len {
        let n = PIECE.min(len - at);
        // SAFETY: `at + n <= len`, inside both ranges of the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n) };
        at += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_appends_every_byte_at_every_distance() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut space = vec![0u8; 80_000];
        for len in [0, 1, 2048, 2049, 5000, 65_536, 69_000] {
            for shift in [0, 1, 16, 31, 63, 64, 100] {
                let dst = &mut space[shift..shift + len];
                copy(dst, &src[..len]);
                assert_eq!(dst, &src[..len], "len {len} shift {shift}");
                let mut v = vec![9u8; shift];
                extend(&mut v, &src[..len]);
                assert_eq!(&v[..shift], &vec![9u8; shift][..]);
                assert_eq!(&v[shift..], &src[..len]);
            }
        }
    }

    #[test]
    fn the_band_is_the_slow_distances_of_middle_sizes() {
        let p = 0x10_000 as *const u8;
        assert!(in_slow_band(p, p.wrapping_add(16), 65_536));
        assert!(in_slow_band(p, p.wrapping_add(4096 + 16), 4096));
        assert!(!in_slow_band(p, p.wrapping_add(64), 65_536));
        assert!(!in_slow_band(p, p.wrapping_add(4096), 65_536));
        assert!(!in_slow_band(p.wrapping_add(16), p, 65_536));
        assert!(!in_slow_band(p, p.wrapping_add(16), 2048));
        assert!(!in_slow_band(p, p.wrapping_add(16), 1 << 20));
    }
}
