//! Reference inputs and checks shared by the collective test suites: per-rank inputs derived
//! from a hash (so every rank can regenerate every other rank's), an exact fold in rank order,
//! and the comparison of each rank's bytes with it and with rank 0's.
//!
//! Each test binary uses a different part of this.
#![allow(dead_code)]

pub mod jobs;

use _core::comm::Communicator;
use _core::{collective, DType, ReduceOp, Reduction};
use half::{bf16, f16};

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub fn hash(rank: usize, i: usize, salt: u64) -> u64 {
    splitmix(splitmix(rank as u64 ^ salt.rotate_left(17)) ^ i as u64)
}

/// One element, held wide enough for an exact reference.
#[derive(Clone, Copy, Debug)]
pub enum V {
    /// Integers, exactly.
    I(i128),
    /// Floats, widened.
    F(f64),
}

/// Rank `rank`'s element `i`. Integers use the whole range so sums and products wrap. Floats
/// are dyadic: multiples of 1/8 in ±12.5 (sums of up to five stay exact in f32, f64 and f16),
/// factors from a short table for products, and a NaN now and then on one rank.
pub fn input(dtype: DType, op: ReduceOp, rank: usize, i: usize, n: usize) -> V {
    let h = hash(rank, i, dtype as u64 * 8 + op as u64);
    if !dtype.is_float() {
        return V::I(wrap(dtype, h as i64 as i128));
    }
    if i % 53 == 7 && rank == (i / 53) % n {
        return V::F(f64::NAN);
    }
    if op == ReduceOp::Product {
        const F: [f64; 8] = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, -1.0, -0.5];
        V::F(F[(h % 8) as usize])
    } else {
        V::F((h % 201) as f64 / 8.0 - 12.5)
    }
}

pub fn wrap(dtype: DType, x: i128) -> i128 {
    match dtype {
        DType::U8 => x as u8 as i128,
        DType::I8 => x as i8 as i128,
        DType::I16 => x as i16 as i128,
        DType::I32 => x as i32 as i128,
        DType::I64 => x as i64 as i128,
        _ => unreachable!(),
    }
}

pub fn encode(dtype: DType, vals: &[V]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match (dtype, v) {
            (DType::U8, V::I(x)) => out.push(x as u8),
            (DType::I8, V::I(x)) => out.push(x as i8 as u8),
            (DType::I16, V::I(x)) => out.extend((x as i16).to_ne_bytes()),
            (DType::I32, V::I(x)) => out.extend((x as i32).to_ne_bytes()),
            (DType::I64, V::I(x)) => out.extend((x as i64).to_ne_bytes()),
            (DType::F16, V::F(x)) => out.extend(f16::from_f64(x).to_bits().to_ne_bytes()),
            (DType::BF16, V::F(x)) => out.extend(bf16::from_f64(x).to_bits().to_ne_bytes()),
            (DType::F32, V::F(x)) => out.extend((x as f32).to_ne_bytes()),
            (DType::F64, V::F(x)) => out.extend(x.to_ne_bytes()),
            _ => unreachable!(),
        }
    }
    out
}

pub fn decode(dtype: DType, b: &[u8]) -> Vec<V> {
    b.chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::U8 => V::I(c[0] as i128),
            DType::I8 => V::I(c[0] as i8 as i128),
            DType::I16 => V::I(i16::from_ne_bytes(c.try_into().unwrap()) as i128),
            DType::I32 => V::I(i32::from_ne_bytes(c.try_into().unwrap()) as i128),
            DType::I64 => V::I(i64::from_ne_bytes(c.try_into().unwrap()) as i128),
            DType::F16 => V::F(f16::from_bits(u16::from_ne_bytes(c.try_into().unwrap())).into()),
            DType::BF16 => V::F(bf16::from_bits(u16::from_ne_bytes(c.try_into().unwrap())).into()),
            DType::F32 => V::F(f32::from_ne_bytes(c.try_into().unwrap()) as f64),
            DType::F64 => V::F(f64::from_ne_bytes(c.try_into().unwrap())),
            _ => unreachable!(),
        })
        .collect()
}

