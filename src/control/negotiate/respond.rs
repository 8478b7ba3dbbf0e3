//! What the coordinator answers for a ready name: the checks that every member submitted the
//! same op, the response or error that every member receives, and which responses may fuse.
//! The state machine in the parent module decides when a name is ready; this decides the answer.

use crate::control::message::{DeviceKind, Item, Request, Response};
use crate::error::Error;
use crate::types::OpKind;

use super::{Pending, SetState, LEFT};

fn plain_item(request: Request) -> Item {
    Item {
        request,
        cache_id: None,
        first_dims: Vec::new(),
        split_matrix: Vec::new(),
    }
}

/// The error code and reason for what waits on `rank`, gone with `detail` (what `gone`
/// records); `clean` is appended to the reason of a clean shutdown.
pub(super) fn gone_error(rank: usize, detail: &str, clean: &str) -> (u8, String) {
    if detail == LEFT {
        (
            Error::Shutdown(String::new()).kind_code(),
            format!("rank {rank} has shut down{clean}"),
        )
    } else {
        let lost = Error::PeerLost {
            rank,
            detail: String::new(),
        };
        (lost.kind_code(), format!("rank {rank} failed: {detail}"))
    }
}

/// "rank 3" or "ranks [0, 2]": how a message names the ranks that sent one thing.
fn who(ranks: &[usize]) -> String {
    match ranks {
        [one] => format!("rank {one}"),
        many => format!("ranks {many:?}"),
    }
}

/// The error code of a disagreement between ranks.
pub(super) fn mismatch_code() -> u8 {
    Error::Mismatch {
        name: String::new(),
        message: String::new(),
    }
    .kind_code()
}

/// Every member's error for an op some refused: who refused it and why, the ranks that gave
/// the same reason together, so that every rank learns the reason from the one that had it.
fn rejection_message(request: &Request, rejected: &[(usize, String)]) -> String {
    let mut by_reason: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, reason) in rejected {
        match by_reason.iter_mut().find(|(r, _)| r == reason) {
            Some((_, ranks)) => ranks.push(*rank),
            None => by_reason.push((reason, vec![*rank])),
        }
    }
    let parts: Vec<String> = by_reason
        .into_iter()
        .map(|(reason, mut ranks)| {
            ranks.sort_unstable();
            format!("{} rejected it: {reason}", who(&ranks))
        })
        .collect();
    format!(
        "{} of tensor '{}' failed on every rank: {}",
        request.kind.name(),
        request.name,
        parts.join("; ")
    )
}

pub(super) fn error_response(request: Request, code: u8, message: String) -> Response {
    errors_response(vec![request], code, message)
}

/// One error for several ops of a set (`requests`, at least one): each member fails those
/// it holds.
fn errors_response(requests: Vec<Request>, code: u8, message: String) -> Response {
    Response {
        set_id: requests[0].set_id,
        kind: requests[0].kind,
        items: requests.into_iter().map(plain_item).collect(),
        joined: Vec::new(),
        last_joined: 0,
        error: Some((code, message)),
    }
}

/// Every member's error for ops under one shared base that the ranks disagree on (see f) in
/// the parent module's doc): which ranks sent which op, and the rule they broke.
pub(super) fn kinds_disagree(
    set_id: u32,
    members: &[usize],
    base: &str,
    ops: Vec<Pending>,
) -> Response {
    let parts: Vec<String> = ops
        .iter()
        .map(|p| {
            let ranks: Vec<usize> = (0..members.len())
                .filter(|&i| p.has(i))
                .map(|i| members[i])
                .collect();
            let req = p.any();
            format!("{} sent {} '{}'", who(&ranks), req.kind.name(), req.name)
        })
        .collect();
    let set = if set_id == 0 {
        String::new()
    } else {
        format!(" in process set {set_id}")
    };
    let message = format!(
        "Mismatched operations under the name '{base}'{set}: {}. Ops given one name are \
         matched in the order each rank calls them: every rank must call them in the same \
         order",
        parts.join(", ")
    );
    errors_response(
        ops.iter().map(Pending::first).collect(),
        mismatch_code(),
        message,
    )
}

