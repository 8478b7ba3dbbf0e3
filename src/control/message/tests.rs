use super::*;
use crate::types::{DType, ReduceOp};

fn req() -> Request {
    Request {
        spec: Op {
            set_id: 3,
            name: "grad.w1".into(),
            base_at: 0,
            kind: OpKind::Allgather,
            op: ReduceOp::Sum,
            root: 2,
            prescale: 0.5,
            postscale: 2.0,
            tensors: vec![
                TensorMeta {
                    dtype: DType::BF16,
                    shape: vec![3, 4],
                },
                TensorMeta {
                    dtype: DType::F32,
                    shape: vec![],
                },
            ],
            splits: vec![1, 2],
        },
        device: DeviceKind::Cuda,
    }
}

/// A request named as ferrovod.torch names ops, its base marked.
fn qualified() -> Request {
    let mut r = req();
    r.spec.name = "allgather.grad.w1".into();
    r.spec.base_at = "allgather.".len() as u32;
    r
}

fn samples() -> (Vec<ToCoordinator>, Vec<FromCoordinator>) {
    let to = vec![
        ToCoordinator::Hello { rank: 7 },
        ToCoordinator::Submit(vec![
            Submit::Full(req()),
            Submit::Full(qualified()),
            Submit::Cached { set_id: 0, id: 9 },
        ]),
        ToCoordinator::Join,
        ToCoordinator::AddSet { ranks: vec![0, 2] },
        ToCoordinator::AddMemberSet {
            ranks: vec![1, 3],
            timeout_ms: 1500,
        },
        ToCoordinator::RemoveSet { id: 4 },
        ToCoordinator::Leave,
        ToCoordinator::Stalled {
            rank: 2,
            detail: "no progress".into(),
        },
        ToCoordinator::Relayed(vec![
            (
                3,
                ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id: 9 }]),
            ),
            (5, ToCoordinator::Leave),
            (
                2,
                ToCoordinator::CachedBelow {
                    set_id: 1,
                    ids: vec![4, 7],
                },
            ),
            (
                4,
                ToCoordinator::Lost {
                    rank: 6,
                    detail: "closed".into(),
                },
            ),
        ]),
        ToCoordinator::Lost {
            rank: 2,
            detail: "eof".into(),
        },
    ];
    let mut from = vec![
        FromCoordinator::Responses(vec![Response {
            set_id: 1,
            kind: OpKind::Allgather,
            items: vec![Item {
                request: req(),
                cache_id: Some(8),
                first_dims: vec![vec![1, 2], vec![0, 0]],
                split_matrix: vec![1, 2, 3, 4],
            }],
            joined: vec![1],
            last_joined: 1,
            error: Some((3, "Mismatched".into())),
        }]),
        FromCoordinator::CacheMiss { set_id: 1, id: 2 },
        FromCoordinator::SetAdded {
            ranks: vec![1],
            timeout_ms: 0,
            result: Err("dup".into()),
        },
        FromCoordinator::SetAdded {
            ranks: vec![1],
            timeout_ms: 60_000,
            result: Ok(2),
        },
        FromCoordinator::SetRemoved {
            id: 2,
            result: Ok(true),
        },
        FromCoordinator::SetRemoved {
            id: 3,
            result: Err("busy".into()),
        },
        FromCoordinator::RankLeft { rank: 1 },
        FromCoordinator::Ready,
        FromCoordinator::RankFailed {
            rank: 1,
            detail: "eof".into(),
            stalled: true,
        },
        FromCoordinator::PathClosed {
            rank: 3,
            clean: false,
            detail: "eof".into(),
        },
    ];
    let down = FromCoordinator::Down(vec![
        (None, from[0].clone()),
        (Some(vec![4, 9]), FromCoordinator::RankLeft { rank: 2 }),
    ]);
    from.push(down);
    (to, from)
}

#[test]
fn round_trips() {
    let (to, from) = samples();
    for m in to {
        assert_eq!(ToCoordinator::decode(&m.encode()).unwrap(), m);
    }
    for m in from {
        assert_eq!(FromCoordinator::decode(&m.encode()).unwrap(), m);
    }
}

#[test]
fn truncated_messages_are_errors_not_panics() {
    let (to, from) = samples();
    for m in to {
        let b = m.encode();
        for cut in 0..b.len() {
            assert!(ToCoordinator::decode(&b[..cut]).is_err());
        }
    }
    for m in from {
        let b = m.encode();
        for cut in 0..b.len() {
            assert!(FromCoordinator::decode(&b[..cut]).is_err());
        }
    }
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    let mut x: u32 = 12345;
    for len in 0..200usize {
        for _ in 0..50 {
            let b: Vec<u8> = (0..len)
                .map(|_| {
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (x >> 24) as u8
                })
                .collect();
            let _ = ToCoordinator::decode(&b);
            let _ = FromCoordinator::decode(&b);
        }
    }
}

#[test]
fn batches_do_not_nest() {
    let inner = ToCoordinator::Relayed(vec![(1, ToCoordinator::Join)]);
    let outer = ToCoordinator::Relayed(vec![(2, inner)]);
    assert!(ToCoordinator::decode(&outer.encode()).is_err());
    let hello = ToCoordinator::Relayed(vec![(2, ToCoordinator::Hello { rank: 2 })]);
    assert!(ToCoordinator::decode(&hello.encode()).is_err());
    let inner = FromCoordinator::Down(vec![(None, FromCoordinator::Ready)]);
    let outer = FromCoordinator::Down(vec![(None, inner)]);
    assert!(FromCoordinator::decode(&outer.encode()).is_err());
}

#[test]
fn a_base_is_where_the_front_end_said_it_begins_and_nothing_else() {
    assert_eq!(qualified().base(), Some("grad.w1"));
    // The engine does not read names for kinds: unmarked, a qualified-looking name has none.
    assert_eq!(req().base(), None);
    let mut r = qualified();
    r.spec.base_at = 0;
    assert_eq!(r.base(), None);
}

#[test]
fn a_base_outside_the_name_is_refused_on_decode() {
    for at in [17u32, 40, u32::MAX] {
        let mut r = qualified();
        r.spec.base_at = at;
        assert!(!r.base_at_is_valid(), "{at}");
        let bytes = ToCoordinator::Submit(vec![Submit::Full(r)]).encode();
        let e = ToCoordinator::decode(&bytes).unwrap_err().to_string();
        assert!(
            e.contains("allgather.grad.w1") && e.contains("outside"),
            "{e}"
        );
    }
}
