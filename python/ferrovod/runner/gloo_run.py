"""Horovod's module for jobs its launcher starts with its own rendezvous (``--gloo``), which is
how ``ferrovodrun`` starts every job. It keeps the one name of Horovod's that scripts and tests
written for Horovod reach here."""

from __future__ import annotations

from typing import Any

__all__: list = []


def _get_min_start_hosts(settings: Any) -> int:
    """How many hosts an elastic job waits for before its first membership (besides -np
    slots); the elastic launch asks this once per job.

    Horovod waits for two, to find the network interfaces its hosts share; ferrovod's workers
    reach the rendezvous store from wherever they are, so one is enough.
    """
    return 1
