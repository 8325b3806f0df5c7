"""Projections of the load-time model (`raylazy.estimate`) to the clusters users load on: model output, every
assumption shown, beside the times the anchors publish.

    python -m benchmarks.estimate_projections            # prints the tables of docs/estimate.md
    python -m benchmarks.estimate_projections --json out.json

Each checkpoint is written as sparse files with its real tensor names, shapes and dtypes (headers only, as
benchmarks/plan_405b.py and plan_deepseek.py do) and planned as `raylazy plan` plans it, for the storage it is
read from (its cost model decides which row-split reads are gathered):

- DeepSeek-R1 (DeepSeek-V3's layout: fp8 with block scales, 163 files) at TP8 with expert parallel on one 8-GPU
  node reading storage at 50 GB/s (preset `anchor-50gbps`), beside InstantTensor's published comparison;
- Llama-3.1-405B (bf16, 191 files) at tp=8 x pp=2 over two 8-GPU nodes from an NFS like EFS (`nfs-cloud`);
- Kimi-K2 (DeepSeek-V3-shaped: 384 routed experts, 64 heads, one dense layer, vocab 163,840, fp8 with block
  scales, no multi-token-prediction layer; config written here from Kimi-K2's published config.json, 61 files) at
  tp=8 x pp=4 with expert parallel onto four 8-GPU nodes from in-region S3 (`s3-region`);
- a replica of DeepSeek-R1 at TP8 added from a live one over the NIC, beside reading it from a local NVMe RAID
  and from S3 (NVIDIA ModelExpress publishes these three roads for DeepSeek-V4-Pro: another checkpoint, whose
  layout is not modelled here; its times are shown for scale only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # plan_405b, plan_deepseek from a checkout

import plan_405b  # noqa: E402
import plan_deepseek  # noqa: E402

from raylazy.core.estimate import compare, estimate  # noqa: E402
from raylazy.core.hardware import preset  # noqa: E402
from raylazy.core.planner import with_replicas  # noqa: E402
from raylazy.planning import make_plan  # noqa: E402

#: moonshotai/Kimi-K2-Instruct config.json, the parts that shape tensors (DeepSeek-V3's architecture).
KIMI_K2 = {**plan_deepseek.CONFIG, "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64,
           "first_k_dense_replace": 1, "vocab_size": 163840, "num_nextn_predict_layers": 0}
KIMI_FILES = 61
#: Published load times of DeepSeek-R1 (688.6 GB) at TP8/EP8 on 8 GPUs with 50 GB/s storage (InstantTensor's README).
ANCHORS_R1 = {"InstantTensor": 15.3, "fastsafetensors": 75.8, "Run:ai model streamer": 101.0, "safetensors": 160.0}
#: NVIDIA ModelExpress, DeepSeek-V4-Pro's weights at TP8: from a live replica, cold local disk, S3.
MODEL_EXPRESS_V4 = {"live replica": 11.0, "cold local disk": 70.0, "S3": 196.0}


def _write(root: str) -> dict[str, str]:
    dirs = {name: os.path.join(root, name) for name in ("deepseek-r1", "llama-405b", "kimi-k2")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    plan_deepseek.write_checkpoint(dirs["deepseek-r1"])
    plan_405b.write_checkpoint(dirs["llama-405b"])
    specs = plan_deepseek.tensor_specs(KIMI_K2["num_hidden_layers"], KIMI_K2["n_routed_experts"], "fp8", KIMI_K2)
    plan_405b.write_sparse_checkpoint(dirs["kimi-k2"], specs, KIMI_K2, KIMI_FILES)
    return dirs


def _plan(model_dir: str, hardware: str, tp: int, **kw):
    return make_plan(model_dir, tp, cost_model=preset(hardware).storage.cost_model(), **kw)


def scenarios(dirs: dict[str, str]) -> list[dict]:
    """Every projection: its name, hardware, the estimates of each loader, and what it is set beside."""
    r1 = _plan(dirs["deepseek-r1"], "anchor-50gbps", 8, expert_parallel=True)
    out = [{"name": "DeepSeek-R1, TP8/EP8, one 8-GPU node, storage at 50 GB/s", "hardware": "anchor-50gbps",
            "estimates": compare(r1, "anchor-50gbps"), "published": ANCHORS_R1}]
    llama = _plan(dirs["llama-405b"], "nfs-cloud", 8, pp=2)
    out.append({"name": "Llama-3.1-405B, tp=8 x pp=2, two 8-GPU nodes, NFS (EFS-like)", "hardware": "nfs-cloud",
                "estimates": compare(llama, "nfs-cloud"), "published": {}})
    kimi = _plan(dirs["kimi-k2"], "s3-region", 8, pp=4, expert_parallel=True)
    out.append({"name": "Kimi-K2, tp=8 x pp=4 with EP, four 8-GPU nodes, in-region S3", "hardware": "s3-region",
                "estimates": compare(kimi, "s3-region"), "published": {}})
    roads = {"from a live replica (another node)": estimate(r1, "nvme-node", live_source=True),
             "cold, local NVMe RAID": estimate(r1, "nvme-node"),
             "from S3": estimate(_plan(dirs["deepseek-r1"], "s3-region", 8, expert_parallel=True), "s3-region")}
    out.append({"name": "DeepSeek-R1 at TP8: a replica added from a live one, or read", "hardware": "nvme-node",
                "estimates": roads, "published": {f"ModelExpress, DeepSeek-V4-Pro, {k}": v
                                                  for k, v in MODEL_EXPRESS_V4.items()}})
    twice = with_replicas(r1, 2)
    out.append({"name": "DeepSeek-R1, TP8/EP8, two replicas on two nodes (replica 1 copies replica 0)",
                "hardware": "nvme-node", "estimates": {"raylazy": estimate(twice, "nvme-node")}, "published": {}})
    return out


def report(rows: list[dict]) -> str:
    lines = []
    for s in rows:
        lines += [f"### {s['name']}", "", f"Hardware: `{s['hardware']}`. Model output, seconds.", "",
                  "| loader | plan | actors | read | copy | total | weights (plan+read+copy) | bottleneck |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for name, e in s["estimates"].items():
            p = e.phases
            lines.append(f"| {name} | {p['plan']:.1f} | {p['actors']:.1f} | {p['read']:.1f} | {p['copy']:.1f} | "
                         f"{p['total']:.1f} | {p['plan'] + p['read'] + p['copy']:.1f} | {e.bottleneck} |")
        if s["published"]:
            lines += ["", "Published (measured by their authors):", ""]
            lines += [f"- {k}: {v:g} s" for k, v in s["published"].items()]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.estimate_projections", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write every estimate (phases, nodes, assumptions) here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="raylazy-projections-") as root:
        rows = scenarios(_write(root))
    print(report(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**s, "estimates": {k: e.to_dict() for k, e in s["estimates"].items()}} for s in rows], fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
