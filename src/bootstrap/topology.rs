//! Host grouping: ranks that published the same host name form a host, and local and cross
//! ranks follow from the groups (docs/design.md, "Launch and bootstrap").

/// Where this process sits in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank within this host.
    pub local_rank: usize,
    /// Ranks on this host.
    pub local_size: usize,
    /// Index of this host among the hosts that have this local rank.
    pub cross_rank: usize,
    /// Number of hosts that have this local rank.
    pub cross_size: usize,
    /// Whether every host runs the same number of ranks.
    pub homogeneous: bool,
}

impl Topology {
    /// Groups ranks by host name (`hosts[r]` is rank r's host), in rank order.
    pub fn from_hosts(rank: usize, hosts: &[String]) -> Topology {
        let mut order: Vec<&String> = Vec::new();
        for h in hosts {
            if !order.contains(&h) {
                order.push(h);
            }
        }
        let local_of = |r: usize| hosts[..r].iter().filter(|h| **h == hosts[r]).count();
        let counts: Vec<usize> = order
            .iter()
            .map(|h| hosts.iter().filter(|x| x == h).count())
            .collect();
        let local_rank = local_of(rank);
        let local_size = hosts.iter().filter(|h| **h == hosts[rank]).count();
        // cross ranks: hosts that have a rank with this local rank, in host order
        let column: Vec<&String> = order
            .iter()
            .filter(|h| hosts.iter().filter(|x| x == *h).count() > local_rank)
            .copied()
            .collect();
        Topology {
            rank,
            size: hosts.len(),
            local_rank,
            local_size,
            cross_rank: column.iter().position(|h| **h == hosts[rank]).unwrap_or(0),
            cross_size: column.len(),
            homogeneous: counts.windows(2).all(|w| w[0] == w[1]),
        }
    }
}

/// A host index per rank for the collectives ([`crate::comm::Communicator::with_hosts`]): ranks
/// that published the same host name share one, numbered in order of first appearance; a rank
/// that published none is a host of its own (as it gets no shared-memory peers either).
pub fn host_indices(hosts: &[String]) -> Vec<u32> {
    let mut names: Vec<&str> = Vec::new();
    hosts
        .iter()
        .map(|h| {
            let i = match names.iter().position(|n| !h.is_empty() && n == h) {
                Some(i) => i,
                None => {
                    names.push(h);
                    names.len() - 1
                }
            };
            i as u32
        })
        .collect()
}

/// A link of a node: the rank at its far end, and every rank it reaches.
pub type NodeLink = (usize, Vec<usize>);

/// The control plane's tree: every rank's control connection goes to its parent's node, not
/// to rank 0, so that no process talks to more than `fanout` children plus its own engine
/// whatever the size of the job. Each host's first rank (its leader) is the parent of that
/// host's other ranks (`fanout` per level), and the leaders form a `fanout`-ary tree of their
/// own under rank 0, so only leaders talk across hosts. A fanout of 0 is the flat star: every
/// rank under rank 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlTree {
    parent: Vec<Option<usize>>,
    children: Vec<Vec<usize>>,
}

impl ControlTree {
    /// The tree for ranks with the host indices `hosts` ([`host_indices`]).
    pub fn new(hosts: &[u32], fanout: usize) -> ControlTree {
        let size = hosts.len();
        let mut parent = vec![None; size];
        if let Some(fanout) = std::num::NonZeroUsize::new(fanout) {
            let fanout = fanout.get();
            let mut by_host: Vec<Vec<usize>> = Vec::new();
            for (r, &h) in hosts.iter().enumerate() {
                let h = h as usize;
                if by_host.len() <= h {
                    by_host.resize(h + 1, Vec::new());
                }
                by_host[h].push(r);
            }
            by_host.retain(|ranks| !ranks.is_empty());
            // Rank 0's host leads: host indices follow first appearance, so it is host 0.
            let leaders: Vec<usize> = by_host.iter().map(|ranks| ranks[0]).collect();
            for (i, &l) in leaders.iter().enumerate().skip(1) {
                parent[l] = Some(leaders[(i - 1) / fanout]);
            }
            for ranks in &by_host {
                for (j, &r) in ranks.iter().enumerate().skip(1) {
                    parent[r] = Some(ranks[(j - 1) / fanout]);
                }
            }
        } else {
            for p in parent.iter_mut().skip(1) {
                *p = Some(0);
            }
        }
        let mut children = vec![Vec::new(); size];
        for (r, p) in parent.iter().enumerate() {
            if let Some(p) = *p {
                children[p].push(r);
            }
        }
        ControlTree { parent, children }
    }