pub(super) fn can_fuse(a: &Response, b: &Response, threshold: usize) -> bool {
    if a.error.is_some()
        || b.error.is_some()
        || a.kind != OpKind::Allreduce
        || b.kind != OpKind::Allreduce
    {
        return false;
    }
    if a.set_id != b.set_id || a.joined != b.joined {
        return false;
    }
    let (ra, rb) = (&a.items[0].request, &b.items[0].request);
    // Host and device tensors run on different communicators: never in one response.
    let same = ra.op == rb.op
        && ra.prescale == rb.prescale
        && ra.postscale == rb.postscale
        && ra.device == rb.device;
    let bytes: usize = a.items.iter().map(|i| i.request.nbytes()).sum::<usize>() + rb.nbytes();
    same && bytes <= threshold
}

/// Validates the requests of a ready name and builds its response.
pub(super) fn build_response(
    set_id: u32,
    set: &mut SetState,
    p: Pending,
    joined: Vec<usize>,
    capacity: usize,
    next_cache_id: &mut u64,
) -> Response {
    let base = p.first();
    let name = base.name.clone();
    let fail = |code: u8, msg: String| error_response(base.clone(), code, msg);
    let mismatch = mismatch_code();
    let invalid = Error::InvalidArgument(String::new()).kind_code();

    if !p.rejected.is_empty() {
        return fail(invalid, rejection_message(&base, &p.rejected));
    }
    if !p.all_cached {
        // Cached submissions are the validated request itself: only full ones are compared,
        // so the root builds this list (a pointer per member) only for them.
        let submitted: Vec<(usize, &Request)> = (0..set.ranks.len())
            .filter_map(|i| p.request(i).map(|r| (set.ranks[i], &**r)))
            .collect();
        if let Some(msg) = validate(&name, &submitted) {
            return fail(mismatch, msg);
        }
    }
    if !joined.is_empty() && base.kind != OpKind::Allreduce {
        let what = match base.kind {
            OpKind::Allgather => "Allgather is not supported with Join at this time. Specify sparse_as_dense=True if using DistributedOptimizer",
            OpKind::Alltoall => "Alltoall is not supported with Join at this time.",
            OpKind::Reducescatter => "Reducescatter is not supported with Join at this time.",
            OpKind::Barrier => "Barrier is not supported with Join at this time.",
            _ => "Broadcast is not supported with Join at this time.",
        };
        return fail(
            invalid,
            format!("{what} (tensor '{name}', joined ranks {joined:?})"),
        );
    }
    if !joined.is_empty() && base.device == DeviceKind::Cuda {
        return fail(
            invalid,
            format!(
                "join() is not supported with CUDA tensors on the NCCL path: ranks {joined:?} \
                 have joined, so they have no device memory to contribute to '{name}'"
            ),
        );
    }
    if base.kind == OpKind::Broadcast && set.set_rank(base.root).is_none() {
        return fail(
            invalid,
            format!(
                "broadcast of '{name}': root rank {} is not in process set {set_id}",
                base.root
            ),
        );
    }
    let first_dims = if base.kind == OpKind::Allgather {
        (0..base.tensors.len())
            .map(|t| {
                (0..set.ranks.len())
                    .map(|i| {
                        p.request(i)
                            .map_or(0, |r| r.tensors[t].shape.first().copied().unwrap_or(0))
                    })
                    .collect()
            })
            .collect()
    } else {
        Vec::new()
    };
    let split_matrix = if base.kind == OpKind::Alltoall {
        (0..set.ranks.len())
            .flat_map(|i| p.request(i).map(|r| r.splits.clone()).unwrap_or_default())
            .collect()
    } else {
        Vec::new()
    };
    let cache_id = if capacity > 0 && base.cacheable() {
        match set.cache.get(&name) {
            Some((id, req)) if **req == base => {
                let id = *id;
                set.lru.touch(id);
                Some(id)
            }
            _ => {
                if let Some((old, _)) = set.cache.remove(&name) {
                    set.by_id.remove(&old);
                    set.lru.remove(old);
                }
                while set.cache.len() >= capacity {
                    let Some(victim) = set.lru.pop_oldest() else {
                        break;
                    };
                    if let Some(n) = set.by_id.remove(&victim) {
                        set.cache.remove(&n);
                    }
                }
                let id = *next_cache_id;
                *next_cache_id += 1;
                set.cache
                    .insert(name.clone(), (id, std::sync::Arc::new(base.clone())));
                set.by_id.insert(id, name.clone());
                set.lru.touch(id);
                Some(id)
            }
        }
    } else {
        None
    };
    Response {
        set_id,
        kind: base.kind,
        items: vec![Item {
            request: base,
            cache_id,
            first_dims,
            split_matrix,
        }],
        joined,
        last_joined: 0,
        error: None,
    }
}

