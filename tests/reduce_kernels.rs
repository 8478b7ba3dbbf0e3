//! Reduction and scaling kernels against scalar references written here: every dtype and op,
//! random bit patterns (so NaN, infinities, subnormals and integer overflow all occur), lengths
//! around the kernels' block size, and byte offsets that make the buffers unaligned.
//!
//! `f32_sum_throughput` (ignored) measures the f32 sum kernel on 16 MiB buffers:
//! `cargo test --release --test reduce_kernels -- --ignored --nocapture`.

use std::time::Instant;

use _core::collective::reduce::{reduce_into, reduce_pair, scale};
use _core::{DType, Error, ReduceOp};
use half::{bf16, f16};

const REDUCIBLE: [DType; 9] = DType::REDUCIBLE;
const OPS: [ReduceOp; 5] = ReduceOp::ELEMENTWISE;

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// `op` on two scalars as NumPy defines it for floats (NaN wins in min/max).
fn float_op(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Average => a + b,
        ReduceOp::Product => a * b,
        _ if a.is_nan() || b.is_nan() => f64::NAN,
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        ReduceOp::Adasum => unreachable!(),
    }
}

macro_rules! int_ref {
    ($t:ty, $op:expr, $a:expr, $b:expr) => {{
        let (a, b) = (
            <$t>::from_ne_bytes($a.try_into().unwrap()),
            <$t>::from_ne_bytes($b.try_into().unwrap()),
        );
        // Widened arithmetic truncated back: wrapping without the kernel's wrapping_* calls.
        let w = match $op {
            ReduceOp::Sum | ReduceOp::Average => (a as i128 + b as i128) as $t,
            ReduceOp::Product => (a as i128).wrapping_mul(b as i128) as $t,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Adasum => unreachable!(),
        };
        w.to_ne_bytes().to_vec()
    }};
}

/// The expected bytes of `op(a, b)` for one element. Floats: f32/f64 in their own precision;
/// f16/bf16 through f32 with one round-to-nearest-even at the end.
fn reference(dtype: DType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    let h = |c: &[u8]| u16::from_ne_bytes(c.try_into().unwrap());
    match dtype {
        DType::U8 => int_ref!(u8, op, a, b),
        DType::I8 => int_ref!(i8, op, a, b),
        DType::I16 => int_ref!(i16, op, a, b),
        DType::I32 => int_ref!(i32, op, a, b),
        DType::I64 => int_ref!(i64, op, a, b),
        DType::F16 => {
            let (x, y) = (f16::from_bits(h(a)).to_f32(), f16::from_bits(h(b)).to_f32());
            let r = match op {
                ReduceOp::Sum | ReduceOp::Average => x + y,
                ReduceOp::Product => x * y,
                _ => float_op(op, x as f64, y as f64) as f32,
            };
            f16::from_f32(r).to_bits().to_ne_bytes().to_vec()
        }
        DType::BF16 => {
            let (x, y) = (
                bf16::from_bits(h(a)).to_f32(),
                bf16::from_bits(h(b)).to_f32(),
            );
            let r = match op {
                ReduceOp::Sum | ReduceOp::Average => x + y,
                ReduceOp::Product => x * y,
                _ => float_op(op, x as f64, y as f64) as f32,
            };
            bf16::from_f32(r).to_bits().to_ne_bytes().to_vec()
        }
        DType::F32 => {
            let (x, y) = (
                f32::from_ne_bytes(a.try_into().unwrap()),
                f32::from_ne_bytes(b.try_into().unwrap()),
            );
            let r = match op {
                ReduceOp::Sum | ReduceOp::Average => x + y,
                ReduceOp::Product => x * y,
                _ => float_op(op, x as f64, y as f64) as f32,
            };
            r.to_ne_bytes().to_vec()
        }
        DType::F64 => {
            let (x, y) = (
                f64::from_ne_bytes(a.try_into().unwrap()),
                f64::from_ne_bytes(b.try_into().unwrap()),
            );
            float_op(op, x, y).to_ne_bytes().to_vec()
        }
        DType::Bool => unreachable!(),
    }
}

/// Element value as f64 (for comparisons that treat all NaNs alike and +0 == -0).
fn as_f64(dtype: DType, c: &[u8]) -> f64 {
    let h = || u16::from_ne_bytes(c.try_into().unwrap());
    match dtype {
        DType::F16 => f16::from_bits(h()).to_f64(),
        DType::BF16 => bf16::from_bits(h()).to_f64(),
        DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
        DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
        _ => unreachable!(),
    }
}

fn same_elem(dtype: DType, got: &[u8], want: &[u8]) -> bool {
    if !dtype.is_float() {
        return got == want;
    }
    let (g, w) = (as_f64(dtype, got), as_f64(dtype, want));
    (g.is_nan() && w.is_nan()) || g == w
}

