//! Elementwise reduction and scaling kernels per dtype.
//!
//! Buffers arrive as bytes (fusion buffers, user memory) and may be unaligned. When both are
//! aligned for the element type — the common case — the kernel runs as one plain loop over typed
//! slices, which the compiler vectorises; otherwise elements are copied through small aligned
//! stack blocks and the same loop runs on those. Dispatch on dtype and op happens once per call,
//! never per element.
//!
//! Semantics follow NumPy: integers wrap on overflow; `Min`/`Max` propagate NaN (like
//! `np.minimum`/`np.maximum`); f16/bf16 are widened to f32, combined, and rounded back to
//! nearest-even element by element.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::sys::copy::copy;
use crate::types::{DType, ReduceOp};

/// Elements per stack block in the unaligned and f16/bf16 paths (1 KiB of f32).
const BLOCK: usize = 256;

/// Plain numeric types that kernels view byte buffers as: `Pod` (any bit pattern a valid
/// value, no padding) is what lets `bytemuck` lend bytes as `[Self]` without a copy.
trait Elem: bytemuck::Pod + Default {
    /// Reads one element from exactly `size_of::<Self>()` native-endian bytes.
    fn load(b: &[u8]) -> Self;
    /// Writes this element into exactly `size_of::<Self>()` bytes.
    fn store(self, b: &mut [u8]);
}

macro_rules! impl_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$t>::from_ne_bytes(b.try_into().expect("element-sized chunk"))
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_ne_bytes());
            }
        }
    )*};
}
impl_elem!(u8, i8, i16, u16, i32, i64, f32, f64);

/// Views `b` as `[T]` when it starts on a `T` boundary (and is whole elements).
#[inline]
fn typed<T: Elem>(b: &[u8]) -> Option<&[T]> {
    bytemuck::try_cast_slice(b).ok()
}

/// Mutable form of [`typed`].
#[inline]
fn typed_mut<T: Elem>(b: &mut [u8]) -> Option<&mut [T]> {
    bytemuck::try_cast_slice_mut(b).ok()
}

/// Runs `kernel` over `acc`/`src` seen as `[T]` (equal lengths, whole elements).
#[inline(always)]
fn with_typed<T: Elem>(acc: &mut [u8], src: &[u8], kernel: impl Fn(&mut [T], &[T])) {
    let n = std::mem::size_of::<T>();
    if let Some(s) = typed::<T>(src) {
        if let Some(a) = typed_mut::<T>(acc) {
            kernel(a, s);
            return;
        }
    }
    let mut a = [T::default(); BLOCK];
    let mut s = [T::default(); BLOCK];
    for (ab, sb) in acc.chunks_mut(BLOCK * n).zip(src.chunks(BLOCK * n)) {
        let m = ab.len() / n;
        for (x, c) in a.iter_mut().zip(ab.chunks_exact(n)) {
            *x = T::load(c);
        }
        for (x, c) in s.iter_mut().zip(sb.chunks_exact(n)) {
            *x = T::load(c);
        }
        kernel(&mut a[..m], &s[..m]);
        for (x, c) in a[..m].iter().zip(ab.chunks_exact_mut(n)) {
            x.store(c);
        }
    }
}

/// Runs `kernel` over `buf` seen as `[T]`.
#[inline(always)]
fn with_typed_one<T: Elem>(buf: &mut [u8], kernel: impl Fn(&mut [T])) {
    let n = std::mem::size_of::<T>();
    if let Some(a) = typed_mut::<T>(buf) {
        kernel(a);
        return;
    }
    let mut a = [T::default(); BLOCK];
    for ab in buf.chunks_mut(BLOCK * n) {
        let m = ab.len() / n;
        for (x, c) in a.iter_mut().zip(ab.chunks_exact(n)) {
            *x = T::load(c);
        }
        kernel(&mut a[..m]);
        for (x, c) in a[..m].iter().zip(ab.chunks_exact_mut(n)) {
            x.store(c);
        }
    }
}

/// The vectorisable core: `acc[i] = f(acc[i], src[i])`.
#[inline(always)]
fn zip_apply<T: Copy>(acc: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (a, &b) in acc.iter_mut().zip(src) {
        *a = f(*a, b);
    }
}

/// Half-precision storage (as `u16` bits) widened to f32 block by block.
trait Half: Copy + 'static {
    fn widen(bits: &[u16], out: &mut [f32]);
    fn narrow(vals: &[f32], bits: &mut [u16]);
}

impl Half for f16 {
    #[inline(always)]
    fn widen(bits: &[u16], out: &mut [f32]) {
        bits.reinterpret_cast::<f16>().convert_to_f32_slice(out);
    }
    #[inline(always)]
    fn narrow(vals: &[f32], bits: &mut [u16]) {
        bits.reinterpret_cast_mut::<f16>()
            .convert_from_f32_slice(vals);
    }
}

