"""vLLM's in-place reload (`reload_weights`, an RL step) compared in one alternating run: raylazy's format, vLLM's
default loader's reload, and a fresh engine start on the step's checkpoint.

Run with the vLLM virtualenv's python (docs/vllm.md), from the repository root, e.g.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/vllm_reload.py --tp 1 2 --cache cold warm --runs 3

raylazy's modules are compiled to bytecode first (benchmarks/vllm_load.py's `compile_raylazy`). Each repetition, for
each tp and cache state, runs in turn (A B C A B C ...): `raylazy` and `auto` (a fresh process starts an engine with
that format on the checkpoint, the parent's copy "step 0", then makes the cache state of "step 1", a copy of it in
another directory, and reloads from it) and `fresh` (benchmarks/vllm_load.py's engine start, on vLLM's default
loader, to the first token; `--what raylazy auto` leaves it out). Cold: step 1's pages evicted; warm: its files in the
page cache and held there through the reload (benchmarks/loaders/pagecache.py's `held`). Reported: the reload's
seconds (the `collective_rpc` call); from each worker's /proc/self/io during it, the bytes it made the storage read
(read_bytes; the most one worker read, and the workers' sum: the node's) and those its read calls returned (rchar:
not the pages a memory map or the cooperative reader's shared copies take); and what /proc/diskstats saw the
checkpoint's device read meanwhile. The default checkpoint is benchmarks/vllm_load.py's 0.53 GB Llama.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.loaders.checkpoint import checkpoint_files, ensure_checkpoint  # noqa: E402
from benchmarks.loaders.diskstats import Device  # noqa: E402
from benchmarks.vllm_load import (  # noqa: E402
    SHAPES,
    compile_raylazy,
    measure,
    prepare,
    run_engine,
    run_options,
    spread,
    uptime,
)
from raylazy.io.stats import proc_io  # noqa: E402


def worker_io(worker) -> dict:
    """A worker's /proc/self/io (`collective_rpc` passes the worker)."""
    return proc_io()


def one(step0: str, step1: str, fmt: str, tp: int, cache: str) -> dict:
    """In the child: an engine on `step0` with `fmt`, then the reload from `step1` in `cache` state, measured."""
    from vllm import LLM

    llm = LLM(model=step0, load_format=fmt, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=256, max_num_seqs=1)
    device = Device(checkpoint_files(step1))
    with prepare(checkpoint_files(step1), cache):
        disk0, before = device.settled_reads() if device.name else None, llm.collective_rpc(worker_io)
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": step1, "is_checkpoint_format": True})
        seconds = time.perf_counter() - t0
        after = llm.collective_rpc(worker_io)
        disk = device.settled_reads() - disk0 if disk0 else None
    llm.llm_engine.engine_core.shutdown()
    got = {k: [a[k] - b[k] for a, b in zip(after, before)] for k in ("rchar", "read_bytes")}
    return {"reload_s": seconds, "disk_bytes": disk.bytes if disk else None,
            **{f"{w}_{k}": f(v) for k, v in got.items() for w, f in (("worker", max), ("node", sum))}}


#: What each repetition times: the reload with each format, and a fresh engine (the default loader) on the new step.
WHAT = ("raylazy", "auto", "fresh")


def reload_run(step0: str, step1: str, fmt: str, tp: int, cache: str) -> dict:
    done = run_engine([os.path.abspath(__file__), "--one", fmt, "--tp", str(tp), "--cache", cache, "--model", step0,
                       "--step", step1], tp)
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    return result if result is not None else {"error": done.stdout.strip().splitlines()[-1][-200:]}


def table(rows: list[dict]) -> list[str]:
    def med(key, fmt):
        return spread([r.get(key) for r in rows_of], fmt)

    out = ["| what | tp | cache | runs | seconds | worker read MB | node read MB | worker rchar MB | device read MB |",
           "|---|---|---|---|---|---|---|---|---|"]
    s, mb = (lambda v: f"{v:.2f}"), (lambda v: f"{v / 1e6:.0f}")
    for key in dict.fromkeys((r["what"], r["tp"], r["cache"]) for r in rows):
        rows_of = [r for r in rows if (r["what"], r["tp"], r["cache"]) == key and "error" not in r]
        if not rows_of:
            out.append(f"| {' | '.join(map(str, key))} | 0 | fails | | | | |")
            continue
        out.append(f"| {' | '.join(map(str, key))} | {len(rows_of)} | {med('seconds', s)} | "
                   f"{med('worker_read_bytes', mb)} | {med('node_read_bytes', mb)} | {med('worker_rchar', mb)} | "
                   f"{med('disk_bytes', mb)} |")
    return out


def main(argv=None) -> int:
    ap = run_options(__doc__, runs=3)
    ap.add_argument("--work", default="/tmp/raylazy-vllm-reload", help="where the two steps' copies go")
    ap.add_argument("--what", nargs="+", choices=WHAT, default=list(WHAT), help="what is timed, in turn")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--step", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.model, args.step, args.one, args.tp[0], args.cache[0])), flush=True)
        return 0
    compile_raylazy()
    source = args.model or ensure_checkpoint(SHAPES["default"])
    steps = [os.path.join(args.work, f"step-{i}") for i in (0, 1)]
    for step in steps:
        if not os.path.isdir(step):
            shutil.copytree(source, step)
    device = Device(checkpoint_files(steps[1]))
    print(f"checkpoint {source}: {sum(map(os.path.getsize, checkpoint_files(source))) / 1e9:.2f} GB; uptime before: "
          f"{uptime()}", flush=True)
    rows = []
    for rep in range(args.runs):
        for tp in args.tp:
            for cache in args.cache:
                for what in args.what:
                    if what == "fresh":
                        r = measure(steps[1], "auto", tp, cache, SHAPES["default"].dtype, device)
                        r = {"seconds": r.get("ready_s"), "worker_read_bytes": r.get("worker_max"),
                             "node_read_bytes": r.get("read_bytes"),
                             "disk_bytes": r.get("disk_bytes"), **({"error": r["error"]} if "error" in r else {})}
                    else:
                        r = reload_run(steps[0], steps[1], what, tp, cache)
                        r = {"seconds": r.pop("reload_s", None), **r}
                    r = {"run": rep, "what": what, "tp": tp, "cache": cache, **r}
                    print(json.dumps(r), file=sys.stderr, flush=True)
                    rows.append(r)
    print(f"uptime after: {uptime()}")
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
