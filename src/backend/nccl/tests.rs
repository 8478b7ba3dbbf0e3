//! Tests of the NCCL backend that need no GPU.

use super::*;
use nc::{ncclDataType_t as T, ncclRedOp_t as O};

fn builtin(dtype: T, op: O) -> Plan {
    Plan::Builtin {
        dtype: dtype as u32,
        op: op as u32,
    }
}

#[test]
fn unscaled_reductions_use_nccls_own_operators() {
    let cases = [
        (
            DType::F32,
            ReduceOp::Sum,
            builtin(T::ncclFloat32, O::ncclSum),
        ),
        (
            DType::BF16,
            ReduceOp::Average,
            builtin(T::ncclBfloat16, O::ncclAvg),
        ),
        (DType::I64, ReduceOp::Min, builtin(T::ncclInt64, O::ncclMin)),
        (DType::U8, ReduceOp::Max, builtin(T::ncclUint8, O::ncclMax)),
        (
            DType::F16,
            ReduceOp::Product,
            builtin(T::ncclFloat16, O::ncclProd),
        ),
        (DType::I8, ReduceOp::Sum, builtin(T::ncclInt8, O::ncclSum)),
        (
            DType::F64,
            ReduceOp::Sum,
            builtin(T::ncclFloat64, O::ncclSum),
        ),
        (
            DType::I32,
            ReduceOp::Average,
            builtin(T::ncclInt32, O::ncclAvg),
        ),
    ];
    for (dt, op, want) in cases {
        assert_eq!(
            plan_reduction(dt, op, 1.0, 1.0, 4).unwrap(),
            want,
            "{dt:?} {op:?}"
        );
    }
}

#[test]
fn one_rank_reductions_never_take_nccls_one_rank_scaling() {
    assert_eq!(
        plan_reduction(DType::F32, ReduceOp::Average, 1.0, 1.0, 1).unwrap(),
        Plan::Builtin {
            dtype: T::ncclFloat32 as u32,
            op: O::ncclSum as u32
        }
    );
    for (dt, op, pre, post) in [
        (DType::F32, ReduceOp::Sum, 0.5, 3.0),
        (DType::F64, ReduceOp::Average, 2.0, 1.0),
        (DType::F16, ReduceOp::Sum, 1.0, 2.0),
    ] {
        let e = plan_reduction(dt, op, pre, post, 1).unwrap_err();
        assert!(e.to_string().contains("staged"), "{e}");
        assert!(check_device_op(
            OpKind::Allreduce,
            Reduction::new(dt, op).scaled(post),
            pre,
            1,
            &[4097]
        )
        .is_err());
    }
    assert!(plan_reduction(DType::F32, ReduceOp::Sum, 0.5, 3.0, 2).is_ok());
}

#[test]
fn scale_factors_fold_into_one_premultiplied_sum() {
    // AVERAGE over 4 ranks with prescale 0.5 and postscale 3: sum(x * 0.5 * 3 / 4).
    let p = plan_reduction(DType::F64, ReduceOp::Average, 0.5, 3.0, 4).unwrap();
    let mut want = [0u8; 8];
    want.copy_from_slice(&0.375f64.to_le_bytes());
    assert_eq!(
        p,
        Plan::PreMulSum {
            dtype: T::ncclFloat64 as u32,
            scalar: want
        }
    );
    let p = plan_reduction(DType::F32, ReduceOp::Sum, 1.0, 0.25, 8).unwrap();
    let mut want = [0u8; 8];
    want[..4].copy_from_slice(&0.25f32.to_le_bytes());
    assert_eq!(
        p,
        Plan::PreMulSum {
            dtype: T::ncclFloat32 as u32,
            scalar: want
        }
    );
    let p = plan_reduction(DType::BF16, ReduceOp::Sum, 2.0, 1.0, 2).unwrap();
    let mut want = [0u8; 8];
    want[..2].copy_from_slice(&half::bf16::from_f32(2.0).to_bits().to_le_bytes());
    assert_eq!(
        p,
        Plan::PreMulSum {
            dtype: T::ncclBfloat16 as u32,
            scalar: want
        }
    );
    // A whole pre-scale of an integer SUM is exact.
    let p = plan_reduction(DType::I32, ReduceOp::Sum, -3.0, 1.0, 2).unwrap();
    let mut want = [0u8; 8];
    want[..4].copy_from_slice(&(-3i32).to_le_bytes());
    assert_eq!(
        p,
        Plan::PreMulSum {
            dtype: T::ncclInt32 as u32,
            scalar: want
        }
    );
}

