"""Ray clusters on loopback for the benchmarks and the tests (`ray.cluster_utils.Cluster`)."""

from __future__ import annotations


def start_cluster(head: dict, nodes: list[dict]):
    """A `ray.cluster_utils.Cluster` on 127.0.0.1: a head with the resources in `head`, then one node per entry of
    `nodes` (e.g. dict(num_cpus=2, num_gpus=2)); stopped (`stop_cluster`) if a node fails to start."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(head, node_ip_address="127.0.0.1"))
    try:
        for resources in nodes:
            cluster.add_node(node_ip_address="127.0.0.1", **resources)
        cluster.wait_for_nodes()
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster) -> None:
    """Kill a test cluster's processes (after `ray.shutdown()`): Cluster.shutdown() would stop each node
    gracefully, waiting on its raylet and workers in turn, and a test cluster has nothing to flush."""
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node, allow_graceful=False)
    if cluster.head_node is not None:
        cluster.remove_node(cluster.head_node, allow_graceful=False)
    cluster.shutdown()  # no nodes left: resets the driver-side state (internal KV, the address file)