#[test]
fn reduce_matches_scalar_reference_aligned_and_not() {
    for (d, dtype) in REDUCIBLE.into_iter().enumerate() {
        let es = dtype.size();
        for (o, op) in OPS.into_iter().enumerate() {
            for len in [0usize, 1, 3, 255, 256, 257, 1000] {
                for (acc_off, src_off) in [(0, 0), (1, 0), (0, 3), (1, 1), (es - 1, 2)] {
                    let seed = (d * 100 + o * 10) as u64 + len as u64 * 7;
                    let a0 = random_bytes(seed, len * es);
                    let s0 = random_bytes(seed + 1, len * es);
                    let mut acc = vec![0u8; len * es + acc_off];
                    acc[acc_off..].copy_from_slice(&a0);
                    let mut src = vec![0u8; len * es + src_off];
                    src[src_off..].copy_from_slice(&s0);
                    reduce_into(dtype, op, &mut acc[acc_off..], &src[src_off..]).unwrap();
                    let got = &acc[acc_off..];
                    for i in 0..len {
                        let e = i * es..(i + 1) * es;
                        let want = reference(dtype, op, &a0[e.clone()], &s0[e.clone()]);
                        assert!(
                            same_elem(dtype, &got[e.clone()], &want),
                            "{} {} len {len} offsets ({acc_off},{src_off}) element {i}: \
                             {:?} op {:?} = {:?}, want {want:?}",
                            dtype.name(),
                            op.name(),
                            &a0[e.clone()],
                            &s0[e.clone()],
                            &got[e]
                        );
                    }
                }
            }
        }
    }
}

/// `reduce_pair` writes `op(a, b)` into a third buffer block by block: the reference's bits
/// across its block boundaries (8 KiB) and unaligned, and its operands untouched.
#[test]
fn reduce_pair_matches_scalar_reference_across_blocks() {
    for (d, dtype) in REDUCIBLE.into_iter().enumerate() {
        let es = dtype.size();
        for (o, op) in OPS.into_iter().enumerate() {
            for len in [0usize, 1, 2047, 2048 + 3, 8192 / es * 3 + 5] {
                for off in [0, 1, es - 1] {
                    let seed = (d * 100 + o * 10) as u64 + len as u64 * 13;
                    let a = random_bytes(seed, len * es);
                    let b = random_bytes(seed + 2, len * es);
                    let mut dst = vec![0x77u8; len * es + off];
                    reduce_pair(dtype, op, &mut dst[off..], &a, &b).unwrap();
                    assert_eq!(a, random_bytes(seed, len * es), "first operand written");
                    for i in 0..len {
                        let e = i * es..(i + 1) * es;
                        let want = reference(dtype, op, &a[e.clone()], &b[e.clone()]);
                        assert!(
                            same_elem(dtype, &dst[off..][e.clone()], &want),
                            "{} {} len {len} offset {off} element {i}",
                            dtype.name(),
                            op.name(),
                        );
                    }
                }
            }
        }
    }
    let err = reduce_pair(DType::F32, ReduceOp::Sum, &mut [0; 8], &[0; 8], &[0; 4]);
    assert!(matches!(err, Err(Error::InvalidArgument(_))), "{err:?}");
}

#[test]
fn half_precision_rounds_to_nearest_even_once() {
    // 1 + 2^-10 (odd last bit) plus half an ulp is a tie: it rounds up to the even 1 + 2^-9.
    let mut acc = f16::from_f32(1.0 + 2f32.powi(-10)).to_bits().to_ne_bytes();
    let src = f16::from_f32(2f32.powi(-11)).to_bits().to_ne_bytes();
    reduce_into(DType::F16, ReduceOp::Sum, &mut acc, &src).unwrap();
    assert_eq!(
        f16::from_bits(u16::from_ne_bytes(acc)).to_f32(),
        1.0 + 2f32.powi(-9)
    );
    // 1 + half an ulp ties down to the even 1.
    let mut acc = bf16::ONE.to_bits().to_ne_bytes();
    let src = bf16::from_f32(2f32.powi(-8)).to_bits().to_ne_bytes();
    reduce_into(DType::BF16, ReduceOp::Sum, &mut acc, &src).unwrap();
    assert_eq!(bf16::from_bits(u16::from_ne_bytes(acc)), bf16::ONE);
    // f16 overflow goes to infinity, as NumPy's float16 does.
    let mut acc = f16::MAX.to_bits().to_ne_bytes();
    reduce_into(
        DType::F16,
        ReduceOp::Sum,
        &mut acc,
        &f16::MAX.to_bits().to_ne_bytes(),
    )
    .unwrap();
    assert_eq!(f16::from_bits(u16::from_ne_bytes(acc)), f16::INFINITY);
}

#[test]
fn integers_wrap_like_numpy() {
    let mut a = [127u8, 0x80, 255];
    reduce_into(DType::I8, ReduceOp::Sum, &mut a, &[1, 0xff, 1]).unwrap();
    assert_eq!(a.map(|x| x as i8), [-128, 127, 0]);
    let mut m = i64::MIN.to_ne_bytes();
    reduce_into(
        DType::I64,
        ReduceOp::Product,
        &mut m,
        &(-1i64).to_ne_bytes(),
    )
    .unwrap();
    assert_eq!(i64::from_ne_bytes(m), i64::MIN);
    let mut u = [200u8, 16];
    reduce_into(DType::U8, ReduceOp::Product, &mut u, &[2, 16]).unwrap();
    assert_eq!(u, [144, 0]);
}