#[test]
fn what_nccl_cannot_do_is_an_invalid_argument_naming_it() {
    let bad = [
        (DType::Bool, ReduceOp::Sum, 1.0, 1.0, "bool"),
        (DType::I16, ReduceOp::Max, 1.0, 1.0, "int16"),
        (DType::F32, ReduceOp::Adasum, 1.0, 1.0, "ADASUM"),
        (DType::F32, ReduceOp::Max, 2.0, 1.0, "MAX"),
        (DType::I32, ReduceOp::Sum, 0.5, 1.0, "whole pre-scale"),
        (DType::I32, ReduceOp::Sum, 2.0, 0.5, "whole pre-scale"),
        (DType::I64, ReduceOp::Average, 2.0, 1.0, "whole pre-scale"),
        (DType::U8, ReduceOp::Sum, 300.0, 1.0, "whole pre-scale"),
    ];
    for (dt, op, pre, post, needle) in bad {
        match plan_reduction(dt, op, pre, post, 2) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("{dt:?} {op:?} {pre} {post}: {other:?}"),
        }
    }
}

#[test]
fn the_device_path_takes_what_nccl_can_run_as_it_is() {
    let ok = |kind, dtype, op, pre, shape: &[usize]| {
        check_device_op(kind, Reduction::new(dtype, op), pre, 4, shape).map_err(|e| e.to_string())
    };
    assert!(ok(OpKind::Allreduce, DType::F16, ReduceOp::Average, 0.5, &[3]).is_ok());
    // Broadcast, allgather and alltoall move bytes: any dtype, any first dimension.
    assert!(ok(OpKind::Broadcast, DType::Bool, ReduceOp::Sum, 1.0, &[3]).is_ok());
    assert!(ok(OpKind::Allgather, DType::Bool, ReduceOp::Sum, 1.0, &[3, 2]).is_ok());
    assert!(ok(OpKind::Alltoall, DType::I16, ReduceOp::Sum, 1.0, &[0]).is_ok());
    assert!(ok(
        OpKind::Reducescatter,
        DType::F32,
        ReduceOp::Sum,
        1.0,
        &[8, 3]
    )
    .is_ok());
    let refused = [
        (
            OpKind::Reducescatter,
            DType::F32,
            &[6, 3][..],
            "6 does not divide over 4",
        ),
        (OpKind::Reducescatter, DType::F32, &[][..], "0-d"),
        (OpKind::Allreduce, DType::Bool, &[4][..], "bool"),
        (OpKind::Allgather, DType::F32, &[][..], "0-d"),
        (OpKind::Alltoall, DType::F32, &[][..], "0-d"),
        (OpKind::Barrier, DType::F32, &[][..], "not BARRIER"),
    ];
    for (kind, dtype, shape, needle) in refused {
        let e = ok(kind, dtype, ReduceOp::Sum, 1.0, shape).unwrap_err();
        assert!(e.contains(needle), "{kind:?} {shape:?}: {e}");
    }
}

#[test]
fn unique_id_keys_differ_per_generation_set_and_index() {
    let keys = [
        unique_id_key(0, 0, 0),
        unique_id_key(1, 0, 0),
        unique_id_key(0, 1, 0),
        unique_id_key(0, 0, 1),
        unique_id_key(0, 10, 0),
        unique_id_key(0, 1, 10),
    ];
    let set: std::collections::HashSet<_> = keys.iter().collect();
    assert_eq!(set.len(), keys.len(), "{keys:?}");
}
