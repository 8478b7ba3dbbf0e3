//! Host grouping: ranks that published the same host name form a host, and local and cross
//! ranks follow from the groups (DESIGN.md, "Launch and bootstrap").

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
}
