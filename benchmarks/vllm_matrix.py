"""What each vLLM worker reads with load_format="raylazy", per architecture of the vLLM matrix, beside its parameters.

Run with this environment's python (its transformers writes the checkpoints), from the repository root:

    python -m benchmarks.vllm_matrix [--archs falcon gpt2 ...] [--backend ranged] [--dtype bfloat16]

Each architecture of the vLLM matrix (benchmarks/harness/vllm_engines.py; default: all but those it leaves out) is written
tiny and random by transformers and served at tp=2 by vLLM's CPU build in its virtualenv (the tests' cached one,
built on first use by `python -m pytest tests/integrations/test_vllm_matrix.py`), one engine after the other in
one process; no checks, no generation beyond the harness's. Per architecture and worker, from raylazy's log line
of the engine's own load (raylazy/io/report.py): its parameters' bytes (in the served dtype: the
checkpoint's by default, so the two compare), the checkpoint bytes it needed, what it read as planned, what it
read at once for ops raylazy cannot follow (of that, planned too), what its read calls returned (rchar: the
backend's reads, headers included) and what it received from the node's other worker (cooperative, exchange).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness.vllm_engines import ARCHS, LEFT_OUT, serve, venv_dir  # noqa: E402


def table(results: dict[str, dict]) -> list[str]:
    """Markdown rows: per architecture and worker, bytes in kB."""
    out = ["| architecture | rank | backend | params kB | needed kB | read as planned kB | read at once kB "
           "| read calls kB | received kB | mode |", "|---|---|---|---|---|---|---|---|---|---|"]
    kb = lambda v: "-" if v is None else f"{v / 1e3:.0f}"  # noqa: E731
    for arch, result in results.items():
        if not result["lines"]:
            error = (result["error"] or {}).get("message", "no log line")
            out.append(f"| {arch} | - | fails: `{error.splitlines()[0][:160]}` | | | | | | | |")
        for s in result["lines"]:
            out.append(f"| {arch} | {s['rank']} | {s['backend']} | {kb(s['param_bytes'])} | {kb(s['bytes_needed'])} | "
                       f"{kb(s['planned_bytes_read'])} | {kb(s['opaque_bytes'])} | {kb(s['rchar'])} | "
                       f"{kb(s['received_bytes'])} | {s['mode']} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", choices=sorted(ARCHS), default=[a for a in ARCHS if a not in LEFT_OUT])
    ap.add_argument("--backend", default="ranged", help="raylazy's backend (model_loader_extra_config)")
    ap.add_argument("--dtype", default="bfloat16", help="the engines' dtype (the checkpoints are bfloat16)")
    args = ap.parse_args(argv)
    python = venv_dir() / "bin" / "python"
    if not python.exists():
        sys.exit(f"no vLLM virtualenv at {python.parent.parent}: run python -m pytest tests/integrations/test_vllm_matrix.py")
    with tempfile.TemporaryDirectory() as root:
        results = serve(str(python), args.archs, Path(root), dtype=args.dtype, extra={"backend": args.backend},
                        checks=False)
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
