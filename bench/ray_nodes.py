"""A Ray cluster of several nodes on this machine, its worker nodes named by role.

``ray.cluster_utils.Cluster`` (Ray's own multi-node test cluster): a head that hosts
nothing of ours (the driver joins it) and worker nodes that each carry a custom resource
naming their role (``engine_0``, ``envs``, ...), so an actor whose options ask for that
resource lands there. A node is killed as Ray's tests kill one: its raylet and workers
by SIGKILL (``remove_node(..., allow_graceful=False)``). Shared by ``bench/node_loss.py``,
the fault campaign's ``node_kill`` points and ``tests/distributed/test_cluster_nodes.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

NODE_MEMORY = {"object_store_memory": 80 << 20}
"""Each node's object store: small, since several share this machine's memory."""


@attrs.define
class Nodes:
    """A cluster and its worker nodes by role (a lost node leaves the dict)."""

    cluster: Any
    by_role: dict[str, Any]

    def add(self, role: str, num_cpus: float = 1) -> Any:
        """A new node carrying resource ``role``; returns once Ray lists it."""
        node = self.cluster.add_node(num_cpus=num_cpus, resources={role: 1}, **NODE_MEMORY)
        self.cluster.wait_for_nodes()
        self.by_role[role] = node
        return node

    def kill(self, role: str) -> Any:
        """SIGKILL the node of ``role``: its raylet and every worker process on it."""
        node = self.by_role.pop(role)
        self.cluster.remove_node(node, allow_graceful=False)
        return node

    def id(self, role: str) -> str:
        return str(self.by_role[role].node_id)


@contextlib.contextmanager
def ray_cluster(roles: Iterable[str], cpus: Mapping[str, float] | None = None) -> Iterator[Nodes]:
    """A head (1 CPU, no dashboard) and one node per role (``cpus[role]`` CPUs, else 1),
    with this process's Ray session joined to it; everything shut down on exit. A Ray
    session already up in this process is shut down first (a cluster needs its own)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    head = {"num_cpus": 1, "include_dashboard": False, **NODE_MEMORY}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        nodes = Nodes(cluster, {})
        for role in roles:
            nodes.add(role, (cpus or {}).get(role, 1))
        ray.init(address=cluster.address, log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