/// bf16 is the upper half of an f32, so both directions are plain bit operations; written as
/// straight loops (rather than `half`'s per-element conversions) so they vectorise.
impl Half for bf16 {
    #[inline(always)]
    fn widen(bits: &[u16], out: &mut [f32]) {
        for (o, &b) in out.iter_mut().zip(bits) {
            *o = f32::from_bits(u32::from(b) << 16);
        }
    }
    #[inline(always)]
    fn narrow(vals: &[f32], bits: &mut [u16]) {
        for (b, &v) in bits.iter_mut().zip(vals) {
            let x = v.to_bits();
            // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit; a carry
            // into the exponent correctly overflows to infinity. NaNs keep their sign and
            // upper payload and are forced quiet, so they cannot round into an infinity.
            let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
            let nan = ((x >> 16) as u16) | 0x0040;
            *b = if v.is_nan() { nan } else { rounded };
        }
    }
}

/// `acc = f(acc, src)` on half-precision bits, through f32, rounding each result once.
#[inline(always)]
fn half_zip<H: Half>(acc: &mut [u16], src: &[u16], f: impl Fn(f32, f32) -> f32 + Copy) {
    let mut a = [0f32; BLOCK];
    let mut s = [0f32; BLOCK];
    for (ab, sb) in acc.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let m = ab.len();
        H::widen(ab, &mut a[..m]);
        H::widen(sb, &mut s[..m]);
        zip_apply(&mut a[..m], &s[..m], f);
        H::narrow(&a[..m], ab);
    }
}

/// `x = f(x)` on half-precision bits, through f32.
#[inline(always)]
fn half_map<H: Half>(buf: &mut [u16], f: impl Fn(f32) -> f32 + Copy) {
    let mut a = [0f32; BLOCK];
    for ab in buf.chunks_mut(BLOCK) {
        let m = ab.len();
        H::widen(ab, &mut a[..m]);
        for x in &mut a[..m] {
            *x = f(*x);
        }
        H::narrow(&a[..m], ab);
    }
}

/// NaN-propagating minimum (`np.minimum`): NaN if either operand is NaN.
#[inline(always)]
fn fmin<T: PartialOrd + Copy>(a: T, b: T) -> T {
    // `b != b` is the generic NaN test; when `a` is NaN, `b < a` is false and `a` is kept.
    #[allow(clippy::eq_op)]
    let b_nan = b != b;
    if b < a || b_nan {
        b
    } else {
        a
    }
}

/// NaN-propagating maximum (`np.maximum`).
#[inline(always)]
fn fmax<T: PartialOrd + Copy>(a: T, b: T) -> T {
    #[allow(clippy::eq_op)]
    let b_nan = b != b;
    if b > a || b_nan {
        b
    } else {
        a
    }
}

/// The reduce ops a kernel can run (Average is Sum; Adasum rejected before).
#[derive(Clone, Copy)]
enum Kind {
    Sum,
    Min,
    Max,
    Product,
}

fn kind(op: ReduceOp) -> Result<Kind> {
    Ok(match op {
        ReduceOp::Sum | ReduceOp::Average => Kind::Sum,
        ReduceOp::Min => Kind::Min,
        ReduceOp::Max => Kind::Max,
        ReduceOp::Product => Kind::Product,
        ReduceOp::Adasum => {
            return Err(Error::InvalidArgument(
                "Adasum reduction is not supported".into(),
            ))
        }
    })
}

/// Checks that `op` can reduce `dtype` (Bool and Adasum cannot).
pub fn check_reducible(dtype: DType, op: ReduceOp) -> Result<()> {
    kind(op)?;
    if dtype == DType::Bool {
        return Err(Error::InvalidArgument(format!(
            "{} reduction of bool tensors is not supported",
            op.name()
        )));
    }
    Ok(())
}

pub(super) fn check_len(dtype: DType, len: usize) -> Result<()> {
    if len % dtype.size() != 0 {
        return Err(Error::InvalidArgument(format!(
            "buffer of {len} bytes does not hold whole {} elements",
            dtype.name()
        )));
    }
    Ok(())
}

macro_rules! int_reduce {
    ($t:ty, $k:expr, $acc:expr, $src:expr) => {
        match $k {
            Kind::Sum => with_typed::<$t>($acc, $src, |a, s| zip_apply(a, s, <$t>::wrapping_add)),
            Kind::Product => {
                with_typed::<$t>($acc, $src, |a, s| zip_apply(a, s, <$t>::wrapping_mul))
            }
            Kind::Min => with_typed::<$t>($acc, $src, |a, s| zip_apply(a, s, Ord::min)),
            Kind::Max => with_typed::<$t>($acc, $src, |a, s| zip_apply(a, s, Ord::max)),
        }
    };
}

