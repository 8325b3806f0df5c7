"""An RL-style loop: long-lived policy workers get each new checkpoint reloaded in place, and act on it.

    python examples/rl_reload_loop.py [--tp 2] [--steps 4] [--work DIR]

The policy workers are the caller's own Ray actors (`PolicyWorker` mixes in `raylazy.RankMixin`),
started once; `raylazy.load(..., actors=workers)` makes them the tensor-parallel ranks. Each worker
builds its "engine" once from the shard tensors it holds. Then, every step, the "trainer" writes
the next checkpoint (a Llama-shaped model of the same layout, new values) and
`loaded.reload(step_dir)` reads it into the same tensors of the same workers: the engines see the new
weights without being rebuilt. Each step the workers act: for layer 0, each computes its partial
MLP output (row-parallel `down_proj`: the driver sums the partials, as an all-reduce would) and its
slice of the logits (column-parallel `lm_head`: the driver concatenates them), and the driver checks
both against the same products computed from the full tensors it reads with safetensors. Everything
is in float32 (exact from bf16), so only summation order differs.

Prints one JSON line per step (step, reload seconds, max abs errors, match, worker pids, whether
every tensor kept its address) and exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import ray
import torch

import raylazy
from raylazy.cluster.bundles import ensure_ray
from raylazy.synthetic import LlamaShape, write_llama_checkpoint

DOWN, LM_HEAD = "model.layers.0.mlp.down_proj.weight", "lm_head.weight"


class PolicyWorker(raylazy.RankMixin):
    """A long-lived inference worker of the caller's: its own constructor and methods, a rank by the mixin."""

    def __init__(self, name: str):
        self.name = name
        self.engine: dict | None = None

    def build_engine(self) -> None:
        """Build the engine once from the shard tensors (a real one would wrap them in modules)."""
        self.engine = dict(self.shards())

    def act(self, x: torch.Tensor, h: torch.Tensor, pieces: dict) -> dict:
        """This rank's partial down_proj output for x and its slice of the logits for h, from the engine."""
        wd, wl = self.engine[DOWN].float(), self.engine[LM_HEAD].float()
        x_local = torch.zeros(x.shape[0], wd.shape[1])
        for src, dst, length in pieces[DOWN]:  # the columns of x this rank's down_proj slice multiplies
            x_local[:, dst:dst + length] = x[:, src:src + length]
        return {"down": x_local @ wd.T, "logits": h @ wl.T,
                "pointers": {n: t.data_ptr() for n, t in self.engine.items()}}


def check_step(loaded, workers, step_dir: str, gen: torch.Generator) -> dict:
    """The workers act on one input; compare with the full tensors read by safetensors."""
    from safetensors import safe_open

    full = {}
    for f in loaded.plan.files:
        with safe_open(f.uri, framework="pt") as fh:
            full.update({n: fh.get_tensor(n).float() for n in fh.keys() if n in (DOWN, LM_HEAD)})
    x = torch.randn(4, full[DOWN].shape[1], generator=gen)
    h = torch.randn(4, full[LM_HEAD].shape[1], generator=gen)
    pieces = [{t.name: t.pieces for t in rp.tensors} for rp in loaded.plan.ranks]
    outs = ray.get([w.act.remote(x, h, pieces[r]) for r, w in enumerate(workers)])
    down = sum(o["down"] for o in outs)
    logits = torch.zeros(h.shape[0], full[LM_HEAD].shape[0])
    for o, rank_pieces in zip(outs, pieces):  # each rank's rows of lm_head: its slice of the logits
        for src, dst, length in rank_pieces[LM_HEAD]:
            logits[:, src:src + length] = o["logits"][:, dst:dst + length]
    err_down = (down - x @ full[DOWN].T).abs().max().item()
    err_logits = (logits - h @ full[LM_HEAD].T).abs().max().item()
    scale = max(1.0, (x @ full[DOWN].T).abs().max().item())
    return {"err_down": err_down, "err_logits": err_logits,
            "match": err_down <= 1e-4 * scale and err_logits <= 1e-4 * scale,
            "pointers": [o["pointers"] for o in outs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--work", help="where the trainer writes its checkpoints (default: a temporary directory)")
    args = ap.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="raylazy-rl-")
    shape = LlamaShape(hidden_size=256, intermediate_size=704, num_hidden_layers=2, vocab_size=4096)

    ensure_ray()
    cpus = ray.cluster_resources().get("CPU", 1) / args.tp
    worker_cls = ray.remote(num_cpus=min(1.0, cpus), max_concurrency=4)(PolicyWorker)
    workers = [worker_cls.remote(f"policy{r}") for r in range(args.tp)]  # started once, kept for every step
    gen = torch.Generator().manual_seed(0)
    loaded, ok, first_pointers = None, True, None
    try:
        for step in range(args.steps):
            step_dir = write_llama_checkpoint(os.path.join(work, f"step{step}"), shape, seed=step)  # the "trainer"
            t0 = time.perf_counter()
            if loaded is None:
                loaded = raylazy.load(step_dir, args.tp, device="cpu", actors=workers, progress=False)
                ray.get([w.build_engine.remote() for w in workers])
            else:
                loaded.reload(step_dir)
            seconds = time.perf_counter() - t0
            result = check_step(loaded, workers, step_dir, gen)
            first_pointers = first_pointers or result["pointers"]
            ok &= result["match"]
            print(json.dumps({"step": step, "checkpoint": step_dir, "seconds": round(seconds, 3),
                              "err_down": result["err_down"], "err_logits": result["err_logits"],
                              "match": result["match"], "pids": [i.pid for i in loaded.ranks],
                              "same_tensors": result["pointers"] == first_pointers}), flush=True)
    finally:
        if loaded is not None:
            loaded.release()  # the workers' own actors: they drop their shards and live on
        for w in workers:
            ray.kill(w)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
