//! Hierarchical allreduce for sets that span several hosts: reduce inside each host (shared
//! memory), allreduce across hosts (the network), spread the result inside each host. Only the
//! cross-host step touches the slow links, and it carries less than a flat ring does.
//!
//! Ranks are grouped by [`Communicator::host_of`]: hosts in the order of their lowest set rank,
//! each host's members in set-rank order; a member's *local index* is its place on its host.
//! Two shapes, with `B` the payload, `H` hosts and `L` members per host:
//!
//! - **2-D** (every host has the same `L > 1` members, payload above
//!   `small_allreduce_bytes`): (a) ring reduce-scatter inside each host over `L` segments, so
//!   local index `i` holds its host's partial of segment `i`; (b) the `H` ranks with local
//!   index `i` allreduce segment `i` (flat: small algorithm or ring, by the segment's size);
//!   (c) ring allgather inside each host. Bytes sent per rank across hosts:
//!   `2·(H-1)/H·B/L` (ring), so `2·(H-1)/H·B` per host, against `2·(n-1)/n·B` per cross-host
//!   edge of a flat ring; `L` streams cross the network at once.
//! - **leaders** (hosts of unequal size, or small payloads): (a) each host reduces to its
//!   first member — small payloads by one fan-in (the first member folds the others' buffers
//!   in local order), large ones by ring reduce-scatter and a gather of the segments;
//!   (b) the first members allreduce across hosts (flat, by size); (c) each first member
//!   spreads the result — one fan-out for small payloads, a scatter and ring allgather for
//!   large ones. Bytes sent across hosts per host: those of one flat allreduce over `H` ranks.
//!
//! Bitwise identity on every rank (see [`super::allreduce`]): every segment is reduced at one
//! place per host along a fixed chain, then across hosts by a flat algorithm that already
//! guarantees identical results on its members, and only copied afterwards.
//!
//! Lockstep: each step runs inside disjoint groups (hosts, or columns of one local index, or
//! the leaders); a rank that enters a step has finished all its transfers of the previous one,
//! so no step waits on a rank that waits on it.

use std::collections::HashMap;

use super::allgather::ring_allgather;
use super::allreduce::{check, flat};
use super::reduce::{reduce_into, scale};
use super::reducescatter::ring_reduce_scatter;
use super::{even_segments, split_blocks};
use crate::comm::{Communicator, Hierarchical};
use crate::error::Result;
use crate::transport::Xfer;
use crate::types::{DType, ReduceOp, Reduction};

/// How a set's members sit on hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Set ranks on each host: hosts in order of their lowest set rank, members ascending.
    pub hosts: Vec<Vec<usize>>,
    /// Index into `hosts` of this rank's host.
    pub mine: usize,
    /// This rank's place on its host.
    pub local: usize,
}

impl Layout {
    /// The layout of `comm`'s set, when a hierarchical algorithm can apply: hosts are known,
    /// there are at least two, and some host has more than one member.
    pub fn of(comm: &Communicator<'_>) -> Option<Layout> {
        Layout::new(comm.size(), comm.rank(), |r| comm.host_of(r))
    }

    /// The layout of a set of `n` ranks, this one `me`, where set rank `r` is on host
    /// `host_of(r)` (`None`: hosts unknown); `None` where [`Layout::of`] says so.
    pub fn new(n: usize, me: usize, host_of: impl Fn(usize) -> Option<u32>) -> Option<Layout> {
        let mut index: HashMap<u32, usize> = HashMap::new();
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for r in 0..n {
            let h = host_of(r)?;
            let i = *index.entry(h).or_insert_with(|| {
                hosts.push(Vec::new());
                hosts.len() - 1
            });
            hosts[i].push(r);
        }
        if hosts.len() < 2 || hosts.iter().all(|g| g.len() == 1) {
            return None;
        }
        let mine = hosts.iter().position(|g| g.contains(&me))?;
        let local = hosts[mine].iter().position(|&r| r == me)?;
        Some(Layout { hosts, mine, local })
    }

