//! Ops of different kinds under one name: ranks that disagree fail once every rank has
//! sent, ranks that agree run each kind in turn, and what a dead or joined rank, a relay's
//! claim and unnamed ops make of it. Apart because names shared across kinds (torch's bases)
//! are a rule of their own on top of matching names.

use super::*;

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
