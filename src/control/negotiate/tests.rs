use super::*;
use std::time::{Duration, Instant};

use crate::control::message::{DeviceKind, Op, Request, TensorMeta};
use crate::types::OpKind;
use crate::types::{DType, ReduceOp};

/// Where the base of `name` begins as ferrovod.torch would say it: after the kind of a
/// `<kind>.<base>` name, except for its unnamed ops (`<kind>.noname.<n>`), which share nothing.
fn base_at(name: &str) -> u32 {
    match name.split_once('.') {
        Some((kind, rest)) if !rest.starts_with("noname.") => kind.len() as u32 + 1,
        _ => 0,
    }
}

fn req(name: &str, dtype: DType, shape: &[usize]) -> Request {
    Request {
        spec: Op {
            set_id: 0,
            name: name.into(),
            base_at: base_at(name),
            kind: OpKind::Allreduce,
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            tensors: vec![TensorMeta {
                dtype,
                shape: shape.to_vec(),
            }],
            splits: vec![],
        },
        device: DeviceKind::Host,
    }
}

fn responses(out: &Outbox, to: usize) -> Vec<Response> {
    out.iter()
        .filter(|(r, _)| r.contains(&to))
        .flat_map(|(_, m)| match m {
            FromCoordinator::Responses(rs) => rs.clone(),
            _ => vec![],
        })
        .collect()
}

/// A negotiator of `size` ranks that has answered a float32 allreduce `name` of `shape` once,
/// every rank submitting it in full, and the cache id that answer gave it.
fn answered_once(size: usize, name: &str, shape: &[usize]) -> (Negotiator, u64) {
    let mut n = Negotiator::new(size, &[], 1 << 20, 16);
    let mut out = Vec::new();
    for r in 0..size {
        n.handle(
            r,
            ToCoordinator::Submit(vec![Submit::Full(req(name, DType::F32, shape))]),
            &mut out,
        );
    }
    n.flush(&mut out);
    let id = responses(&out, 0)[0].items[0].cache_id.expect("cached");
    (n, id)
}

#[test]
fn ready_only_when_every_rank_submitted_in_any_order() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    n.handle(
        0,
        ToCoordinator::Submit(vec![Submit::Full(req("a", DType::F32, &[4]))]),
        &mut out,
    );
    n.handle(
        1,
        ToCoordinator::Submit(vec![Submit::Full(req("b", DType::F32, &[4]))]),
        &mut out,
    );
    n.handle(
        1,
        ToCoordinator::Submit(vec![Submit::Full(req("a", DType::F32, &[4]))]),
        &mut out,
    );
    n.flush(&mut out);
    assert!(responses(&out, 0).is_empty());
    n.handle(
        2,
        ToCoordinator::Submit(vec![Submit::Full(req("a", DType::F32, &[4]))]),
        &mut out,
    );
    n.flush(&mut out);
    let r = responses(&out, 2);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].items[0].request.name, "a");
    assert!(r[0].error.is_none());
}

#[test]
fn mismatch_names_tensor_and_ranks() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    n.handle(
        0,
        ToCoordinator::Submit(vec![Submit::Full(req("w", DType::F32, &[4]))]),
        &mut out,
    );
    n.handle(
        1,
        ToCoordinator::Submit(vec![Submit::Full(req("w", DType::I32, &[4]))]),
        &mut out,
    );
    n.handle(
        2,
        ToCoordinator::Submit(vec![Submit::Full(req("w", DType::F32, &[4]))]),
        &mut out,
    );
    n.flush(&mut out);
    for rank in 0..3 {
        let r = responses(&out, rank);
        let (_, msg) = r[0].error.clone().expect("error response");
        assert!(
            msg.contains("'w'")
                && msg.contains("ranks [0, 2] sent float32")
                && msg.contains("rank 1 sent int32"),
            "{msg}"
        );
    }
}

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

#[test]
fn dead_rank_fails_pending_names() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    n.handle(
        0,
        ToCoordinator::Submit(vec![Submit::Full(req("g", DType::F32, &[1]))]),
        &mut out,
    );
    n.rank_gone(2, Gone::Died, "connection lost".into(), &mut out);
    n.flush(&mut out);
    let r = responses(&out, 0);
    assert!(r[0].error.as_ref().unwrap().1.contains("rank 2 failed"));
    assert!(
        out.iter()
            .any(|(to, m)| to.contains(&1)
                && matches!(m, FromCoordinator::RankFailed { rank: 2, .. }))
    );
}

