"""vLLM load formats compared in one alternating run: engine ready time, the weight-loading step, bytes per node.

Run with the vLLM virtualenv's python (docs/vllm.md), from the repository root, e.g.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/vllm_load.py --tp 1 2 --cache cold warm --runs 5 \
        --formats raylazy auto runai_streamer raylazy:ranged --dtype bfloat16 bfloat16:float32 float32:bfloat16

Before the runs, raylazy's modules are compiled to bytecode, as pip installs them. Runs alternate: for each repetition,
for each tp and cache state, every format in turn, in reverse order every other repetition (A B C C B A A B C ...), so
drift on a shared machine spreads over all formats alike and none always runs first. Each run is a fresh process
(`--one`). Before it, the parent makes the cache state (cold: the checkpoint's pages evicted with posix_fadvise
DONTNEED; warm: the files in the page cache and held there until the run ends, mapped and locked:
benchmarks/loaders/pagecache.py's `held`; without it, a proactive reclaim such as the DAMON pageout some virtual
machines run takes pages the ~20 s engine start leaves idle, and the step's faults read them back, some runs far more
than others) and reads the device's counters (/proc/diskstats). The child imports vLLM, then times `LLM(...)` up to its
first generated token ("ready": engine, workers, weights, KV cache, one greedy token), and sums the `read_bytes` of
itself and its descendants, the vLLM workers (/proc/PID/io). Every worker's weight-loading step (its loader's
`load_weights`, whatever the format) is timed alike: the child and the workers vLLM spawns (which import this file
again) wrap it (`time_load_steps`). "load" is the slowest worker's step; "node load" the engine's, from the first
worker's start of it to the last one's end. They differ where the workers start apart: a raylazy worker waits at its
node's agreement for the others, so its own step holds the skew, which the other loaders' steps do not (vLLM's own
"Loading weights took" line is its first worker's alone). "device read" and "mean request" are what /proc/diskstats saw
the checkpoint's device read meanwhile (the node's reads from storage; other processes on the machine included, so a
quiet machine is assumed) and its mean request size; "refaulted" the file pages the kernel read again after evicting
them during the run (/proc/vmstat: memory pressure, or proactive reclaim such as DAMON's pageout, which some virtual
machines run), where device reads past the checkpoint's size come from. A format `raylazy:KEY=VALUE,...` passes those
options in model_loader_extra_config, another format's (`auto:safetensors_load_strategy=prefetch`) go to `LLM(...)`
itself. `--dtype CHECKPOINT[:SERVED]` names the checkpoint's dtype and the dtype vLLM serves it in (the same by
default; `bfloat16:float32` converts every weight while loading); several are alternated like the formats. The table
gives medians (and the range) over the repetitions, then each format's node load step, and its engine ready time
split at the step, against the first format's, repetition by repetition (the median of the differences: the
machine's slower spells span several runs, and a difference of medians moves with them); every run's numbers go to
stderr as JSON, with how each raylazy worker loaded ("modes": at-once, replay or rerun). The default checkpoint is
the benchmark's Llama (benchmarks/loaders/checkpoint.py, 3 layers, head_dim 64: 0.53 GB in bf16, 1.07 GB in float32),
built on first use; `--shape small` a smaller one of more, smaller tensors (9 layers of hidden 1024, one 0.41 GB
file), where the fixed cost of raylazy's step (its recording pass, the node's agreement) weighs most.
`--before CHECKOUT` (a git worktree of an earlier commit, say) also runs each raylazy format with that checkout's
raylazy, as `FORMAT@before`, in the same alternation, and the paired lines compare the two. """

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.loaders.checkpoint import ModelSpec, checkpoint_files, ensure_checkpoint  # noqa: E402
from benchmarks.loaders.diskstats import Device, refaulted_bytes  # noqa: E402
from benchmarks.loaders.pagecache import evict, held  # noqa: E402
from raylazy.io.report import fields  # noqa: E402
from raylazy.io.stats import proc_io  # noqa: E402