macro_rules! float_reduce {
    ($t:ty, $k:expr, $acc:expr, $src:expr) => {
        match $k {
            Kind::Sum => with_typed::<$t>($acc, $src, |a, s| zip_apply(a, s, |x, y| x + y)),
            Kind::Product => with_typed::<$t>($acc, $src, |a, s| zip_apply(a, s, |x, y| x * y)),
            Kind::Min => with_typed::<$t>($acc, $src, |a, s| zip_apply(a, s, fmin::<$t>)),
            Kind::Max => with_typed::<$t>($acc, $src, |a, s| zip_apply(a, s, fmax::<$t>)),
        }
    };
}

macro_rules! half_reduce {
    ($h:ty, $k:expr, $acc:expr, $src:expr) => {
        match $k {
            Kind::Sum => with_typed::<u16>($acc, $src, |a, s| half_zip::<$h>(a, s, |x, y| x + y)),
            Kind::Product => {
                with_typed::<u16>($acc, $src, |a, s| half_zip::<$h>(a, s, |x, y| x * y))
            }
            Kind::Min => with_typed::<u16>($acc, $src, |a, s| half_zip::<$h>(a, s, fmin::<f32>)),
            Kind::Max => with_typed::<u16>($acc, $src, |a, s| half_zip::<$h>(a, s, fmax::<f32>)),
        }
    };
}

/// `acc[i] = op(acc[i], src[i])` for every element. `Average` reduces as `Sum` (the caller
/// scales). `Bool` and `Adasum` are errors. Both slices hold whole elements of `dtype`, have
/// equal length, and may be unaligned.
pub fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) -> Result<()> {
    check_reducible(dtype, op)?;
    let k = kind(op)?;
    if acc.len() != src.len() {
        return Err(Error::InvalidArgument(format!(
            "reduce of unequal buffers ({} and {} bytes)",
            acc.len(),
            src.len()
        )));
    }
    check_len(dtype, acc.len())?;
    match dtype {
        DType::U8 => int_reduce!(u8, k, acc, src),
        DType::I8 => int_reduce!(i8, k, acc, src),
        DType::I16 => int_reduce!(i16, k, acc, src),
        DType::I32 => int_reduce!(i32, k, acc, src),
        DType::I64 => int_reduce!(i64, k, acc, src),
        DType::F32 => float_reduce!(f32, k, acc, src),
        DType::F64 => float_reduce!(f64, k, acc, src),
        DType::F16 => half_reduce!(f16, k, acc, src),
        DType::BF16 => half_reduce!(bf16, k, acc, src),
        DType::Bool => unreachable!("rejected by check_reducible"),
    }
    Ok(())
}

/// Bytes [`reduce_pair`] copies before it reduces them: well inside the L1 cache, so the
/// reduction reads back what the copy just wrote from there.
const PAIR_BLOCK_BYTES: usize = 8 << 10;

/// `dst[i] = op(a[i], b[i])` for every element: [`reduce_into`] on a copy of `a`, the same
/// bits, but one pass over memory (block by block, the copy still in cache) instead of two.
pub fn reduce_pair(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) -> Result<()> {
    if dst.len() != a.len() || dst.len() != b.len() {
        return Err(Error::InvalidArgument(format!(
            "reduce of unequal buffers ({}, {} and {} bytes)",
            dst.len(),
            a.len(),
            b.len()
        )));
    }
    check_reducible(dtype, op)?;
    check_len(dtype, dst.len())?;
    let block = PAIR_BLOCK_BYTES - PAIR_BLOCK_BYTES % dtype.size();
    for ((d, x), y) in dst
        .chunks_mut(block)
        .zip(a.chunks(block))
        .zip(b.chunks(block))
    {
        copy(d, x);
        reduce_into(dtype, op, d, y)?;
    }
    Ok(())
}

macro_rules! int_scale {
    ($t:ty, $buf:expr, $f:expr) => {
        // `as` from f64 truncates toward zero and saturates (NaN becomes 0).
        with_typed_one::<$t>($buf, |a| {
            for x in a {
                *x = (*x as f64 * $f) as $t;
            }
        })
    };
}