fn scale_ref(dtype: DType, c: &[u8], f: f64) -> Vec<u8> {
    macro_rules! int {
        ($t:ty) => {{
            let x = <$t>::from_ne_bytes(c.try_into().unwrap()) as f64 * f;
            let t = x.trunc().clamp(<$t>::MIN as f64, <$t>::MAX as f64);
            (t as $t).to_ne_bytes().to_vec()
        }};
    }
    let h = || u16::from_ne_bytes(c.try_into().unwrap());
    match dtype {
        DType::U8 => int!(u8),
        DType::I8 => int!(i8),
        DType::I16 => int!(i16),
        DType::I32 => int!(i32),
        DType::I64 => int!(i64),
        DType::F16 => f16::from_f32(f16::from_bits(h()).to_f32() * f as f32)
            .to_bits()
            .to_ne_bytes()
            .to_vec(),
        DType::BF16 => bf16::from_f32(bf16::from_bits(h()).to_f32() * f as f32)
            .to_bits()
            .to_ne_bytes()
            .to_vec(),
        DType::F32 => (f32::from_ne_bytes(c.try_into().unwrap()) * f as f32)
            .to_ne_bytes()
            .to_vec(),
        DType::F64 => (f64::from_ne_bytes(c.try_into().unwrap()) * f)
            .to_ne_bytes()
            .to_vec(),
        DType::Bool => unreachable!(),
    }
}

#[test]
fn scale_matches_scalar_reference() {
    for (d, dtype) in REDUCIBLE.into_iter().enumerate() {
        let es = dtype.size();
        for factor in [0.5, -1.5, 3.0, 1.0 / 3.0, 0.0] {
            for off in [0, 1] {
                let len = 300;
                let orig = random_bytes(d as u64 + 1000, len * es);
                let mut buf = vec![0u8; len * es + off];
                buf[off..].copy_from_slice(&orig);
                scale(dtype, &mut buf[off..], factor).unwrap();
                for i in 0..len {
                    let e = i * es..(i + 1) * es;
                    let want = scale_ref(dtype, &orig[e.clone()], factor);
                    assert!(
                        same_elem(dtype, &buf[off..][e.clone()], &want),
                        "{} x {factor} element {i}: {:?} -> {:?}, want {want:?}",
                        dtype.name(),
                        &orig[e.clone()],
                        &buf[off..][e]
                    );
                }
            }
        }
        // Factor 1 leaves the bytes alone (NaN payloads included).
        let orig = random_bytes(7, 64 * es);
        let mut buf = orig.clone();
        scale(dtype, &mut buf, 1.0).unwrap();
        assert_eq!(buf, orig);
    }
}

#[test]
fn integer_average_truncates_toward_zero() {
    let vals = [7i32, -7, 9, -9];
    let mut b: Vec<u8> = vals.iter().flat_map(|v| v.to_ne_bytes()).collect();
    scale(DType::I32, &mut b, 0.25).unwrap();
    let got: Vec<i32> = b
        .chunks_exact(4)
        .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, vec![1, -1, 2, -2]);
}

#[test]
fn invalid_inputs_are_errors() {
    let mut a = [0u8; 8];
    let bad = |r: Result<(), Error>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(bad(reduce_into(
        DType::Bool,
        ReduceOp::Max,
        &mut a,
        &[0; 8]
    )));
    assert!(bad(reduce_into(
        DType::F32,
        ReduceOp::Adasum,
        &mut a,
        &[0; 8]
    )));
    assert!(bad(reduce_into(
        DType::F64,
        ReduceOp::Sum,
        &mut a[..4],
        &[0; 4]
    )));
    assert!(bad(reduce_into(DType::F32, ReduceOp::Sum, &mut a, &[0; 4])));
    assert!(bad(scale(DType::I32, &mut a[..3], 2.0)));
    assert!(bad(scale(DType::Bool, &mut a, 2.0)));
}

/// Throughput of the f32 sum kernel on 16 MiB buffers (run in release, see the module doc).
#[test]
#[ignore]
fn f32_sum_throughput() {
    let len = 16 << 20;
    for (name, dtype) in [
        ("f32", DType::F32),
        ("f16", DType::F16),
        ("bf16", DType::BF16),
    ] {
        for off in [0, 1] {
            let mut acc = vec![0u8; len + off];
            let src = vec![0u8; len + off];
            reduce_into(dtype, ReduceOp::Sum, &mut acc[off..], &src[off..]).unwrap();
            let iters = 20;
            let t = Instant::now();
            for _ in 0..iters {
                reduce_into(dtype, ReduceOp::Sum, &mut acc[off..], &src[off..]).unwrap();
            }
            let s = t.elapsed().as_secs_f64() / iters as f64;
            eprintln!(
                "{name} sum, 16 MiB, {}: {:.2} ms, {:.1} GB/s of buffer ({:.1} GB/s memory traffic)",
                if off == 0 { "aligned" } else { "unaligned" },
                s * 1e3,
                len as f64 / s / 1e9,
                3.0 * len as f64 / s / 1e9
            );
        }
    }
}