/// Sequential fold in rank order: wrapping i128 truncated to the dtype, or f64 with NumPy's
/// NaN rules for min/max.
pub fn fold(dtype: DType, op: ReduceOp, vals: &[V]) -> V {
    let mut it = vals.iter().copied();
    let first = it.next().unwrap();
    it.fold(first, |a, b| match (a, b) {
        (V::I(a), V::I(b)) => V::I(wrap(
            dtype,
            match op {
                ReduceOp::Sum | ReduceOp::Average => a.wrapping_add(b),
                ReduceOp::Product => a.wrapping_mul(b),
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
                ReduceOp::Adasum => unreachable!(),
            },
        )),
        (V::F(a), V::F(b)) => V::F(match op {
            ReduceOp::Sum | ReduceOp::Average => a + b,
            ReduceOp::Product => a * b,
            _ if a.is_nan() || b.is_nan() => f64::NAN,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Adasum => unreachable!(),
        }),
        _ => unreachable!(),
    })
}

/// Compares one result element: exact, except that f16/bf16 sums and products (rounded at
/// every step) may differ by a few units in the last place of the magnitudes involved.
///
/// `what` names the element in a failure; it is formatted only then (a `format_args!`), since
/// the large cases check millions of elements.
pub fn check_elem(
    dtype: DType,
    op: ReduceOp,
    got: V,
    want: V,
    inputs: &[V],
    what: impl std::fmt::Display,
) {
    match (got, want) {
        (V::I(g), V::I(w)) => assert_eq!(g, w, "{what}"),
        (V::F(g), V::F(w)) => {
            if w.is_nan() || g.is_nan() {
                assert!(w.is_nan() && g.is_nan(), "{what}: got {g}, want {w}");
                return;
            }
            let ulp = match dtype {
                DType::F16 => 2f64.powi(-10),
                DType::BF16 => 2f64.powi(-7),
                _ => 0.0,
            };
            let scale = match op {
                ReduceOp::Product => w.abs(),
                _ => inputs
                    .iter()
                    .map(|v| if let V::F(x) = v { x.abs() } else { 0.0 })
                    .sum(),
            };
            let tol = ulp * scale * inputs.len() as f64;
            assert!(
                (g - w).abs() <= tol,
                "{what}: got {g}, want {w} (tol {tol})"
            );
        }
        _ => unreachable!(),
    }
}

/// Checks every rank's allreduce result against the reference and against rank 0's bytes.
pub fn check_allreduce(dtype: DType, op: ReduceOp, count: usize, results: &[Vec<u8>], what: &str) {
    let n = results.len();
    for (r, res) in results.iter().enumerate() {
        assert_eq!(
            res, &results[0],
            "{what}: rank {r} differs bitwise from rank 0"
        );
    }
    let got = decode(dtype, &results[0]);
    assert_eq!(got.len(), count, "{what}");
    // Every rank's input as the dtype holds it (rounded through its bytes).
    let inputs: Vec<Vec<V>> = (0..n)
        .map(|r| {
            let vals: Vec<V> = (0..count).map(|i| input(dtype, op, r, i, n)).collect();
            decode(dtype, &encode(dtype, &vals))
        })
        .collect();
    let mut column = Vec::with_capacity(n);
    for (i, &g) in got.iter().enumerate() {
        column.clear();
        column.extend(inputs.iter().map(|rank| rank[i]));
        let want = fold(dtype, op, &column);
        check_elem(
            dtype,
            op,
            g,
            want,
            &column,
            format_args!("{what} element {i}"),
        );
    }
}

pub fn allreduce_one(
    c: &mut Communicator<'_>,
    dtype: DType,
    op: ReduceOp,
    count: usize,
) -> Vec<u8> {
    let (n, r) = (c.size(), c.rank());
    let vals: Vec<V> = (0..count).map(|i| input(dtype, op, r, i, n)).collect();
    let mut buf = encode(dtype, &vals);
    collective::allreduce(c, &mut buf, Reduction::new(dtype, op)).expect("allreduce");
    buf
}

/// `(dtype, op, count, factor)`: dtypes of every kind, ops, `counts`, and factors below, at
/// and above one.
pub fn scale_cases(counts: &[usize]) -> Vec<(DType, ReduceOp, usize, f64)> {
    let mut out = Vec::new();
    for dtype in [
        DType::F32,
        DType::F64,
        DType::BF16,
        DType::F16,
        DType::I32,
        DType::U8,
    ] {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Product] {
            for &count in counts {
                for factor in [0.5, 1.0 / 3.0, 1.0, 3.0] {
                    out.push((dtype, op, count, factor));
                }
            }
        }
    }
    out
}

