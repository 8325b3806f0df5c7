"""Replicas: bytes from storage and wall time of `raylazy.load(..., replicas=R)` against R independent loads.

    python benchmarks/replicas.py [MODEL_DIR] [--tp 2] [--replicas 1 2 4] [--nodes 4]

Starts `--nodes` simulated Ray nodes on this machine (`ray.cluster_utils.Cluster`, 2 CPUs and 2 logical GPUs
each, loopback only), then for each R: one load with `replicas=R` (replica 0 reads, the others copy from it
over the object store), and R loads of one replica each, one after the other, all on the CPU. Prints one row
per (R, way): bytes read from storage, bytes copied from peers, wall seconds. Without MODEL_DIR, a generated
Llama-shaped checkpoint. Warm page cache: storage bytes are the point, wall times are this machine's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time


def _load(model_dir: str, tp: int, replicas: int):
    import raylazy

    return raylazy.load(model_dir, tp, replicas=replicas, use_gpu=True, device="cpu", progress=False,
                        placement_strategy="SPREAD", placement_timeout_s=300)


def measure(model_dir: str, tp: int, replicas: int) -> list[dict]:
    """One load with `replicas` replicas, and `replicas` independent loads: storage bytes, peer bytes, seconds."""
    rows = []
    start = time.perf_counter()
    loaded = _load(model_dir, tp, replicas)
    rows.append({"replicas": replicas, "way": "replicas=R", "seconds": time.perf_counter() - start,
                 "storage": sum(s.bytes_read for s in loaded.stats),
                 "peers": sum(s.bytes_from_replica for s in loaded.stats)})
    loaded.release()
    start, stats = time.perf_counter(), []
    for _ in range(replicas):
        one = _load(model_dir, tp, 1)
        stats += one.stats
        one.release()
    rows.append({"replicas": replicas, "way": "R independent", "seconds": time.perf_counter() - start,
                 "storage": sum(s.bytes_read for s in stats), "peers": 0})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--nodes", type=int, default=4)
    args = ap.parse_args(argv)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, before Ray is imported
    import ray
    from ray.cluster_utils import Cluster

    from raylazy.core.plans import format_bytes
    from raylazy.synthetic import write_llama_checkpoint

    with tempfile.TemporaryDirectory(prefix="raylazy-replicas-") as tmp:
        model_dir = args.model_dir or write_llama_checkpoint(tmp)
        node = dict(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.1", include_dashboard=False)
        cluster = Cluster(initialize_head=True, head_node_args=node)
        try:
            for _ in range(args.nodes - 1):
                cluster.add_node(**{k: v for k, v in node.items() if k != "include_dashboard"})
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
            _load(model_dir, args.tp, 1).release()  # warm: page cache, worker processes
            rows = [row for r in args.replicas for row in measure(model_dir, args.tp, r)]
        finally:
            ray.shutdown()
            cluster.shutdown()
    print(f"{model_dir}, tp={args.tp}, {args.nodes} simulated nodes")
    print(f"{'R':>2} {'way':<14} {'from storage':>13} {'from peers':>11} {'seconds':>8}")
    for r in rows:
        print(f"{r['replicas']:>2} {r['way']:<14} {format_bytes(r['storage']):>13} {format_bytes(r['peers']):>11} "
              f"{r['seconds']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
