"""A Ray job: load a checkpoint tensor-parallel with raylazy, compute one layer's parallel matmuls in the rank actors.

    ray job submit --working-dir . -- python examples/ray_job.py [MODEL_DIR] [--tp 2]

Each rank holds only its slices. For layer `--layer` (default 0) every rank computes,
next to its shards (`LoadedModel.run`):

- its partial attention output projection: the row-parallel `o_proj` slice times
  its slice of the attention output, and
- its partial MLP: its column-parallel `gate_proj`/`up_proj` slices give its
  slice of `silu(gate) * up`, times its row-parallel `down_proj` slice.

The driver sums the partials over ranks (the all-reduce of a real engine) and
compares them with the same products computed from the full tensors, read on the
driver with safetensors. Everything is computed in float32 (bf16 -> float32 is
exact), so only summation order differs. Exits 1 on a mismatch.

Without MODEL_DIR a small Llama-shaped checkpoint is generated in a temporary
directory on the driver's node: on a multi-node cluster, give a MODEL_DIR that
every node can read (shared storage) instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import ray
import torch

import raylazy

O_PROJ, GATE, UP, DOWN = "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"


def rank_partials(rank: int, shards: dict, x_attn: torch.Tensor, x_mlp: torch.Tensor, prefix: str,
                  pieces: dict) -> dict:
    """Runs inside rank `rank`'s actor: this rank's partial o_proj and MLP outputs (float32, on the CPU).

    `pieces[rank][name]` says which entries of the sharded dim this rank holds,
    as (src, dst, length) runs (raylazy's TensorShard.pieces).
    """

    def local(x: torch.Tensor, name: str, width: int) -> torch.Tensor:
        """This rank's slice of x's last dim, as the shard of `name` is laid out (unfilled entries: padding, 0)."""
        out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        for src, dst, length in pieces[rank][name]:
            out[:, dst : dst + length] = x[:, src : src + length]
        return out

    dev = shards[prefix + O_PROJ].device
    wo = shards[prefix + O_PROJ].float()                 # [hidden, heads_local * head_dim]  (row-parallel)
    wg, wu = shards[prefix + GATE].float(), shards[prefix + UP].float()  # [inter_local, hidden] (column-parallel)
    wd = shards[prefix + DOWN].float()                   # [hidden, inter_local]  (row-parallel)
    x_attn, x_mlp = x_attn.to(dev), x_mlp.to(dev)

    o_partial = local(x_attn, prefix + O_PROJ, wo.shape[1]) @ wo.T
    act = torch.nn.functional.silu(x_mlp @ wg.T) * (x_mlp @ wu.T)  # this rank's slice of the intermediate
    mine = pieces[rank]
    if not mine[prefix + GATE] == mine[prefix + UP] == mine[prefix + DOWN]:
        raise RuntimeError(f"rank {rank}: gate/up rows and down_proj columns are split differently")
    mlp_partial = act @ wd.T
    return {"o_proj": o_partial.cpu(), "mlp": mlp_partial.cpu()}


def full_tensors(plan: raylazy.Plan, names: list[str]) -> dict:
    """The named tensors, whole, read on the driver with safetensors (the reference)."""
    from safetensors import safe_open

    out = {}
    for f in plan.files:
        with safe_open(f.uri, framework="pt") as fh:
            for name in set(names) & set(fh.keys()):
                out[name] = fh.get_tensor(name)
    missing = sorted(set(names) - set(out))
    if missing:
        raise SystemExit(f"the checkpoint has no {', '.join(missing)}: is it Llama-shaped? (try another --layer)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", help="model directory (default: generate a small Llama-shaped one)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel world size (default 2)")
    ap.add_argument("--layer", type=int, default=0, help="which decoder layer to compute (default 0)")
    ap.add_argument("--batch", type=int, default=4, help="rows of random input (default 4)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--atol", type=float, default=1e-4,
                    help="absolute tolerance, times the reference's largest |value|")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print(f"raylazy {raylazy.__version__} imported from {os.path.dirname(raylazy.__file__)}")
    with tempfile.TemporaryDirectory(prefix="raylazy-job-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from raylazy.synthetic import write_llama_checkpoint

            model_dir = write_llama_checkpoint(tmp)
            print(f"no model given: generated a Llama-shaped checkpoint in {model_dir}")
        if not ray.is_initialized():
            ray.init()  # a Ray job gets RAY_ADDRESS, so this joins the job's cluster
        t0 = time.perf_counter()
        loaded = raylazy.load(model_dir, tp=args.tp, device=args.device, progress=False)
        try:
            return check(loaded, args, time.perf_counter() - t0)
        finally:
            loaded.release()


def check(loaded, args, load_s: float) -> int:
    plan = loaded.plan
    print(f"loaded in {load_s:.2f} s")
    print(f"{'rank':>4} {'node':>10} {'pid':>7} {'device':>7} {'tensors':>7} {'needed':>11} {'read':>11} "
          f"{'requests':>8} {'seconds':>7} {'GB/s':>6}")
    for info, st, rp in zip(loaded.ranks, loaded.stats, plan.ranks):
        print(f"{info.rank:>4} {info.node_id[:10]:>10} {info.pid:>7} {info.device:>7} {len(rp.tensors):>7} "
              f"{st.bytes_needed:>11} {st.bytes_read:>11} {st.requests:>8} {st.seconds:>7.3f} {st.gbps:>6.2f}")
    print(loaded.summary())

    prefix = f"model.layers.{args.layer}."
    names = [prefix + n for n in (O_PROJ, GATE, UP, DOWN)]
    full = {k: v.float() for k, v in full_tensors(plan, names).items()}
    pieces = {rp.rank: {t.name: [tuple(p) for p in t.pieces] for t in rp.tensors if t.name in names}
              for rp in plan.ranks}
    hidden = full[prefix + O_PROJ].shape[0]
    gen = torch.Generator().manual_seed(args.seed)
    width = full[prefix + O_PROJ].shape[1]
    x_attn = torch.randn(args.batch, width, generator=gen) / width ** 0.5
    x_mlp = torch.randn(args.batch, hidden, generator=gen) / hidden ** 0.5

    partials = ray.get(loaded.run(rank_partials, x_attn, x_mlp, prefix, pieces))
    results = {
        "o_proj": (sum(p["o_proj"] for p in partials), x_attn @ full[prefix + O_PROJ].T),
        "mlp": (sum(p["mlp"] for p in partials),
                (torch.nn.functional.silu(x_mlp @ full[prefix + GATE].T) * (x_mlp @ full[prefix + UP].T))
                @ full[prefix + DOWN].T),
    }
    ok = True
    for what, (got, ref) in results.items():
        err = (got - ref).abs().max().item()
        scale = ref.abs().max().item()
        good = torch.allclose(got, ref, rtol=args.rtol, atol=args.atol * scale)
        ok &= good
        print(f"layer {args.layer} {what}: sum over {loaded.tp} ranks vs full weights: max abs error {err:.3g} "
              f"(largest |value| {scale:.3g}) {'OK' if good else 'MISMATCH'}")
    print("check passed" if ok else "check FAILED: the ranks' partial results do not add up to the full-weight result")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