#[test]
fn stall_inspector_names_tensors_and_missing_ranks_then_gives_up() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    n.handle(
        0,
        ToCoordinator::Submit(vec![Submit::Full(req("skipped", DType::F32, &[1]))]),
        &mut out,
    );
    n.handle(
        2,
        ToCoordinator::Submit(vec![Submit::Full(req("skipped", DType::F32, &[1]))]),
        &mut out,
    );
    let t0 = Instant::now();
    let check = Duration::from_secs(2);
    assert!(n.inspect(t0, Some(check), None).is_none(), "too early");
    let warn = n
        .inspect(t0 + Duration::from_secs(3), Some(check), None)
        .expect("a warning");
    assert!(warn.contains("Missing ranks:\n1: [skipped]"), "{warn}");
    assert!(
        n.inspect(t0 + Duration::from_secs(4), Some(check), None)
            .is_none(),
        "once per interval"
    );
    let warn = n.inspect(
        t0 + Duration::from_secs(10),
        Some(check),
        Some(Duration::from_secs(8)),
    );
    assert!(warn.is_some());
    n.flush(&mut out);
    let r = responses(&out, 0);
    let (code, msg) = r[0].error.clone().expect("stalled tensor fails");
    assert_eq!(code, 2);
    assert!(msg.contains("'skipped'") && msg.contains("[1]"), "{msg}");
}

#[test]
fn join_counts_as_submitted_and_reports_last_rank() {
    let mut n = Negotiator::new(2, &[], 1 << 20, 16);
    let mut out = Vec::new();
    n.handle(0, ToCoordinator::Join, &mut out);
    n.handle(
        1,
        ToCoordinator::Submit(vec![Submit::Full(req("g", DType::F32, &[1]))]),
        &mut out,
    );
    n.flush(&mut out);
    let r = responses(&out, 0);
    assert_eq!(r[0].joined, vec![0]);
    out.clear();
    n.handle(1, ToCoordinator::Join, &mut out);
    n.flush(&mut out);
    let r = responses(&out, 0);
    assert_eq!((r[0].kind, r[0].last_joined), (OpKind::Join, 1));
}

#[test]
fn an_answer_every_rank_gets_is_one_message_for_all_of_them() {
    // The root answers a global op once, not once per rank (it forwards one copy per link).
    let size = 300;
    let mut n = Negotiator::new(size, &[vec![0, 1]], 1 << 20, 16);
    let mut out = Vec::new();
    let mut id = None;
    for round in 0..3 {
        out.clear();
        for r in (0..size).rev() {
            let sub = match id {
                Some(id) => Submit::Cached { set_id: 0, id },
                None => Submit::Full(req("g", DType::F32, &[4])),
            };
            n.handle(r, ToCoordinator::Submit(vec![sub]), &mut out);
            if r > 0 {
                n.flush(&mut out);
                assert!(
                    out.is_empty(),
                    "round {round}: ready before rank 0 submitted"
                );
            }
        }
        n.flush(&mut out);
        assert_eq!(out.len(), 1, "round {round}");
        assert_eq!(out[0].0, (0..size).collect::<Vec<_>>(), "round {round}");
        id = responses(&out, 0)[0].items[0].cache_id;
        assert!(id.is_some(), "round {round}: cached");
    }
    // An op of a process set and one of the global set: ranks 0 and 1 get both in one
    // message, the others only the global one.
    out.clear();
    let mut in_set = req("s", DType::F32, &[4]);
    in_set.spec.set_id = 1;
    for r in 0..2 {
        n.handle(
            r,
            ToCoordinator::Submit(vec![Submit::Full(in_set.clone())]),
            &mut out,
        );
    }
    for r in 0..size {
        let sub = Submit::Cached {
            set_id: 0,
            id: id.unwrap(),
        };
        n.handle(r, ToCoordinator::Submit(vec![sub]), &mut out);
    }
    n.flush(&mut out);
    assert_eq!(
        out.len(),
        2,
        "{:?}",
        out.iter().map(|(to, _)| to.len()).collect::<Vec<_>>()
    );
    for (to, m) in &out {
        let FromCoordinator::Responses(rs) = m else {
            panic!("{m:?}")
        };
        if to == &vec![0, 1] {
            assert_eq!(rs.len(), 2);
        } else {
            assert_eq!(to, &(2..size).collect::<Vec<_>>());
            assert_eq!(rs.len(), 1);
        }
    }
}