/// Groups ranks by the value `f` gives and describes the disagreement, or `None` if all agree.
fn disagreement<T: PartialEq + std::fmt::Display>(
    what: &str,
    submitted: &[(usize, &Request)],
    f: impl Fn(&Request) -> T,
) -> Option<String> {
    let mut groups: Vec<(T, Vec<usize>)> = Vec::new();
    for &(rank, r) in submitted {
        let v = f(r);
        match groups.iter_mut().find(|(g, _)| *g == v) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((v, vec![rank])),
        }
    }
    if groups.len() <= 1 {
        return None;
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(v, ranks)| format!("{} sent {v}", who(ranks)))
        .collect();
    Some(format!("Mismatched {what}: {}", parts.join(", ")))
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

fn validate(name: &str, submitted: &[(usize, &Request)]) -> Option<String> {
    let with_name = |m: String| format!("{m} (tensor '{name}')");
    if let Some(m) = disagreement("operations", submitted, |r| r.kind.name()) {
        return Some(with_name(m));
    }
    if let Some(m) = disagreement("number of tensors in the group", submitted, |r| {
        r.tensors.len()
    }) {
        return Some(with_name(m));
    }
    let kind = submitted[0].1.kind;
    for t in 0..submitted[0].1.tensors.len() {
        let tn = |m: String| {
            if submitted[0].1.tensors.len() > 1 {
                format!("{m} (tensor '{name}', group member {t})")
            } else {
                with_name(m)
            }
        };
        if let Some(m) = disagreement("data types", submitted, |r| r.tensors[t].dtype.name()) {
            return Some(tn(m));
        }
        let m = match kind {
            OpKind::Allreduce | OpKind::Broadcast | OpKind::Reducescatter => {
                disagreement(&format!("{} tensor shapes", kind.name()), submitted, |r| {
                    shape_str(&r.tensors[t].shape)
                })
            }
            OpKind::Allgather | OpKind::Alltoall => {
                if let Some(m) = disagreement(
                    &format!("{} tensor ranks (number of dimensions)", kind.name()),
                    submitted,
                    |r| r.tensors[t].shape.len(),
                ) {
                    Some(m)
                } else {
                    disagreement(
                        &format!("{} tensor shapes beyond the first dimension", kind.name()),
                        submitted,
                        |r| shape_str(r.tensors[t].shape.get(1..).unwrap_or(&[])),
                    )
                }
            }
            _ => None,
        };
        if let Some(m) = m {
            return Some(tn(m));
        }
    }
    // After dtypes and shapes, which say more when they differ too.
    if let Some(m) = disagreement("devices", submitted, |r| r.device.name()) {
        return Some(with_name(format!(
            "{m}; a CUDA tensor runs on NCCL only where ferrovod finds NCCL and a working CUDA \
             driver, and is staged through host memory elsewhere: give every rank the same \
             setup"
        )));
    }
    match kind {
        OpKind::Allreduce | OpKind::Reducescatter => {
            if let Some(m) = disagreement("reduction operations", submitted, |r| r.op.name()) {
                return Some(with_name(m));
            }
            if let Some(m) = disagreement("prescale and/or postscale factors", submitted, |r| {
                format!("({}, {})", r.prescale, r.postscale)
            }) {
                return Some(with_name(m));
            }
        }
        OpKind::Broadcast => {
            if let Some(m) = disagreement("BROADCAST root ranks", submitted, |r| r.root) {
                return Some(with_name(m));
            }
        }
        OpKind::Alltoall => {
            let n = submitted.len();
            if let Some(&(rank, r)) = submitted.iter().find(|(_, r)| r.splits.len() != n) {
                return Some(with_name(format!(
                    "ALLTOALL splits of rank {rank} have {} entries, expected one per rank of the set ({n})",
                    r.splits.len()
                )));
            }
        }
        _ => {}
    }
    None
}