    /// Ranks in the job.
    pub fn size(&self) -> usize {
        self.parent.len()
    }

    /// The rank whose node `rank` reports to (`None` for rank 0).
    pub fn parent(&self, rank: usize) -> Option<usize> {
        self.parent[rank]
    }

    /// The ranks that report to `rank`'s node, ascending.
    pub fn children(&self, rank: usize) -> &[usize] {
        &self.children[rank]
    }

    /// Whether `rank` runs a node: rank 0 always (the coordinator), any other rank with
    /// children (a relay).
    pub fn has_node(&self, rank: usize) -> bool {
        rank == 0 || !self.children[rank].is_empty()
    }

    /// Where `rank` connects its engine's control connection: its own node when it has one,
    /// else its parent's.
    pub fn control_node(&self, rank: usize) -> usize {
        if self.has_node(rank) {
            rank
        } else {
            self.parent[rank].unwrap_or(0)
        }
    }

    /// `rank` and every rank below it, ascending.
    pub fn subtree(&self, rank: usize) -> Vec<usize> {
        let mut out = vec![rank];
        let mut i = 0;
        while i < out.len() {
            out.extend_from_slice(&self.children[out[i]]);
            i += 1;
        }
        out.sort_unstable();
        out
    }

    /// The links of `node`'s node: its own engine (`node`, reaching only itself) and each
    /// child's (reaching its subtree), and for every rank below the node, the link its
    /// messages travel by (`None` for ranks elsewhere).
    pub fn links(&self, node: usize) -> (Vec<NodeLink>, Vec<Option<usize>>) {
        let mut route = vec![None; self.size()];
        route[node] = Some(node);
        let mut links = vec![(node, vec![node])];
        for &c in &self.children[node] {
            let below = self.subtree(c);
            for &r in &below {
                route[r] = Some(c);
            }
            links.push((c, below));
        }
        (links, route)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_groups_hosts() {
        let hosts: Vec<String> = ["a", "a", "b", "b", "c"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let t = Topology::from_hosts(3, &hosts);
        assert_eq!(
            (t.local_rank, t.local_size, t.cross_rank, t.cross_size),
            (1, 2, 1, 2)
        );
        let t = Topology::from_hosts(4, &hosts);
        assert_eq!(
            (t.local_rank, t.local_size, t.cross_rank, t.cross_size),
            (0, 1, 2, 3)
        );
        assert!(!t.homogeneous);
    }

    #[test]
    fn host_indices_follow_first_appearance() {
        let hosts: Vec<String> = ["b", "a", "b", "", "a", ""]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(host_indices(&hosts), vec![0, 1, 0, 2, 1, 3]);
    }

    #[test]
    fn control_tree_leaders_across_hosts_and_fanout_within() {
        // Two hosts of 4, fanout 2: rank 4 leads the second host under rank 0.
        let t = ControlTree::new(&[0, 0, 0, 0, 1, 1, 1, 1], 2);
        let parents: Vec<Option<usize>> = (0..8).map(|r| t.parent(r)).collect();
        assert_eq!(
            parents,
            vec![
                None,
                Some(0),
                Some(0),
                Some(1),
                Some(0),
                Some(4),
                Some(4),
                Some(5)
            ]
        );
        assert_eq!(t.children(0), &[1, 2, 4]);
        assert_eq!(t.subtree(4), vec![4, 5, 6, 7]);
        assert!(t.has_node(5) && !t.has_node(7));
        assert_eq!((t.control_node(5), t.control_node(7)), (5, 5));
        let (links, route) = t.links(0);
        let ids: Vec<usize> = links.iter().map(|l| l.0).collect();
        assert_eq!(ids, vec![0, 1, 2, 4]);
        assert_eq!(route[3], Some(1));
        assert_eq!(route[7], Some(4));
        // Every rank is reached from the root exactly once.
        let mut all: Vec<usize> = links.iter().flat_map(|l| l.1.clone()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn control_tree_fanout_zero_is_the_star() {
        let t = ControlTree::new(&[0, 1, 1, 2], 0);
        assert_eq!(t.children(0), &[1, 2, 3]);
        assert!((1..4).all(|r| !t.has_node(r) && t.control_node(r) == 0));
        // One host under the fanout is a star too.
        let t = ControlTree::new(&[0; 5], 4);
        assert_eq!(t.children(0), &[1, 2, 3, 4]);
    }
}