/// This rank's `(allreduce_scaled, allreduce then scale)` bytes for every case.
///
/// Cases that differ only in their factor (adjacent in [`scale_cases`]) share one input and
/// one unscaled allreduce: the debug build's input generation and reductions of the large
/// counts were most of a half-minute test.
pub fn scaled_and_after(
    c: &mut Communicator<'_>,
    cases: &[(DType, ReduceOp, usize, f64)],
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let (n, r) = (c.size(), c.rank());
    // (dtype, op, count), this rank's input, its unscaled allreduce.
    type Shared = ((DType, ReduceOp, usize), Vec<u8>, Vec<u8>);
    let mut last: Option<Shared> = None;
    cases
        .iter()
        .map(|&(dtype, op, count, factor)| {
            let key = (dtype, op, count);
            if !matches!(&last, Some((k, _, _)) if *k == key) {
                let vals: Vec<V> = (0..count).map(|i| input(dtype, op, r, i, n)).collect();
                let input = encode(dtype, &vals);
                let mut reduced = input.clone();
                collective::allreduce(c, &mut reduced, Reduction::new(dtype, op)).unwrap();
                last = Some((key, input, reduced));
            }
            let (_, input, reduced) = last.as_ref().unwrap();
            let mut folded = input.clone();
            collective::allreduce(c, &mut folded, Reduction::new(dtype, op).scaled(factor))
                .unwrap();
            let mut after = reduced.clone();
            collective::reduce::scale(dtype, &mut after, factor).unwrap();
            (folded, after)
        })
        .collect()
}

/// Every rank's folded result equals scaling after the allreduce, and rank 0's, bit for bit.
pub fn check_scaled(
    results: &[Vec<(Vec<u8>, Vec<u8>)>],
    cases: &[(DType, ReduceOp, usize, f64)],
    what: &str,
) {
    for (k, (dtype, op, count, factor)) in cases.iter().enumerate() {
        let what = format!(
            "{what} {} {} count={count} factor={factor}",
            dtype.name(),
            op.name()
        );
        for (r, res) in results.iter().enumerate() {
            assert!(
                res[k].0 == res[k].1,
                "{what}: rank {r} differs from scaling after"
            );
            assert!(
                res[k].0 == results[0][k].0,
                "{what}: rank {r} differs from rank 0"
            );
        }
    }
}

/// Rank `r`'s element `i` of an input whose float sums depend on the order of addition: wide
/// magnitudes, and signed zeros for min/max.
pub fn messy(dtype: DType, r: usize, i: usize) -> f64 {
    let h = hash(r, i, 99 + dtype as u64);
    if h % 5 == 0 {
        return if h % 2 == 0 { 0.0 } else { -0.0 };
    }
    let mant = (h >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
    mant * 10f64.powi((h % 9) as i32 - 4)
}

/// The float dtypes × sum/min/max/product allreduces of [`messy`] inputs, on this rank: 16
/// results, the f64 sum at index [`MESSY_F64_SUM`].
pub fn messy_allreduces(c: &mut Communicator<'_>, count: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
        ] {
            let vals: Vec<V> = (0..count)
                .map(|i| V::F(messy(dtype, c.rank(), i)))
                .collect();
            let mut buf = encode(dtype, &vals);
            collective::allreduce(c, &mut buf, Reduction::new(dtype, op)).unwrap();
            out.push(buf);
        }
    }
    out
}

/// Where [`messy_allreduces`] puts the f64 sum.
pub const MESSY_F64_SUM: usize = 12;

/// Every rank holds rank 0's bits for every [`messy_allreduces`] case, and the f64 sums are
/// right within rounding.
pub fn check_messy(results: &[Vec<Vec<u8>>], what: &str) {
    let n = results.len();
    for k in 0..results[0].len() {
        for (r, res) in results.iter().enumerate() {
            assert_eq!(
                res[k], results[0][k],
                "{what} case {k}: rank {r} differs bitwise"
            );
        }
    }
    for (i, g) in decode(DType::F64, &results[0][MESSY_F64_SUM])
        .iter()
        .enumerate()
    {
        let inputs: Vec<f64> = (0..n).map(|r| messy(DType::F64, r, i)).collect();
        let want: f64 = inputs.iter().sum();
        let bound: f64 = inputs.iter().map(|x| x.abs()).sum::<f64>() * 1e-15;
        let V::F(g) = *g else { unreachable!() };
        assert!(
            (g - want).abs() <= bound,
            "{what} f64 sum element {i}: {g} vs {want}"
        );
    }
}
