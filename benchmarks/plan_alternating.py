"""Benchmark: planning DeepSeek-V3 with two source trees side by side, in alternating runs (A B A B ...).

Writes DeepSeek-V3's sparse checkpoint (benchmarks/plan_deepseek.py) twice: as released (FP8 with block scales
and the multi-token-prediction layer, 91,991 tensors) and in bf16 without them (45,395 tensors, the layout
planned before quantized checkpoints were). Then, round after round, each (tree, layout) pair runs in a fresh
Python process with that source tree first on its path: it plans the checkpoint once to warm up, then `--runs`
times (`make_plan(dir, 8, pp=2, expert_parallel=True)`), and prints the CPU times' min and median. A tree that
cannot plan a layout says why. On a shared machine the neighbours move every number: compare the pairs of one
round, and the rounds' spread.

    git archive <commit> | tar -x -C /tmp/before     # the code before, as a plain tree
    python benchmarks/plan_alternating.py --before /tmp/before --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # plan_deepseek, run from a checkout

from plan_deepseek import write_checkpoint  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIME = r"""
import json, sys, time
from raylazy.planning import make_plan
plan = lambda: make_plan(sys.argv[1], 8, pp=2, expert_parallel=True)
plan()
times = []
for _ in range(int(sys.argv[2])):
    t0 = time.process_time(); plan(); times.append(time.process_time() - t0)
print(json.dumps(times))
"""


def time_tree(tree: str, model_dir: str, runs: int) -> list[float] | str:
    """CPU seconds of each planning run of `model_dir` by the raylazy of source tree `tree`, or its error line."""
    res = subprocess.run([sys.executable, "-c", _TIME, model_dir, str(runs)], capture_output=True, text=True,
                         cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": tree})
    if res.returncode:
        return (res.stderr.strip().splitlines() or ["failed"])[-1][:160]
    return json.loads(res.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="source tree of the code to compare with (its raylazy/ inside)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="plan-alternating-") as tmp:
        dirs = {layout: os.path.join(tmp, layout) for layout in ("bf16", "fp8")}
        for layout, d in dirs.items():
            write_checkpoint(d, layout=layout)
        pairs = [("before", args.before, "bf16"), ("after", HERE, "bf16"), ("before", args.before, "fp8"),
                 ("after", HERE, "fp8")]
        print(f"make_plan(dir, 8, pp=2, expert_parallel=True), CPU seconds over {args.runs} runs; "
              f"before = {args.before}, after = {HERE}")
        for r in range(args.rounds):
            for label, tree, layout in pairs:
                times = time_tree(tree, dirs[layout], args.runs)
                load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
                shown = times if isinstance(times, str) else \
                    f"min {min(times):.3f}  median {statistics.median(times):.3f}"
                print(f"round {r}  {label:6s} {layout:4s}  {shown}  (load {load})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
