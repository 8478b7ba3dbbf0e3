//! Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", 2021), as
//! Horovod defines it: two gradients `a` and `b` combine into
//!
//! ```text
//! adasum(a, b) = (1 - a·b / (2 |a|²)) a + (1 - a·b / (2 |b|²)) b
//! ```
//!
//! (a coefficient is 1 when its vector's squared norm is below `sqrt(f64::MIN_POSITIVE)`),
//! which is `a + b` for orthogonal vectors and their average for equal ones. Over `n = 2^k`
//! ranks the combination is a binary tree in rank order: at level `l` (`1, 2, 4, …`) each
//! rank and the rank `l` away combine the vectors their halves of the tree hold, so every rank
//! ends with `adasum(adasum(g0, g1), adasum(g2, g3))` and so on. Horovod's MPI implementation
//! halves vectors and doubles distances to save bandwidth; the recurrence, and so the result up
//! to rounding, is the same.
//!
//! Bitwise identity: both partners of a level compute the same combination of the same two
//! vectors — the lower rank's as `a` — with the dot products summed in index order in f64, so
//! they hold the same bits before the next level.
//!
//! One tensor at a time: the dot products are per tensor, so Adasum never runs on a fusion
//! buffer holding several (the engine reduces each tensor of an Adasum response alone).

use half::{bf16, f16};

use super::reduce::{check_len, scale};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::DType;

/// In-place Adasum of `buf` over the communicator's ranks (a power of two), then every element
/// multiplied by `factor`. Floating-point dtypes only.
pub fn allreduce(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    dtype: DType,
    factor: f64,
) -> Result<()> {
    let n = comm.size();
    check_op(dtype, n)?;
    check_len(dtype, buf.len())?;
    let me = comm.rank();
    let mut theirs = vec![0u8; buf.len()];
    let mut level = 1;
    while level < n {
        let partner = me ^ level;
        comm.sendrecv(partner, buf, partner, &mut theirs)?;
        combine(dtype, buf, &theirs, me < partner);
        level <<= 1;
    }
    scale(dtype, buf, factor)
}

/// Whether Adasum can run on `dtype` over `ranks` ranks: a floating-point dtype, a
/// power-of-two set (what the engine checks before an op goes out).
pub fn check_op(dtype: DType, ranks: usize) -> Result<()> {
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64) {
        return Err(Error::InvalidArgument(format!(
            "Adasum reduces floating-point tensors only (float16, bfloat16, float32, float64), \
             not {}",
            dtype.name()
        )));
    }
    if !ranks.is_power_of_two() {
        return Err(Error::InvalidArgument(format!(
            "Adasum needs a power-of-two number of ranks; the process set has {ranks}"
        )));
    }
    Ok(())
}

/// `mine = adasum(a, b)` where `(a, b)` is `(mine, theirs)` when `mine_first`, else
/// `(theirs, mine)`.
fn combine(dtype: DType, mine: &mut [u8], theirs: &[u8], mine_first: bool) {
    let size = dtype.size();
    let load = |c: &[u8]| -> f64 {
        match dtype {
            DType::F16 => f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64(),
            DType::BF16 => bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64(),
            DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
            _ => f64::from_le_bytes(c.try_into().expect("8 bytes")),
        }
    };
    let (mut dot, mut a2, mut b2) = (0.0f64, 0.0f64, 0.0f64);
    for (m, t) in mine.chunks_exact(size).zip(theirs.chunks_exact(size)) {
        let (a, b) = if mine_first {
            (load(m), load(t))
        } else {
            (load(t), load(m))
        };
        dot += a * b;
        a2 += a * a;
        b2 += b * b;
    }
    let tiny = f64::MIN_POSITIVE.sqrt();
    let ca = if a2 >= tiny {
        1.0 - dot / a2 * 0.5
    } else {
        1.0
    };
    let cb = if b2 >= tiny {
        1.0 - dot / b2 * 0.5
    } else {
        1.0
    };
    for (m, t) in mine.chunks_exact_mut(size).zip(theirs.chunks_exact(size)) {
        let (a, b) = if mine_first {
            (load(m), load(t))
        } else {
            (load(t), load(m))
        };
        let v = ca * a + cb * b;
        match dtype {
            DType::F16 => m.copy_from_slice(&f16::from_f64(v).to_bits().to_le_bytes()),
            DType::BF16 => m.copy_from_slice(&bf16::from_f64(v).to_bits().to_le_bytes()),
            DType::F32 => m.copy_from_slice(&(v as f32).to_le_bytes()),
            _ => m.copy_from_slice(&v.to_le_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f64s(v: &[f64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn back(b: &[u8]) -> Vec<f64> {
        b.chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn orthogonal_vectors_add_and_equal_ones_average() {
        let mut a = f64s(&[3.0, 0.0]);
        combine(DType::F64, &mut a, &f64s(&[0.0, 4.0]), true);
        assert_eq!(back(&a), vec![3.0, 4.0]);
        let mut a = f64s(&[2.0, -1.0]);
        combine(DType::F64, &mut a, &f64s(&[2.0, -1.0]), false);
        assert_eq!(back(&a), vec![2.0, -1.0]);
    }

    #[test]
    fn a_zero_vector_leaves_the_other() {
        let mut a = f64s(&[0.0, 0.0, 0.0]);
        combine(DType::F64, &mut a, &f64s(&[1.5, -2.0, 7.0]), true);
        assert_eq!(back(&a), vec![1.5, -2.0, 7.0]);
    }

    #[test]
    fn both_partners_compute_the_same_bits() {
        let x = f64s(&[0.1, 0.7, -0.3]);
        let y = f64s(&[0.9, -0.2, 0.4]);
        let (mut low, mut high) = (x.clone(), y.clone());
        combine(DType::F64, &mut low, &y, true);
        combine(DType::F64, &mut high, &x, false);
        assert_eq!(low, high);
    }

    #[test]
    fn integers_and_odd_set_sizes_are_refused() {
        assert!(check_op(DType::I32, 2).is_err());
        assert!(check_op(DType::F32, 3).is_err());
        assert!(check_op(DType::F32, 4).is_ok());
        assert!(check_op(DType::F16, 1).is_ok());
    }
}