#[test]
fn a_relays_claim_counts_for_each_rank_it_names() {
    let size = 40;
    let (mut n, id) = answered_once(size, "c", &[4]);
    let mut out = Vec::new();
    // Ranks 8..40 are claimed by a relay (twice: the second copy counts for nothing), ranks
    // 0..8 submit for themselves; the op is ready with the last of them, not before.
    let below: Vec<usize> = (8..size).collect();
    n.claim_cached(&below, 0, id, &mut out);
    n.claim_cached(&below, 0, id, &mut out);
    for r in 0..8 {
        n.flush(&mut out);
        assert!(out.is_empty(), "ready with rank {r} missing");
        n.handle(
            r,
            ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id }]),
            &mut out,
        );
    }
    n.flush(&mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, (0..size).collect::<Vec<_>>());
    assert_eq!(responses(&out, 39)[0].items[0].request.name, "c");
    // A claim of an id the root no longer holds is one cache miss for all the ranks claimed.
    out.clear();
    n.claim_cached(&below, 0, id + 1000, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, below);
    assert!(matches!(
        out[0].1,
        FromCoordinator::CacheMiss { set_id: 0, .. }
    ));
}

#[test]
fn a_full_request_among_claimed_cached_ones_is_checked_against_them() {
    let size = 70;
    let (mut n, id) = answered_once(size, "g", &[4]);
    let mut out = Vec::new();
    // Every rank but 65 is claimed from the cache (more than one word of members); rank 65
    // sends a request of another shape in full, which must fail the op, naming it.
    let below: Vec<usize> = (0..size).filter(|&r| r != 65).collect();
    n.claim_cached(&below, 0, id, &mut out);
    n.flush(&mut out);
    assert!(out.is_empty(), "ready with rank 65 missing");
    n.handle(
        65,
        ToCoordinator::Submit(vec![Submit::Full(req("g", DType::F32, &[5]))]),
        &mut out,
    );
    n.flush(&mut out);
    for rank in [0, 64, 65, 69] {
        let r = responses(&out, rank);
        let (_, msg) = r[0].error.clone().expect("error response");
        assert!(msg.contains("'g'") && msg.contains("rank 65"), "{msg}");
    }
    // The same op, claimed from the cache by every rank, is answered without an error.
    out.clear();
    let all: Vec<usize> = (0..size).collect();
    n.claim_cached(&all[..30], 0, id, &mut out);
    n.claim_cached(&all[30..], 0, id, &mut out);
    n.flush(&mut out);
    let r = responses(&out, 69);
    assert!(r[0].error.is_none(), "{:?}", r[0].error);
    assert_eq!(r[0].items[0].request.name, "g");
}

/// What one cached global op costs the root's negotiator, as in a job of `size` ranks whose
/// first 16 ranks submit for themselves and whose other ranks are claimed by 16 relays.
/// `cargo test --release --lib negotiate::tests::bench -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn bench_cached_op_at_the_root() {
    // A name of ferrovod.torch's (with a shared base) and a plain one.
    for (size, name) in [64usize, 256, 1024]
        .into_iter()
        .flat_map(|s| [(s, "grad"), (s, "allreduce.grad")])
    {
        let (mut n, id) = answered_once(size, name, &[1]);
        let mut out = Vec::new();
        let per = (size - 16) / 16;
        let claims: Vec<Vec<usize>> = (0..16)
            .map(|k| (16 + k * per..if k == 15 { size } else { 16 + (k + 1) * per }).collect())
            .collect();
        let ops = 2000;
        let start = std::time::Instant::now();
        for _ in 0..ops {
            out.clear();
            for r in 0..16 {
                n.handle(
                    r,
                    ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id }]),
                    &mut out,
                );
            }
            for below in &claims {
                n.claim_cached(below, 0, id, &mut out);
            }
            n.flush(&mut out);
            assert_eq!(out.len(), 1);
        }
        println!(
            "{size} ranks, {name}: {:.2} us per cached op at the root",
            start.elapsed().as_secs_f64() * 1e6 / ops as f64
        );
    }
}

/// Rank `rank` submits a float32 op of `kind` named `name` in full.
fn send(n: &mut Negotiator, rank: usize, name: &str, kind: OpKind, out: &mut Outbox) {
    let mut r = req(name, DType::F32, &[4]);
    r.spec.kind = kind;
    n.handle(rank, ToCoordinator::Submit(vec![Submit::Full(r)]), out);
}

