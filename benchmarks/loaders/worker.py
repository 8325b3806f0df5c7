"""One rank of a process-based loader (naive, lazy, fastsafetensors, runai, raw) in its own process.

    python -m benchmarks.loaders.worker LOADER PLAN_JSON RANK MODEL_DIR MSG_FD

Imports everything first, then says {"ready": pid} on MSG_FD and obeys one command
per stdin line: "run" loads the rank's shards (measured, see impls.measured) and
reports the numbers, keeping the shards (private memory is counted from the anonymous
RSS the process had when ready, after its imports); "verify" reports their checksums; "free"
drops them; "exit" ends. Each answer is one JSON line on MSG_FD (stdout and stderr
stay free for the libraries' own output).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback


def main(argv: list[str]) -> int:
    loader, plan_path, rank, model_dir, msg_fd = argv[0], argv[1], int(argv[2]), argv[3], int(argv[4])
    msg = os.fdopen(msg_fd, "w", buffering=1)

    def say(obj) -> None:
        msg.write(json.dumps(obj) + "\n")

    try:
        from raylazy.core.plans import Plan

        from . import impls
        from .checkpoint import checkpoint_files
        from .diskstats import Device

        impls.preload(loader)
        import torch

        torch.set_num_threads(1)  # narrow/clone copies: one intra-op thread per rank, ranks are the parallelism
        with open(plan_path) as fh:
            rank_plan = Plan.from_json(fh.read()).ranks[rank]
        files = checkpoint_files(model_dir)
        disk = Device(files)
        fn = impls.LOADERS[loader]
    except BaseException as e:  # noqa: BLE001
        say({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return 1
    base = impls.proc_status()
    say({"ready": os.getpid(), "anon": base.get("RssAnon", 0)})
    shards: dict = {}
    for line in sys.stdin:
        cmd = line.strip()
        try:
            if cmd == "run":
                shards = {}
                gc.collect()
                shards, m = impls.measured(lambda: fn(torch, rank_plan, files), disk if disk.name else None)
                m.update(rank=rank, shard_bytes=impls.shard_bytes(shards), tensors=len(shards),
                         anon_base=base.get("RssAnon", 0))
                say(m)
            elif cmd == "verify":
                say({"checksums": impls.checksums(shards)})
            elif cmd == "free":
                shards = {}
                gc.collect()
                impls.malloc_trim()  # give freed heap back, so the next run starts from the same RSS
                say({"freed": True})
            elif cmd == "exit":
                break
            else:
                say({"error": f"unknown command {cmd!r}"})
        except BaseException as e:  # noqa: BLE001  (reported to the driver, which stops the benchmark)
            say({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
