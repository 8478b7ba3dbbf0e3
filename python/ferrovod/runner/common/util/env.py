"""``horovod.runner.common.util.env``: a worker's rank and size as its launcher set them in
the environment, read before ``init()`` (to build the process sets ``init`` takes, say)."""

from __future__ import annotations

import os
from typing import Tuple

__all__ = ["get_env_rank_and_size", "is_kubeflow_mpi"]

# Whichever launcher started the worker: ferrovodrun (both names), Open MPI, MPICH/Intel MPI.
_RANK_AND_SIZE_VARS = (("FERROVOD_RANK", "FERROVOD_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"),
                       ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))

# The rsh agent the Kubeflow MPI operator gives mpirun in an MPIJob's launcher pod.
KUBEFLOW_MPI_EXEC = "/etc/mpi/kubexec.sh"


def get_env_rank_and_size() -> Tuple[int, int]:
    """``(rank, size)`` from the first launcher whose variables are set; ``(0, 1)`` when none
    is. A launcher that set only one of its two is an error (RuntimeError), as in Horovod."""
    for rank_var, size_var in _RANK_AND_SIZE_VARS:
        rank = os.environ.get(rank_var)
        size = os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of "
                               f"{rank_var} and {size_var} found in environment")
    return 0, 1


def is_kubeflow_mpi() -> bool:
    """Whether this process runs under the Kubeflow MPI operator's mpirun."""
    return os.environ.get("OMPI_MCA_plm_rsh_agent") == KUBEFLOW_MPI_EXEC
