"""raylazy against the Run:ai model streamer's S3 mode on one local S3-compatible server (moto behind the counting
proxy of benchmarks/s3server.py): per rank, seconds, bytes fetched and requests.

    python -m benchmarks.s3                                   # ~0.34 GB Llama-shaped checkpoint, tp 1, 2, 4
    python -m benchmarks.s3 --size-gb 0.3 --tp 1 2 4 --out bench-s3
    python -m benchmarks.s3 --tp 1 --first-byte-ms 30 --connection-mbps 5   # a store slow per connection

Each rank runs in a fresh process, one rank at a time, so the proxy's counts are that rank's alone; its time is
the load call only (not starting Python or importing torch). Loaders: `raylazy` (`read_rank` of its plan,
default object-storage max_gap: 1 MiB), `runai` (`SafetensorsStreamer` over the s3:// files, then each tensor
cut to the rank's shard) and, only when asked (`--loaders`), `raylazy-gap0` (max_gap=0: exactly the needed
bytes, at one request per row: ~12,000 per rank at tp=2 here, minutes against moto, which copies the object to
serve each range). Every rank's shards
must be bit-identical across loaders (sha1 per shard), else the run fails. Planning (the driver's header
reads) is counted on its own line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

from .loaders.checkpoint import ModelSpec, checkpoint_files, ensure_checkpoint

LOADERS = ("raylazy", "raylazy-gap0", "runai")
DEFAULT_LOADERS = ("raylazy", "runai")
BUCKET = "bench"


def _worker(loader: str, plan_path: str, rank: int, options: dict) -> dict:
    import torch

    from raylazy.core.plans import Plan

    from .loaders import impls

    with open(plan_path) as f:
        plan = Plan.from_json(f.read())
    rp = plan.ranks[rank]
    t0 = time.perf_counter()
    if loader == "runai":
        shards = impls.load_runai(torch, rp, [f.uri for f in plan.files])
    else:
        from raylazy.core.options import ReaderOptions
        from raylazy.io.ranged import read_rank_ranged

        shards, _ = read_rank_ranged(rp, "cpu", options=ReaderOptions(storage_options=options))
    seconds = time.perf_counter() - t0
    sums = impls.checksums(shards)
    return {"seconds": seconds, "digest": hashlib.sha1(json.dumps(sums, sort_keys=True).encode()).hexdigest()}


def _env(server) -> dict:
    """The standard environment for both clients (Run:ai's reads only this; raylazy gets storage_options too)."""
    return dict(os.environ, AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1", AWS_ALLOW_HTTP="true",
                AWS_EC2_METADATA_DISABLED="true", RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
                RUNAI_STREAMER_S3_TIMEOUT="600")  # its default timed requests out against this slow local server


def run(model_dir: str, tps: list[int], out: str, loaders=DEFAULT_LOADERS, first_byte_s: float = 0.0,
        connection_bps: float = 0.0, log=print) -> list[dict]:
    from raylazy.planning import make_plan

    from .s3server import S3Server

    server = S3Server()
    server.first_byte_s, server.connection_bps = first_byte_s, connection_bps
    rows = []
    try:
        uri = server.upload_dir(model_dir, BUCKET, "model")
        options = dict(endpoint=server.endpoint, allow_http="true", **server.credentials)
        env = _env(server)
        for tp in tps:
            digests: dict[int, set] = {}
            for loader in loaders:
                server.reset()
                plan = make_plan(uri, tp, storage_options=options, max_gap=0 if loader == "raylazy-gap0" else None)
                planned = server.reset()
                if loader != "runai":
                    rows.append(dict(loader=f"{loader} (plan, driver)", tp=tp, rank="-", seconds=None,
                                     needed=0, bytes=planned.get_bytes(), requests=len(planned.requests),
                                     in_flight=planned.most_in_flight))
                path = os.path.join(out, f"plan-{loader}-tp{tp}.json")
                with open(path, "w") as f:
                    f.write(plan.to_json())
                for rank in range(tp):
                    server.reset()
                    proc = subprocess.run([sys.executable, "-m", "benchmarks.s3", "--worker", loader, path, str(rank),
                                           json.dumps(options)], env=env, capture_output=True, text=True, timeout=1800)
                    counts = server.reset()
                    if proc.returncode:
                        raise RuntimeError(f"{loader} tp={tp} rank {rank} failed:\n{proc.stderr[-3000:]}")
                    res = json.loads(proc.stdout.strip().splitlines()[-1])
                    digests.setdefault(rank, set()).add(res["digest"])
                    row = dict(loader=loader, tp=tp, rank=rank, seconds=res["seconds"],
                               needed=plan.ranks[rank].stats.bytes_needed, bytes=counts.get_bytes(),
                               requests=len(counts.requests), in_flight=counts.most_in_flight)
                    rows.append(row)
                    log(f"{loader:>13} tp={tp} rank {rank}: {row['seconds']:.2f} s, {row['bytes'] / 1e6:.1f} MB "
                        f"({row['bytes'] / row['needed']:.2f} x needed) in {row['requests']} requests, "
                        f"at most {row['in_flight']} at once")
            bad = {r: d for r, d in digests.items() if len(d) != 1}
            if bad:
                raise RuntimeError(f"tp={tp}: loaders disagree on the shards of rank(s) {sorted(bad)}")
    finally:
        server.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| loader | tp | rank | seconds | MB needed | MB fetched | x needed | requests | most in flight |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        secs = f"{r['seconds']:.2f}" if r["seconds"] is not None else ""
        ratio = f"{r['bytes'] / r['needed']:.2f}" if r["needed"] else ""
        needed = f"{r['needed'] / 1e6:.1f}" if r["needed"] else ""
        lines.append(f"| {r['loader']} | {r['tp']} | {r['rank']} | {secs} | {needed} | {r['bytes'] / 1e6:.1f} | "
                     f"{ratio} | {r['requests']} | {r['in_flight']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        print(json.dumps(_worker(argv[1], argv[2], int(argv[3]), json.loads(argv[4]))))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", help="a checkpoint directory (default: a generated one)")
    p.add_argument("--size-gb", type=float, default=0.3)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(DEFAULT_LOADERS))
    p.add_argument("--first-byte-ms", type=float, default=0.0, help="the server waits this long before each answer")
    p.add_argument("--connection-mbps", type=float, default=0.0, help="MB/s each response is sent at (0: as fast as it can)")
    p.add_argument("--out", default=None, help="directory for the plans, results.json and results.md")
    args = p.parse_args(argv)
    model_dir = args.model_dir or ensure_checkpoint(ModelSpec(vocab=8000, size_gb=args.size_gb, shard_size="100MB"))
    out = args.out or tempfile.mkdtemp(prefix="raylazy-bench-s3-")
    os.makedirs(out, exist_ok=True)
    size = sum(os.path.getsize(f) for f in checkpoint_files(model_dir))
    print(f"checkpoint {model_dir}: {len(checkpoint_files(model_dir))} files, {size / 1e9:.2f} GB; results in {out}")
    rows = run(model_dir, args.tp, out, args.loaders, args.first_byte_ms / 1e3, args.connection_mbps * 1e6)
    md = table(rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