#[test]
fn ranks_that_send_different_kinds_under_one_name_fail_once_every_rank_sent_its_op() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    send(&mut n, 0, "allreduce.x", OpKind::Allreduce, &mut out);
    send(&mut n, 1, "broadcast.x", OpKind::Broadcast, &mut out);
    n.flush(&mut out);
    assert!(
        responses(&out, 0).is_empty(),
        "rank 2 has not sent its op yet"
    );
    send(&mut n, 2, "allreduce.x", OpKind::Allreduce, &mut out);
    n.flush(&mut out);
    for rank in 0..3 {
        let r = responses(&out, rank);
        assert_eq!(r.len(), 1);
        let names: Vec<&str> = r[0].items.iter().map(|i| i.request.name.as_str()).collect();
        assert_eq!(names, ["allreduce.x", "broadcast.x"]);
        let (code, msg) = r[0].error.clone().expect("an error for every rank");
        assert_eq!(code, respond::mismatch_code());
        for part in [
            "'x'",
            "ranks [0, 2] sent ALLREDUCE 'allreduce.x'",
            "rank 1 sent BROADCAST 'broadcast.x'",
            "same order",
        ] {
            assert!(msg.contains(part), "{part}: {msg}");
        }
    }
    // Nothing is left waiting: the next ops under the name run.
    out.clear();
    for rank in 0..3 {
        send(&mut n, rank, "broadcast.x", OpKind::Broadcast, &mut out);
    }
    n.flush(&mut out);
    let r = responses(&out, 1);
    assert_eq!(r.len(), 1);
    assert!(r[0].error.is_none(), "{:?}", r[0].error);
}

#[test]
fn ops_of_two_kinds_under_one_name_each_complete_when_every_rank_agrees() {
    // Each rank sends its ops under a base one at a time (the engine holds the second until
    // the first completes): an allreduce and a broadcast named alike both run.
    let mut n = Negotiator::new(2, &[], 1 << 20, 16);
    let mut out = Vec::new();
    for (name, kind) in [
        ("allreduce.w", OpKind::Allreduce),
        ("broadcast.w", OpKind::Broadcast),
    ] {
        out.clear();
        send(&mut n, 1, name, kind, &mut out);
        send(&mut n, 0, name, kind, &mut out);
        n.flush(&mut out);
        let r = responses(&out, 0);
        assert_eq!(r.len(), 1);
        assert!(r[0].error.is_none(), "{name}: {:?}", r[0].error);
        assert_eq!(r[0].items[0].request.name, name);
    }
    assert!(n.sets[&0].bases.is_empty() && n.sets[&0].table.is_empty());
}

#[test]
fn a_disagreement_waiting_on_a_dead_rank_fails_naming_it() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    send(&mut n, 0, "allreduce.x", OpKind::Allreduce, &mut out);
    send(&mut n, 1, "alltoall.x", OpKind::Alltoall, &mut out);
    n.rank_gone(2, Gone::Died, "connection lost".into(), &mut out);
    n.flush(&mut out);
    let r = responses(&out, 0);
    assert_eq!(r.len(), 2, "{r:?}");
    for resp in r {
        assert!(resp.error.unwrap().1.contains("rank 2 failed"));
    }
    assert!(n.sets[&0].bases.is_empty() && n.sets[&0].table.is_empty());
}

#[test]
fn a_joined_rank_counts_as_sent_when_the_others_disagree() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    n.handle(2, ToCoordinator::Join, &mut out);
    send(&mut n, 0, "allreduce.x", OpKind::Allreduce, &mut out);
    send(&mut n, 1, "allgather.x", OpKind::Allgather, &mut out);
    n.flush(&mut out);
    let r = responses(&out, 2);
    assert_eq!(r.len(), 1);
    assert!(r[0]
        .error
        .as_ref()
        .unwrap()
        .1
        .contains("rank 1 sent ALLGATHER"));
}

#[test]
fn a_relays_claim_and_a_full_op_of_another_kind_under_one_name_disagree() {
    let (mut n, id) = answered_once(40, "allreduce.g", &[4]);
    let mut out = Vec::new();
    let below: Vec<usize> = (0..39).collect();
    n.claim_cached(&below, 0, id, &mut out);
    send(&mut n, 39, "broadcast.g", OpKind::Broadcast, &mut out);
    n.flush(&mut out);
    let r = responses(&out, 39);
    assert_eq!(r.len(), 1);
    let msg = r[0].error.clone().expect("mismatch").1;
    assert!(
        msg.contains("rank 39 sent BROADCAST 'broadcast.g'"),
        "{msg}"
    );
    // Unnamed ops of two kinds share nothing: each waits for its own.
    out.clear();
    send(&mut n, 0, "allreduce.noname.0", OpKind::Allreduce, &mut out);
    send(&mut n, 1, "broadcast.noname.0", OpKind::Broadcast, &mut out);
    n.flush(&mut out);
    assert!(responses(&out, 0).is_empty());
}

