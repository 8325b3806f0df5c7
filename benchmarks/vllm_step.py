"""vLLM load formats' weight-loading step compared inside one engine: fresh models loaded in turn by each format.

Run with the vLLM virtualenv's python (docs/vllm.md), from the repository root, e.g.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/vllm_step.py --shape small --tp 2 --cache warm --runs 10 \
        --formats raylazy auto --dtype bfloat16

benchmarks/vllm_load.py times each format's step in an engine of its own, and engines vary from start to start by
more than the few milliseconds left between the formats warm. Here one engine is started per tp, cache state and
dtype (on vLLM's dummy loader: it reads nothing), and then each of its workers, at once, makes a fresh copy of the
served model and loads it with each format in turn, in reverse order every other repetition (A B B A A B ...),
timing its loader's `load_weights` (wall clock; the loader is made before, raylazy's modules imported with the
first; the workers hold what a served engine's hold, vLLM's heap frozen among it). Cold: the checkpoint's pages evicted
before every load; warm: the files held in the page cache through the engine's life (benchmarks/loaders/pagecache.py's
`held`). Reported per format: the slowest worker's step and the node's (the first worker's start to the last one's
end), medians and ranges, then each format against the first, repetition by repetition (benchmarks/vllm_load.py's
`paired`). Every load's numbers go to stderr as JSON. The default checkpoint is benchmarks/vllm_load.py's (`--shape`).

It times a later load in a running engine, not an engine's own first load, and cold the two can disagree
(docs/benchmarks.md, "The step inside one engine"). benchmarks/vllm_load.py times the engine's own load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.loaders.checkpoint import checkpoint_files  # noqa: E402
from benchmarks.loaders.pagecache import evict  # noqa: E402
from benchmarks.vllm_load import (  # noqa: E402
    checkpoints,
    compile_raylazy,
    dtype_case,
    format_options,
    load_format,
    paired,
    prepare,
    run_engine,
    run_options,
    spread,
    uptime,
)


@contextlib.contextmanager
def fresh_copy(cfg, loader):
    """In a worker of a running engine (vLLM config `cfg`): a fresh copy of the served model, made by `loader` on
    the CPU in the served dtype, with vLLM's config set for its load. The copy's attention layers register under
    the served model's names, so the served model's registrations are set aside while the copy is made and put
    back after (the tests' harness loads copies this way too: benchmarks/harness/engines.py)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    layers, cfg.compilation_config.static_forward_context = cfg.compilation_config.static_forward_context, {}
    try:
        with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            yield loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
    finally:
        cfg.compilation_config.static_forward_context = layers


def step(worker, spec: str) -> tuple[float, float]:
    """In each worker: a fresh copy of the served model loaded with the format `spec`; the wall-clock start and end
    of its loader's `load_weights`."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    fmt, extra = load_format(spec)
    options = {"model_loader_extra_config": extra} if fmt.startswith("raylazy") else extra
    loader, cfg = get_model_loader(LoadConfig(load_format=fmt, **options)), worker.vllm_config
    with fresh_copy(cfg, loader) as model:
        start = time.time()
        loader.load_weights(model, cfg.model_config)
        end = time.time()
    del model
    gc.collect()  # the copy freed, cycles included, before the next load makes its own
    return start, end


def engine(model: str, formats: list[str], tp: int, cache: str, served: str, runs: int) -> None:
    """In the child: one engine, then every repetition's loads, a line `ROW` and JSON each."""
    from vllm import LLM

    llm = LLM(model=model, load_format="dummy", tensor_parallel_size=tp, dtype=served, enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=256, max_num_seqs=1)
    files = checkpoint_files(model)
    try:
        for rep in range(runs):
            for spec in formats[:: 1 if rep % 2 == 0 else -1]:
                if cache == "cold":
                    evict(files)
                spans = llm.collective_rpc(step, args=(spec,))
                print("ROW " + json.dumps({"run": rep, "format": spec, "load_s": max(b - a for a, b in spans),
                                           "node_load_s": max(b for _, b in spans) - min(a for a, _ in spans)}),
                      flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()


def table(rows: list[dict]) -> list[str]:
    """Markdown rows: medians (min-max) of the slowest worker's step and the node's, per format and case."""
    out = ["| format | tp | cache | dtype | loads | step s | node step s |", "|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["format"], r["tp"], r["cache"], r["dtype"]) for r in rows):
        of = [r for r in rows if (r["format"], r["tp"], r["cache"], r["dtype"]) == key]
        out.append(f"| {' | '.join(map(str, key))} | {len(of)} | {spread([r['load_s'] for r in of])} | "
                   f"{spread([r['node_load_s'] for r in of])} |")
    return out


def main(argv=None) -> int:
    ap = format_options(run_options(__doc__, runs=10), ["raylazy", "auto"])
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        engine(args.model, args.formats, args.tp[0], args.cache[0], args.served, args.runs)
        return 0
    compile_raylazy()
    print(f"uptime before: {uptime()}", flush=True)
    rows = []
    for tp in args.tp:
        for cache in args.cache:
            for model, served in checkpoints(args.model, args.dtype, args.shape):
                case = {"tp": tp, "cache": cache, "dtype": dtype_case(model, served)}
                with prepare(checkpoint_files(model), cache):
                    done = run_engine([os.path.abspath(__file__), "--engine", "--model", model, "--tp", str(tp),
                                       "--cache", cache, "--served", served, "--runs", str(args.runs),
                                       "--formats", *args.formats], tp, {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
                got = [{**json.loads(line[4:]), **case} for line in done.stdout.splitlines() if line.startswith("ROW ")]
                for r in got:
                    print(json.dumps(r), file=sys.stderr, flush=True)
                if done.returncode or len(got) < args.runs * len(args.formats):
                    print(f"{case}: the engine failed after {len(got)} loads: {done.stdout[-2000:]}", flush=True)
                rows += got
    print(f"uptime after: {uptime()}")
    print("\n".join(table(rows) + [""] + paired(rows, args.formats[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
