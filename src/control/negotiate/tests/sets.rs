//! Process sets their members register alone: made once all of them asked and told only
//! them, failed naming a dead member, and with a stall limit of their own. Apart because
//! registering a set is an exchange of its own with the negotiator, beside its ops.

use super::*;

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
