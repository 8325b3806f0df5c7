"""Benchmark: planning with two source trees side by side, in alternating runs (A B A B ...).

Writes DeepSeek-V3's sparse checkpoint (benchmarks/plan_deepseek.py) twice: as released (FP8 with block scales
and the multi-token-prediction layer, 91,991 tensors) and in bf16 without them (45,395 tensors, the layout
planned before quantized checkpoints were), planned with `make_plan(dir, 8, pp=2, expert_parallel=True)`; and
Llama-3.1-405B's (benchmarks/plan_405b.py, 1,137 tensors), planned with `make_plan(dir, 8)`. Then, round after
round, each (tree, layout) pair runs in a fresh Python process with that source tree first on its path: it plans
the checkpoint once (the process's first call, printed apart), then `--runs` times, and prints the CPU times' min
and median, and at the end each pair's median over all its runs and of its first calls. A tree that cannot plan
a layout says why. On a shared machine the neighbours move every number: compare the pairs of one round, and the
rounds' spread.

    git archive <commit> | tar -x -C /tmp/before     # the code before, as a plain tree
    python benchmarks/plan_alternating.py --before /tmp/before --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # plan_deepseek, run from a checkout

import plan_405b  # noqa: E402
from plan_405b import HERE, fresh_process_times  # noqa: E402
from plan_deepseek import write_checkpoint  # noqa: E402

#: Each layout: how it is written (`write(dir)`) and make_plan's options.
LAYOUTS = {
    "bf16": (lambda d: write_checkpoint(d, layout="bf16"), {"tp": 8, "pp": 2, "expert_parallel": True}),
    "fp8": (lambda d: write_checkpoint(d, layout="fp8"), {"tp": 8, "pp": 2, "expert_parallel": True}),
    "405b": (plan_405b.write_checkpoint, {"tp": 8}),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="source tree of the code to compare with (its raylazy/ inside)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = ap.parse_args(argv)
    every: dict[tuple[str, str], list[float]] = {}
    firsts: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="plan-alternating-") as tmp:
        dirs = {layout: os.path.join(tmp, layout) for layout in args.layouts}
        for layout, d in dirs.items():
            LAYOUTS[layout][0](d)
        print(f"make_plan(dir, 8, ...), CPU seconds over {args.runs} runs; before = {args.before}, after = {HERE}")
        for r in range(args.rounds):
            for layout in args.layouts:
                for label, tree in (("before", args.before), ("after", HERE)):
                    times = fresh_process_times(dirs[layout], LAYOUTS[layout][1], args.runs, tree)
                    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
                    if isinstance(times, str):
                        print(f"round {r}  {label:6s} {layout:4s}  {times}  (load {load})", flush=True)
                        continue
                    first, times = times[0], times[1:]
                    firsts.setdefault((layout, label), []).append(first)
                    every.setdefault((layout, label), []).extend(times)
                    print(f"round {r}  {label:6s} {layout:4s}  first call {first:.3f}  then min {min(times):.3f}  "
                          f"median {statistics.median(times):.3f}  (load {load})", flush=True)
    for (layout, label), times in every.items():
        print(f"all rounds  {label:6s} {layout:4s}  median {statistics.median(times):.3f} of {len(times)} runs, "
              f"min {min(times):.3f}; first calls: median {statistics.median(firsts[layout, label]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