FORMATS = ("raylazy", "auto", "runai_streamer")
#: The benchmark checkpoints (`--shape`), Llama-shaped: "default" 3 layers of hidden 2048 (0.53 GB in bf16, in 2
#: files); "small" 9 layers of hidden 1024 in one file (0.41 GB), where raylazy's fixed cost per load weighs most;
#: "large" the default's layers as many as make 2 GB.
SHAPES = {"default": ModelSpec(layers=3),
          "small": ModelSpec(hidden=1024, intermediate=4096, heads=16, kv_heads=8, layers=9, shard_size="1GB"),
          "large": ModelSpec()}


def load_format(spec: str) -> tuple[str, dict]:
    """`raylazy:backend=ranged,threads=8` -> ("raylazy", {"backend": "ranged", "threads": 8})."""
    name, _, opts = spec.partition(":")
    extra = {}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        extra[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    return name, extra


def one(model: str, spec: str, tp: int, dtype: str) -> dict:
    """In the child: time LLM(...) to the first token, and the bytes this process and the workers read."""
    import psutil
    from vllm import LLM, SamplingParams

    fmt, extra = load_format(spec)
    before = proc_io()["read_bytes"]
    t0, start = time.perf_counter(), time.time()
    # raylazy's options are its loader's extra config; another format's are LLM's own (its load config's, e.g.
    # auto:safetensors_load_strategy=prefetch)
    options = {"model_loader_extra_config": extra} if fmt.startswith("raylazy") else extra
    llm = LLM(model=model, load_format=fmt, tensor_parallel_size=tp, dtype=dtype, enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=256, max_num_seqs=1, **options)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    ready, end = time.perf_counter() - t0, time.time()
    workers = [proc_io(p.pid)["read_bytes"] for p in psutil.Process().children(recursive=True)]
    own = proc_io()["read_bytes"] - before
    llm.llm_engine.engine_core.shutdown()
    # tp=1: the worker is this process; tp > 1: the workers are its children
    return {"ready_s": ready, "start": start, "end": end, "read_bytes": own + sum(workers),
            "worker_max": max(workers) if tp > 1 else own}


#: Set in a child's environment: it, and the vLLM workers it spawns, time their load steps.
STEPS = "RAYLAZY_BENCH_LOAD_STEPS"


def time_load_steps() -> None:
    """Wrap every vLLM model loader's `load_weights` for one load: a line `LOADSTEP start end` (wall clock) each, and
    a line `LOADER made end`: from the start of the loader's construction (whatever a format does there, such as
    importing its modules) to the end of the step."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    load_model, made = BaseModelLoader.load_model, BaseModelLoader.__init__

    def stamped(self, *args, **kwargs):
        self.made_at = time.time()
        made(self, *args, **kwargs)

    BaseModelLoader.__init__ = stamped

    def timed(self, *args, **kwargs):
        inner = self.load_weights

        def load_weights(*a, **k):
            start = time.time()
            try:
                return inner(*a, **k)
            finally:  # one write, on a line of its own: the workers share the child's stdout
                sys.stdout.flush()
                end = time.time()
                os.write(sys.stdout.fileno(), f"\nLOADSTEP {start:.6f} {end:.6f}\nLOADER {self.made_at:.6f} {end:.6f}\n"
                         .encode())

        self.load_weights = load_weights
        try:
            return load_model(self, *args, **kwargs)
        finally:
            del self.load_weights

    BaseModelLoader.load_model = timed


if os.environ.get(STEPS):  # a child, and each vLLM worker it spawns (they import this file again)
    time_load_steps()


@contextlib.contextmanager
def prepare(files: list[str], cache: str):
    """Make the cache state for the block: cold (the files' pages evicted) or warm (the files in the page cache, held
    there until the block ends: `held`)."""
    if cache == "cold":
        if left := evict(files):
            print(f"warning: {left} bytes of the checkpoint stayed in the page cache", file=sys.stderr)
        yield
    else:
        with held(files):
            yield


def measure(model: str, spec: str, tp: int, cache: str, dtype: str, device: Device | None,
            files: list[str] | None = None, env: dict[str, str] | None = None, python: str = sys.executable,
            before: str | None = None) -> dict:
    """One engine's run (`--one`, run by `python` with `env` added) with the cache state `cache` made of `files`
    (default: the checkpoint's), and what `device` (None: none) read meanwhile. A format `SPEC@before` runs `SPEC`
    with the checkout `before` (its own copy of this file, which puts its raylazy first on the path)."""
    files = checkpoint_files(model) if files is None else files
    name, at, _ = spec.partition("@")
    script = os.path.join(before, "benchmarks", "vllm_load.py") if at else os.path.abspath(__file__)
    with prepare(files, cache):
        disk0 = device.settled_reads() if device and device.name else None
        refaulted0 = refaulted_bytes()
        done = run_engine([script, "--one", name, "--tp", str(tp), "--model", model, "--served", dtype], tp,
                          {STEPS: "1", **(env or {})}, python)
        disk = device.settled_reads() - disk0 if disk0 else None
        refaulted = refaulted_bytes() - refaulted0
    row = {"format": spec, "tp": tp, "cache": cache, "dtype": dtype_case(model, dtype) if os.path.isdir(model) else dtype}
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode or result is None:
        error = [line for line in done.stdout.splitlines() if "Error" in line] or done.stdout.splitlines()
        return {**row, "error": (error[-1] if error else "")[-200:]}
    steps = [tuple(map(float, m)) for m in re.findall(r"^LOADSTEP ([\d.]+) ([\d.]+)$", done.stdout, re.M)]
    loaders = [tuple(map(float, m)) for m in re.findall(r"^LOADER ([\d.]+) ([\d.]+)$", done.stdout, re.M)]
    modes = [f["mode"] for f in map(fields, done.stdout.splitlines()) if f]  # how each raylazy worker loaded
    start, end = result.pop("start"), result.pop("end")
    spans = dict.fromkeys(("node_load_s", "before_load_s", "after_load_s"))
    if steps:  # the engine's step, from the first worker's start of it to the last one's end, and ready around it
        first, last = min(a for a, _ in steps), max(b for _, b in steps)
        spans = {"node_load_s": last - first, "before_load_s": first - start, "after_load_s": end - last}
    return {**row, **result, **({"modes": modes} if modes else {}),
            "load_s": max((b - a for a, b in steps), default=None),
            "loader_s": max((b - a for a, b in loaders), default=None), **spans,
            "disk_bytes": disk.bytes if disk else None, "mean_request": disk.mean_request if disk else None,
            "refaulted_bytes": refaulted}


def run_engine(args: list[str], tp: int, env: dict[str, str] | None = None,
               python: str = sys.executable) -> subprocess.CompletedProcess:
    """`python` run on `args` with `env` added, as the vLLM benchmarks run an engine: in the process that makes
    it, 1 GiB of KV cache and each of its `tp` workers bound to a core of its own, unless the environment says
    otherwise; with a temporary directory of its own (TMPDIR), removed after: vLLM leaves its engines' ZeroMQ
    sockets and its workers' file stores there."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {}))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    with tempfile.TemporaryDirectory(prefix="raylazy-vllm-") as tmp:
        env["TMPDIR"] = tmp
        return subprocess.run([python, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def spread(values, fmt=lambda v: f"{v:.3f}") -> str:
    """"median (min-max)" of the values that are not None, each written by `fmt`; "-" where there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def uptime() -> str:
    """The machine's load averages, as `uptime` prints them (the benchmarks print them before and after)."""
    return os.popen("uptime").read().strip()


def table(rows: list[dict]) -> list[str]:
    """Markdown rows: medians (min-max) per format, tp and cache state."""
    out = ["| format | tp | cache | dtype | runs | ready s | load s | loader s | node load s | device read MB "
           "| refaulted MB | mean request kB | processes read MB | worker max MB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["tp"], r["cache"], r["dtype"], r["format"]) for r in rows))
    for key in keys:
        tp, cache, dtype, spec = key
        ok = [r for r in rows if (r["tp"], r["cache"], r["dtype"], r["format"]) == key and "error" not in r]
        failed = [r for r in rows if (r["tp"], r["cache"], r["dtype"], r["format"]) == key and "error" in r]
        if not ok:
            out.append(f"| {spec} | {tp} | {cache} | {dtype} | 0 | fails: `{failed[0]['error']}` | | | | | | | | |")
            continue
        s, mb, kb = (lambda v: f"{v:.2f}"), (lambda v: f"{v / 1e6:.0f}"), (lambda v: f"{v / 1e3:.0f}")
        out.append(f"| {spec} | {tp} | {cache} | {dtype} | {len(ok)} | {spread([r['ready_s'] for r in ok], s)} | "
                   f"{spread([r['load_s'] for r in ok], s)} | {spread([r.get('loader_s') for r in ok], s)} | "
                   f"{spread([r['node_load_s'] for r in ok], s)} | "
                   f"{spread([r['disk_bytes'] for r in ok], mb)} | {spread([r['refaulted_bytes'] for r in ok], mb)} | "
                   f"{spread([r['mean_request'] for r in ok], kb)} | {spread([r['read_bytes'] for r in ok], mb)} | "
                   f"{spread([r['worker_max'] for r in ok], mb)} |")
    return out


#: What `paired` sets side by side: the node's load step, and engine ready with its parts before and after the step
#: (from `LLM(...)` to the first worker's start of it; from the last worker's end of it to the first token).
PAIRED = {"node_load_s": "node load step", "loader_s": "loader made to the step's end", "ready_s": "ready", "before_load_s": "ready, before the step",
          "after_load_s": "ready, after the step"}


def paired(rows: list[dict], first: str) -> list[str]:
    """Each other format against format `first`, repetition by repetition (the same tp, cache state and dtype, run
    moments apart), in each of `PAIRED`: the median of the differences, in how many repetitions `first` took longer,
    and how often a count as far from an even split comes by chance where neither is faster (`sign_p`). Less swayed
    than a difference of medians by the machine's slower spells, which span several runs."""
    cases: dict[tuple, dict[int, dict[str, dict]]] = {}  # (tp, cache, dtype) -> repetition -> format -> row
    for r in rows:
        cases.setdefault((r["tp"], r["cache"], r["dtype"]), {}).setdefault(r["run"], {})[r["format"]] = r
    out = []
    for key, what in PAIRED.items():
        for (tp, cache, dtype), reps in cases.items():
            for spec in dict.fromkeys(f for by in reps.values() for f in by if f != first):
                diffs = [by[first][key] - by[spec][key] for by in reps.values()
                         if by.get(first, {}).get(key) is not None and by.get(spec, {}).get(key) is not None]
                if diffs:
                    out.append(f"{first} - {spec}, tp={tp} {cache} {dtype}: {what} "
                               f"{statistics.median(diffs):+.3f} s by the median of {len(diffs)} paired repetitions, "
                               f"{first} longer in {sum(d > 0 for d in diffs)} of them (sign test p = "
                               f"{sign_p(diffs):.2f})")
    return out


def sign_p(diffs: list[float]) -> float:
    """The two-sided exact sign test of paired differences (ties left out): the chance of a split of signs at
    least as uneven as this one if each sign were a coin toss. 5 of 7 gives 0.45, 7 of 7 0.016."""
    n = sum(d != 0 for d in diffs)
    k = min(sum(d > 0 for d in diffs), sum(d < 0 for d in diffs))
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0


def compile_raylazy(*checkouts: str) -> None:
    """raylazy's modules (and those of the `checkouts` given) compiled to bytecode, as pip installs them: without it
    (an editable install where PYTHONDONTWRITEBYTECODE is set, as on the machine of docs/benchmarks.md) every vLLM
    process compiles them again, 0.2-0.3 s."""
    for package in [os.path.dirname(importlib.util.find_spec("raylazy").origin),
                    *(os.path.join(c, "raylazy") for c in checkouts)]:
        compileall.compile_dir(package, quiet=1)


def _commit(checkout: str) -> str:
    done = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def run_options(doc: str, runs: int) -> argparse.ArgumentParser:
    """The options of the vLLM benchmarks' alternating runs: --model, --tp, --cache, --runs."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint directory (default: the benchmark's Llama, built on first use)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cache", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    ap.add_argument("--runs", type=int, default=runs, help="repetitions (each runs every format once)")
    return ap


def dtype_case(model: str, served: str) -> str:
    """"bfloat16" (served in the checkpoint's dtype) or "bfloat16->float32" (converted while loading)."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    stored = config.get("torch_dtype") or config.get("dtype") or "?"
    return stored if stored == served else f"{stored}->{served}"


def checkpoints(model: str | None, cases: list[str], shape: str = "default") -> list[tuple[str, str]]:
    """(checkpoint directory, dtype served) for each `CHECKPOINT[:SERVED]` case, of the benchmark's checkpoint of
    `shape`; `--model` serves its own."""
    out = []
    for case in cases:
        stored, _, served = case.partition(":")
        out.append((model or ensure_checkpoint(replace(SHAPES[shape], dtype=stored)), served or stored))
    return out


def format_options(ap: argparse.ArgumentParser, formats: list[str]) -> argparse.ArgumentParser:
    """The options of the benchmarks that alternate load formats: --formats, --dtype, --shape (and --served: the
    dtype a child serves)."""
    ap.add_argument("--formats", nargs="+", default=formats, help="load formats; raylazy:KEY=VALUE,... for options")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], metavar="CHECKPOINT[:SERVED]",
                    help="the checkpoint's dtype and the one served (bfloat16:float32 converts while loading)")
    ap.add_argument("--shape", choices=SHAPES, default="default",
                    help="the benchmark checkpoint's shape (ignored with --model): " + ", ".join(SHAPES))
    ap.add_argument("--served", default="bfloat16", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = format_options(run_options(__doc__, runs=5), list(FORMATS))
    ap.add_argument("--one", metavar="FORMAT", help=argparse.SUPPRESS)
    ap.add_argument("--before", metavar="CHECKOUT",
                    help="another checkout of raylazy (e.g. a git worktree of an earlier commit): each raylazy format "
                         "also runs with it, as FORMAT@before, paired with this checkout's")
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.model, args.one, args.tp[0], args.served)), flush=True)
        return 0
    if args.before:
        args.before = os.path.abspath(args.before)
        args.formats += [f"{f}@before" for f in args.formats if f.startswith("raylazy")]
        print(f"before: {args.before} at {_commit(args.before)}; this checkout at {_commit('.')}", flush=True)
    compile_raylazy(*([args.before] if args.before else []))
    cases = checkpoints(args.model, args.dtype, args.shape)
    files = [f for model, _ in dict.fromkeys(cases) for f in checkpoint_files(model)]
    device = Device(files)
    for model, served in cases:
        print(f"checkpoint {model}: {sum(os.path.getsize(f) for f in checkpoint_files(model)) / 1e9:.2f} GB, "
              f"served as {served}", flush=True)
    print(f"device {device.name or device.missing}; uptime before: {uptime()}", flush=True)
    rows = []
    for rep in range(args.runs):
        for tp in args.tp:
            for cache in args.cache:
                for model, served in cases:
                    for spec in args.formats[:: 1 if rep % 2 == 0 else -1]:
                        r = measure(model, spec, tp, cache, served, device, before=args.before)
                        r = {"run": rep, **r}
                        print(json.dumps(r), file=sys.stderr, flush=True)
                        rows.append(r)
    print(f"uptime after: {uptime()}")
    print("\n".join(table(rows) + [""] + paired(rows, args.formats[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