    /// Every host has the same number of members.
    pub fn uniform(&self) -> bool {
        self.hosts.iter().all(|g| g.len() == self.hosts[0].len())
    }
}

/// Whether `comm.tuning.hierarchical` asks for the hierarchical algorithm on a payload of
/// `len` bytes (whether the set's layout allows it is [`Layout::of`]'s answer).
pub(crate) fn wanted(comm: &Communicator<'_>, len: usize) -> bool {
    match comm.tuning.hierarchical {
        Hierarchical::Never => false,
        Hierarchical::Always => true,
        Hierarchical::Auto => len > comm.tuning.small_allreduce_bytes,
    }
}

/// In-place hierarchical allreduce (see the module doc for both shapes); a set that no
/// [`Layout`] fits (one host, one member per host, hosts unknown) runs the flat algorithms.
/// The result is multiplied by `red.factor`. Bool, Adasum and buffers of partial elements are
/// `InvalidArgument`.
pub fn allreduce(comm: &mut Communicator<'_>, buf: &mut [u8], red: Reduction) -> Result<()> {
    check(buf, red.dtype, red.op)?;
    if comm.size() == 1 || buf.is_empty() {
        return scale(red.dtype, buf, red.factor);
    }
    let Some(layout) = Layout::of(comm) else {
        return flat(comm, buf, red);
    };
    let small = buf.len() <= comm.tuning.small_allreduce_bytes;
    // The step across hosts is the last reduction: it applies the factor, and the hosts share
    // the scaled result.
    if layout.uniform() && !small {
        two_d(comm, &layout, buf, red)
    } else {
        leaders(comm, &layout, buf, red, small)
    }
}

fn two_d(
    comm: &mut Communicator<'_>,
    layout: &Layout,
    buf: &mut [u8],
    red: Reduction,
) -> Result<()> {
    let host = &layout.hosts[layout.mine];
    let es = red.dtype.size();
    let segs = even_segments(buf.len() / es, host.len(), es);
    let mut scratch = Vec::new();
    let local = Reduction::new(red.dtype, red.op);
    ring_reduce_scatter(&mut comm.subgroup(host, &mut scratch), buf, &segs, local)?;
    let column: Vec<usize> = layout.hosts.iter().map(|g| g[layout.local]).collect();
    let mine = segs[layout.local].clone();
    flat(
        &mut comm.subgroup(&column, &mut scratch),
        &mut buf[mine],
        red,
    )?;
    ring_allgather(&mut comm.subgroup(host, &mut scratch), buf, &segs)
}

fn leaders(
    comm: &mut Communicator<'_>,
    layout: &Layout,
    buf: &mut [u8],
    red: Reduction,
    small: bool,
) -> Result<()> {
    let host = &layout.hosts[layout.mine];
    let mut scratch = Vec::new();
    if host.len() > 1 {
        let mut local = comm.subgroup(host, &mut scratch);
        reduce_to_first(&mut local, buf, red.dtype, red.op, small)?;
    }
    if layout.local == 0 {
        let firsts: Vec<usize> = layout.hosts.iter().map(|g| g[0]).collect();
        flat(&mut comm.subgroup(&firsts, &mut scratch), buf, red)?;
    }
    if host.len() > 1 {
        let mut local = comm.subgroup(host, &mut scratch);
        spread_from_first(&mut local, buf, red.dtype, small)?;
    }
    Ok(())
}

