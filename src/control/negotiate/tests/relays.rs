//! Answers and claims through the control tree: an answer every rank gets is one message, a
//! relay's claim counts for each rank it names and is checked against full requests among
//! them, and what one cached op costs the root at scale (an ignored measurement). Apart
//! because the other themes have every rank submit for itself, as without relays.

use super::*;

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
/// `cargo test --release --lib negotiate::tests::relays::bench -- --ignored --nocapture`.
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
