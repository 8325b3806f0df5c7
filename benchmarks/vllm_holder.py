"""A new vLLM engine's load from a holder in Ray (docs/holders.md) against reading storage, in one alternating run.

Run from the repository root with the dev virtualenv's python (it runs Ray, the emulated mount and SeaweedFS; the
engines run in the vLLM virtualenv's, `--python`), e.g.

    python -m benchmarks.vllm_holder --python ~/.cache/raylazy/vllm-venv-*/bin/python --tp 1 --runs 7

Before the runs: a local Ray of this process's own, and the benchmark's Llama (benchmarks/vllm_load.py's checkpoint,
`--shape`) on the emulated bucket mount (benchmarks/netfs.py's `emulated-bucket`: direct mode, 10 ms a request, 250
MB/s, every read a request) and in SeaweedFS. The holder's fill is timed against the storage's limit first, `--fills`
alternating pairs, each on a fresh mount: a raw read of the mount (4 threads of 16 MiB preads:
benchmarks/netfs_bench.py's `raw`) and `raylazy.hold` (its fill, as the holder timed it, and `hold` end to end, which
also starts the holder's actor). Then the mount's checkpoint is held, and per repetition each case runs in turn, in
reverse order every other repetition, each engine a fresh process timed as benchmarks/vllm_load.py times one (its
weight-loading step, `load`, from the loader's `load_weights` call; `ready`, from `LLM(...)` to its first token):

- `holder`: raylazy on the mount, taking from the holder (the engine's workers connect to this Ray: RAY_ADDRESS);
- `direct`: raylazy on the same mount, `holder=off`;
- `s3`: raylazy from SeaweedFS;
- `local-cold`, `local-warm`: raylazy on the local files, evicted or held in the page cache;
- `default-warm`: vLLM's default loader on the local files in the page cache.

It prints the medians (and ranges), each case against `holder` repetition by repetition (benchmarks/vllm_load.py's
`paired`; `loader` is the loader's construction to the end of its step, where nothing a format does is left out), and
the safetensors bytes the mount served for the holder's fill and for each engine on it. Every engine's numbers go to
stderr as JSON."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.netfs import PROFILES
from benchmarks.netfs_bench import run_once
from benchmarks.vllm_load import SHAPES, checkpoints, compile_raylazy, measure, paired, table, uptime

#: The cases, in their order (the first is the one the others are set against).
CASES = ("holder", "direct", "s3", "local-cold", "local-warm", "default-warm")
#: The mount: an uncached bucket's (every read a request to the storage).
PROFILE = "emulated-bucket"


def fills(model: str, pairs: int) -> list[str]:
    """The holder's fill against a raw read of the same storage, `pairs` alternating pairs on fresh mounts."""
    import raylazy

    raw, fill, hold_s = [], [], []
    for rep in range(pairs):
        for what in ("raw", "hold")[:: 1 if rep % 2 == 0 else -1]:
            if what == "raw":
                raw.append(run_once(model, "direct", "raw", 1)["seconds"])
                continue
            with PROFILES[PROFILE].mount(model) as fs:
                t = time.perf_counter()
                held = raylazy.hold(fs.mountpoint)
                hold_s.append(time.perf_counter() - t)
                fill.append(held.infos()[0].seconds)
                held.release()
    ratio = [f / r for f, r in zip(fill, raw)]
    return [f"fill: raw read of the mount {statistics.median(raw):.2f} s ({min(raw):.2f}-{max(raw):.2f}), the "
            f"holder's fill {statistics.median(fill):.2f} s ({min(fill):.2f}-{max(fill):.2f}) = "
            f"{statistics.median(ratio):.2f}x the raw read by the median of {pairs} pairs "
            f"({min(ratio):.2f}-{max(ratio):.2f}); hold() end to end {statistics.median(hold_s):.2f} s "
            f"({min(hold_s):.2f}-{max(hold_s):.2f}), its actor started"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the vLLM virtualenv's python (docs/vllm.md)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--runs", type=int, default=7, help="repetitions (each runs every case once)")
    ap.add_argument("--fills", type=int, default=3, help="alternating pairs of the fill against a raw read")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--shape", choices=SHAPES, default="default")
    args = ap.parse_args(argv)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback: the engines' workers join this Ray
    import ray

    import raylazy
    from benchmarks.s3server import S3Server

    compile_raylazy()
    [(model, dtype)] = checkpoints(None, ["bfloat16"], args.shape)
    size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
    print(f"checkpoint {model}: {size / 1e9:.2f} GB; "
          f"mount {PROFILE}: {PROFILES[PROFILE].note}; uptime before: {uptime()}", flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    s3 = S3Server()
    try:
        print("\n".join(fills(model, args.fills)), flush=True)
        uri = s3.upload_dir(model, "bench", "llama")
        with PROFILES[PROFILE].mount(model) as fs:
            raylazy.hold(fs.mountpoint)
            filled = fs.served()
            local = [os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors")]
            ray_env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
            setup = {  # case -> (model, format, cache, the files the cache state is made of, env)
                "holder": (fs.mountpoint, "raylazy", "cold", [], ray_env),
                "direct": (fs.mountpoint, "raylazy:holder=off", "cold", [], {}),
                "s3": (uri, "raylazy:holder=off", "cold", [], s3.environment()),
                "local-cold": (model, "raylazy:holder=off", "cold", local, {}),
                "local-warm": (model, "raylazy:holder=off", "warm", local, {}),
                "default-warm": (model, "auto", "warm", local, {}),
            }
            rows = []
            for rep in range(args.runs):
                for tp in args.tp:
                    for case in args.cases[:: 1 if rep % 2 == 0 else -1]:
                        where, spec, cache, files, env = setup[case]
                        before = fs.served()
                        r = measure(where, spec, tp, cache, dtype, None, files, env, args.python)
                        r = {"run": rep, **r, "format": case, "cache": "-", "mount_bytes": fs.served() - before}
                        print(json.dumps(r), file=sys.stderr, flush=True)
                        rows.append(r)
    finally:
        s3.close()
        ray.shutdown()
    print(f"uptime after: {uptime()}")
    print("\n".join(table(rows) + [""] + paired(rows, args.cases[0])))
    print(f"\nthe mount served {filled / 1e9:.3f} GB of safetensors files for the holder's fill (the checkpoint's "
          f"files: {size / 1e9:.3f} GB), then per engine:")
    for case in ("holder", "direct"):
        got = [r["mount_bytes"] for r in rows if r["format"] == case and "error" not in r]
        if got:
            print(f"  {case}: {statistics.median(got) / 1e3:.1f} kB ({min(got) / 1e3:.1f}-{max(got) / 1e3:.1f}), "
                  f"{len(got)} engines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