/// Leaves the reduction of every rank's `buf` in rank 0's `buf` (others: scratch). Small: one
/// fan-in, folded in rank order at rank 0. Large: ring reduce-scatter, then rank 0 gathers the
/// reduced segments.
fn reduce_to_first(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    small: bool,
) -> Result<()> {
    let (n, b) = (comm.size(), buf.len());
    if small {
        if comm.rank() != 0 {
            return comm.send(0, buf);
        }
        let mut others = vec![0u8; (n - 1) * b];
        let mut xfers: Vec<Xfer<'_>> = others
            .chunks_exact_mut(b)
            .enumerate()
            .map(|(i, slot)| Xfer::Recv {
                peer: i + 1,
                buf: slot,
            })
            .collect();
        comm.exchange(&mut xfers)?;
        drop(xfers);
        for src in others.chunks_exact(b) {
            reduce_into(dtype, op, buf, src)?;
        }
        return Ok(());
    }
    let segs = even_segments(b / dtype.size(), n, dtype.size());
    ring_reduce_scatter(comm, buf, &segs, Reduction::new(dtype, op))?;
    if comm.rank() != 0 {
        let mine = segs[comm.rank()].clone();
        return comm.send(0, &buf[mine]);
    }
    let mut xfers: Vec<Xfer<'_>> = split_blocks(buf, &segs)
        .into_iter()
        .enumerate()
        .skip(1)
        .map(|(peer, slot)| Xfer::Recv { peer, buf: slot })
        .collect();
    comm.exchange(&mut xfers)
}

/// Copies rank 0's `buf` to every rank. Small: one fan-out. Large: rank 0 scatters one segment
/// to each rank, then a ring allgather.
fn spread_from_first(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    dtype: DType,
    small: bool,
) -> Result<()> {
    let n = comm.size();
    if small {
        if comm.rank() != 0 {
            return comm.recv(0, buf);
        }
        let mut xfers: Vec<Xfer<'_>> = (1..n).map(|peer| Xfer::Send { peer, buf: &*buf }).collect();
        return comm.exchange(&mut xfers);
    }
    let segs = even_segments(buf.len() / dtype.size(), n, dtype.size());
    if comm.rank() == 0 {
        let mut xfers: Vec<Xfer<'_>> = (1..n)
            .map(|peer| Xfer::Send {
                peer,
                buf: &buf[segs[peer].clone()],
            })
            .collect();
        comm.exchange(&mut xfers)?;
    } else {
        let mine = segs[comm.rank()].clone();
        comm.recv(0, &mut buf[mine])?;
    }
    ring_allgather(comm, buf, &segs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Tuning;
    use crate::transport::Transport;
    use std::time::Duration;

    /// A transport that only knows who it is: enough to build communicators and layouts.
    struct Nobody(usize, usize);

    impl Transport for Nobody {
        fn rank(&self) -> usize {
            self.0
        }
        fn size(&self) -> usize {
            self.1
        }
        fn exchange(&mut self, _: &mut [Xfer<'_>], _: Duration) -> Result<()> {
            unreachable!("layout tests move no bytes")
        }
        fn abort(&mut self) {}
    }

    fn layout(me: usize, members: &[usize], hosts: &[u32]) -> Option<Layout> {
        let mut t = Nobody(me, hosts.len());
        let comm = Communicator::new(&mut t, members, Duration::from_secs(1), Tuning::default())
            .with_hosts(hosts);
        Layout::of(&comm)
    }

    #[test]
    fn layouts_group_by_host_in_order_of_first_member() {
        let l = layout(3, &[0, 1, 2, 3], &[5, 9, 5, 9]).unwrap();
        assert_eq!(l.hosts, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!((l.mine, l.local), (1, 1));
        assert!(l.uniform());
        // A sub-set: set ranks, not global ones.
        let l = layout(4, &[1, 2, 4, 5, 6], &[0, 1, 1, 2, 2, 0, 2]).unwrap();
        assert_eq!(l.hosts, vec![vec![0, 1], vec![2, 4], vec![3]]);
        assert_eq!((l.mine, l.local), (1, 0));
        assert!(!l.uniform());
    }

    #[test]
    fn no_layout_where_flat_is_all_there_is() {
        assert_eq!(layout(0, &[0, 1, 2], &[4, 4, 4]), None, "one host");
        assert_eq!(layout(0, &[0, 1, 2], &[0, 1, 2]), None, "one rank per host");
        assert_eq!(
            layout(0, &[0, 2], &[0, 0, 1]),
            None,
            "one rank per host in the set"
        );
        assert_eq!(layout(0, &[0, 1, 2, 3], &[]), None, "hosts unknown");
        assert_eq!(
            layout(0, &[0, 1, 2, 3], &[0, 0, 1]),
            None,
            "hosts cover too few ranks"
        );
    }
}