/// The set's id, when `out` tells exactly `to` that set `ranks` was added.
fn set_added(out: &Outbox, to: &[usize], ranks: &[usize]) -> Option<Result<u32, String>> {
    out.iter().find_map(|(t, m)| match m {
        FromCoordinator::SetAdded {
            ranks: r, result, ..
        } if t == to && r == ranks => Some(result.clone()),
        _ => None,
    })
}

#[test]
fn a_set_its_members_register_alone_is_made_once_all_of_them_asked_and_told_only_them() {
    let mut n = Negotiator::new(4, &[], 1 << 20, 16);
    let mut out = Vec::new();
    n.handle(
        2,
        ToCoordinator::AddMemberSet {
            ranks: vec![0, 2],
            timeout_ms: 0,
        },
        &mut out,
    );
    assert!(out.is_empty(), "rank 0 has not asked yet: {out:?}");
    n.handle(
        0,
        ToCoordinator::AddMemberSet {
            ranks: vec![0, 2],
            timeout_ms: 0,
        },
        &mut out,
    );
    let id = set_added(&out, &[0, 2], &[0, 2])
        .expect("told both members")
        .unwrap();
    assert_eq!(n.members(id), Some(&[0, 2][..]));
    // A second group over the same ranks reuses the set, answered at once.
    out.clear();
    n.handle(
        2,
        ToCoordinator::AddMemberSet {
            ranks: vec![0, 2],
            timeout_ms: 0,
        },
        &mut out,
    );
    assert_eq!(set_added(&out, &[2], &[0, 2]), Some(Ok(id)));
    // A rank may only ask for a set it is in.
    out.clear();
    n.handle(
        1,
        ToCoordinator::AddMemberSet {
            ranks: vec![0, 2],
            timeout_ms: 0,
        },
        &mut out,
    );
    assert!(set_added(&out, &[1], &[0, 2]).unwrap().is_err());
}

#[test]
fn a_member_set_waiting_on_a_dead_rank_fails_naming_it() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    n.handle(
        0,
        ToCoordinator::AddMemberSet {
            ranks: vec![0, 1],
            timeout_ms: 0,
        },
        &mut out,
    );
    n.rank_gone(1, Gone::Died, "connection lost".into(), &mut out);
    let err = set_added(&out, &[0], &[0, 1])
        .expect("told rank 0")
        .unwrap_err();
    assert!(err.contains("rank 1"), "{err}");
    out.clear();
    n.handle(
        2,
        ToCoordinator::AddMemberSet {
            ranks: vec![1, 2],
            timeout_ms: 0,
        },
        &mut out,
    );
    assert!(set_added(&out, &[2], &[1, 2])
        .unwrap()
        .unwrap_err()
        .contains("rank 1"));
}

#[test]
fn a_member_set_with_a_timeout_of_its_own_fails_its_stalled_ops_after_it() {
    let mut n = Negotiator::new(3, &[], 1 << 20, 16);
    let mut out = Vec::new();
    let ask = |n: &mut Negotiator, from, timeout_ms, out: &mut Outbox| {
        n.handle(
            from,
            ToCoordinator::AddMemberSet {
                ranks: vec![0, 1],
                timeout_ms,
            },
            out,
        )
    };
    ask(&mut n, 0, 1500, &mut out);
    ask(&mut n, 1, 1500, &mut out);
    let limited = set_added(&out, &[0, 1], &[0, 1]).unwrap().unwrap();
    // The same ranks without a limit of their own are another set.
    out.clear();
    ask(&mut n, 0, 0, &mut out);
    ask(&mut n, 1, 0, &mut out);
    let plain = set_added(&out, &[0, 1], &[0, 1]).unwrap().unwrap();
    assert_ne!(limited, plain);
    for set_id in [limited, plain] {
        let mut r = req("barrier.pg1.0", DType::F32, &[1]);
        r.spec.set_id = set_id;
        n.handle(0, ToCoordinator::Submit(vec![Submit::Full(r)]), &mut out);
    }
    out.clear();
    let t0 = Instant::now();
    // No stall check and no engine-wide limit: the set's own limit acts alone.
    assert!(n.inspect(t0 + Duration::from_secs(1), None, None).is_none());
    n.flush(&mut out);
    assert!(responses(&out, 0).is_empty(), "not yet");
    assert!(n.inspect(t0 + Duration::from_secs(2), None, None).is_none());
    n.flush(&mut out);
    let r = responses(&out, 0);
    assert_eq!(r.len(), 1, "only the limited set's op fails: {r:?}");
    assert_eq!(r[0].set_id, limited);
    let (_, msg) = r[0].error.clone().expect("timed out");
    assert!(
        msg.contains("ranks [1]") && msg.contains(" timeout of 1.5s"),
        "{msg}"
    );
}
