//! Unit tests of negotiation, each file one theme of the negotiator's: this one the helpers
//! every theme uses and the basics (an op is ready once every rank submitted it, a mismatch
//! names the tensor and the ranks, a dead or stalled rank fails what waits on it, a join);
//! [`cache`] the response cache and what fuses, [`relays`] answers and claims through the
//! control tree, [`kinds`] ops of different kinds under one name, [`sets`] process sets
//! their members register.

mod cache;
mod kinds;
mod relays;
mod sets;

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
