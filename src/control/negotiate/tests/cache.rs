//! The response cache and fusion: a cached submission replays its answer and fuses with
//! full ones, a full cache evicts the least recently used name, host and CUDA ops never fuse,
//! and a cached name sent for another device is validated again. Apart because the cache's
//! ids and eviction are state of their own, which the other themes only pass through.

use super::*;

#[test]
fn cached_submissions_replay_and_fuse() {
    let (mut n, id) = answered_once(2, "x", &[4]);
    let mut out = Vec::new();
    for r in 0..2 {
        n.handle(
            r,
            ToCoordinator::Submit(vec![
                Submit::Cached { set_id: 0, id },
                Submit::Full(req("y", DType::F32, &[2])),
            ]),
            &mut out,
        );
    }
    n.flush(&mut out);
    let r = responses(&out, 1);
    assert_eq!(r.len(), 1, "x and y fuse into one response");
    assert_eq!(r[0].items.len(), 2);
    out.clear();
    n.handle(
        0,
        ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id: 999 }]),
        &mut out,
    );
    assert!(matches!(
        out[0].1,
        FromCoordinator::CacheMiss { id: 999, .. }
    ));
}

#[test]
fn a_full_cache_evicts_the_least_recently_used_name() {
    let mut n = Negotiator::new(1, &[], 1 << 20, 2);
    let mut out = Vec::new();
    let mut id_of = |n: &mut Negotiator, sub: Submit| {
        out.clear();
        n.handle(0, ToCoordinator::Submit(vec![sub]), &mut out);
        n.flush(&mut out);
        responses(&out, 0).first().and_then(|r| r.items[0].cache_id)
    };
    let a = id_of(&mut n, Submit::Full(req("a", DType::F32, &[1]))).unwrap();
    let b = id_of(&mut n, Submit::Full(req("b", DType::F32, &[1]))).unwrap();
    // `a` used again: `b` is now the oldest and goes when `c` needs room.
    assert_eq!(id_of(&mut n, Submit::Cached { set_id: 0, id: a }), Some(a));
    let c = id_of(&mut n, Submit::Full(req("c", DType::F32, &[1]))).unwrap();
    assert_eq!(id_of(&mut n, Submit::Cached { set_id: 0, id: c }), Some(c));
    assert_eq!(id_of(&mut n, Submit::Cached { set_id: 0, id: a }), Some(a));
    assert_eq!(id_of(&mut n, Submit::Cached { set_id: 0, id: b }), None);
    let mut miss = Vec::new();
    n.handle(
        0,
        ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id: b }]),
        &mut miss,
    );
    assert!(matches!(miss[0].1, FromCoordinator::CacheMiss { .. }));
}

#[test]
fn host_and_cuda_allreduces_never_fuse_and_a_cached_name_may_change_device() {
    let mut n = Negotiator::new(2, &[], 1 << 20, 16);
    let mut out = Vec::new();
    let cuda = |name: &str| Request {
        device: DeviceKind::Cuda,
        ..req(name, DType::F32, &[4])
    };
    for r in 0..2 {
        n.handle(
            r,
            ToCoordinator::Submit(vec![
                Submit::Full(req("h1", DType::F32, &[4])),
                Submit::Full(cuda("d1")),
                Submit::Full(cuda("d2")),
                Submit::Full(req("h2", DType::F32, &[4])),
            ]),
            &mut out,
        );
    }
    n.flush(&mut out);
    let r = responses(&out, 0);
    let groups: Vec<Vec<(&str, DeviceKind)>> = r
        .iter()
        .map(|resp| {
            resp.items
                .iter()
                .map(|i| (i.request.name.as_str(), i.request.device))
                .collect()
        })
        .collect();
    assert_eq!(
        groups,
        vec![
            vec![("h1", DeviceKind::Host)],
            vec![("d1", DeviceKind::Cuda), ("d2", DeviceKind::Cuda)],
            vec![("h2", DeviceKind::Host)],
        ]
    );
    // h1 is cached as a host request; the same name on CUDA is a different request, sent
    // in full and validated again (rank 1 stays on the host: a mismatch).
    let id = r[0].items[0].cache_id.expect("cached");
    out.clear();
    n.handle(
        0,
        ToCoordinator::Submit(vec![Submit::Full(cuda("h1"))]),
        &mut out,
    );
    n.handle(
        1,
        ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id }]),
        &mut out,
    );
    n.flush(&mut out);
    let (_, msg) = responses(&out, 1)[0].error.clone().expect("mismatch");
    assert!(
        msg.contains("Mismatched devices: rank 0 sent CUDA, rank 1 sent CPU")
            && msg.contains("'h1'"),
        "{msg}"
    );
}