/// Multiplies every element by `factor` in place (floats in their own precision, f16/bf16
/// through f32, integers through f64 and truncated toward zero). No-op when `factor == 1.0`.
pub fn scale(dtype: DType, buf: &mut [u8], factor: f64) -> Result<()> {
    if factor == 1.0 {
        return Ok(());
    }
    if dtype == DType::Bool {
        return Err(Error::InvalidArgument(
            "bool tensors cannot be scaled".into(),
        ));
    }
    check_len(dtype, buf.len())?;
    match dtype {
        DType::U8 => int_scale!(u8, buf, factor),
        DType::I8 => int_scale!(i8, buf, factor),
        DType::I16 => int_scale!(i16, buf, factor),
        DType::I32 => int_scale!(i32, buf, factor),
        DType::I64 => int_scale!(i64, buf, factor),
        DType::F32 => {
            let f = factor as f32;
            with_typed_one::<f32>(buf, |a| a.iter_mut().for_each(|x| *x *= f))
        }
        DType::F64 => with_typed_one::<f64>(buf, |a| a.iter_mut().for_each(|x| *x *= factor)),
        DType::F16 => {
            let f = factor as f32;
            with_typed_one::<u16>(buf, |a| half_map::<f16>(a, |x| x * f))
        }
        DType::BF16 => {
            let f = factor as f32;
            with_typed_one::<u16>(buf, |a| half_map::<bf16>(a, |x| x * f))
        }
        DType::Bool => unreachable!("rejected above"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Elem>(v: &[T]) -> Vec<u8> {
        let n = std::mem::size_of::<T>();
        let mut out = vec![0u8; std::mem::size_of_val(v)];
        for (x, c) in v.iter().zip(out.chunks_exact_mut(n)) {
            x.store(c);
        }
        out
    }

    fn elems<T: Elem>(b: &[u8]) -> Vec<T> {
        b.chunks_exact(std::mem::size_of::<T>())
            .map(T::load)
            .collect()
    }

    #[test]
    fn unaligned_matches_aligned() {
        let a: Vec<f64> = (0..1000).map(|i| i as f64 * 0.5 - 3.0).collect();
        let s: Vec<f64> = (0..1000).map(|i| (i % 7) as f64 * 1.25).collect();
        let mut aligned = bytes(&a);
        reduce_into(DType::F64, ReduceOp::Sum, &mut aligned, &bytes(&s)).unwrap();
        // Shift both buffers by one byte inside larger allocations to force the fallback.
        let mut acc_store = vec![0u8; aligned.len() + 1];
        acc_store[1..].copy_from_slice(&bytes(&a));
        let mut src_store = vec![0u8; aligned.len() + 3];
        src_store[3..].copy_from_slice(&bytes(&s));
        reduce_into(
            DType::F64,
            ReduceOp::Sum,
            &mut acc_store[1..],
            &src_store[3..],
        )
        .unwrap();
        assert_eq!(&acc_store[1..], &aligned[..]);
        let want: Vec<f64> = a.iter().zip(&s).map(|(x, y)| x + y).collect();
        assert_eq!(elems::<f64>(&aligned), want);
    }

    #[test]
    fn nan_propagates_in_min_max() {
        let a = [1.0f32, f32::NAN, 3.0, -0.5];
        let s = [f32::NAN, 2.0, 1.0, -1.0];
        for (op, want) in [
            (ReduceOp::Min, [f32::NAN, f32::NAN, 1.0, -1.0]),
            (ReduceOp::Max, [f32::NAN, f32::NAN, 3.0, -0.5]),
        ] {
            let mut acc = bytes(&a);
            reduce_into(DType::F32, op, &mut acc, &bytes(&s)).unwrap();
            let got = elems::<f32>(&acc);
            for (g, w) in got.iter().zip(&want) {
                assert!(g == w || (g.is_nan() && w.is_nan()), "{op:?}: {got:?}");
            }
        }
    }

    #[test]
    fn rejects_bool_adasum_and_partial_elements() {
        let mut a = [0u8; 4];
        assert!(reduce_into(DType::Bool, ReduceOp::Sum, &mut a, &[0; 4]).is_err());
        assert!(reduce_into(DType::I32, ReduceOp::Adasum, &mut a, &[0; 4]).is_err());
        assert!(reduce_into(DType::I16, ReduceOp::Sum, &mut a[..3], &[0; 3]).is_err());
        assert!(reduce_into(DType::I16, ReduceOp::Sum, &mut a, &[0; 2]).is_err());
        assert!(scale(DType::Bool, &mut a, 2.0).is_err());
        assert!(scale(DType::Bool, &mut a, 1.0).is_ok());
    }

    #[test]
    fn integer_scale_truncates_toward_zero() {
        let mut b = bytes(&[7i32, -7, 5, i32::MAX]);
        scale(DType::I32, &mut b, 0.5).unwrap();
        assert_eq!(elems::<i32>(&b), vec![3, -3, 2, 1073741823]);
        let mut u = vec![200u8, 3];
        scale(DType::U8, &mut u, 2.0).unwrap();
        assert_eq!(u, vec![255, 6]);
    }
}
