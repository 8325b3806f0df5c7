"""The vLLM worker's log line of what serving its lazy weights took (`raylazy.io.stats.ServingStats`): `summary`
writes it, `fields` reads its numbers back (what the tests and benchmarks read it with; the numbers: docs/vllm.md)."""

from __future__ import annotations

import re
from dataclasses import asdict

from ..core.plans import format_bytes
from .stats import ServingStats

#: How every worker's line begins.
PREFIX = "raylazy: rank "
_FIELD, _DECIMAL = re.compile(r"(\w+)=(\S+)"), re.compile(r"\d+\.\d+")


def summary(rank: int, s: ServingStats, checkpoint_bytes: int, params: int, mode: str, why: str, rchar: int | None,
            seconds: float) -> str:
    """A worker's log line: words, then the numbers as key=value in brackets (`fields` reads them)."""
    node = f" with {s.node_processes - 1} other worker(s) of its node" if s.node_processes > 1 else ""
    numbers = {"rank": rank, **asdict(s), "storage": s.storage or "-", "mode": mode, "param_bytes": params,
               "checkpoint_bytes": checkpoint_bytes, "rchar": "-" if rchar is None else rchar,
               "read_seconds": f"{s.read_seconds:.3f}", "seconds": f"{seconds:.3f}"}
    return (
        f"{PREFIX}{rank} needed {format_bytes(s.bytes_needed)} (its parameters {format_bytes(params)}; the "
        f"checkpoint holds {format_bytes(checkpoint_bytes)}), read {format_bytes(s.planned_bytes_read)} as planned"
        f"{node} with {s.backend} in {s.batches} batch(es) ({format_bytes(s.in_place_bytes)} in place), "
        f"{s.read_seconds:.2f} s reading, {seconds:.2f} s in all, {mode}{f' ({why})' if why else ''}; "
        f"{s.opaque_regions} region(s) ({format_bytes(s.opaque_bytes)}) read at once for ops raylazy cannot "
        f"follow; {s.unplanned_regions} region(s) taken only on the second run "
        f"[{' '.join(f'{k}={v}' for k, v in numbers.items())}]")


def fields(line: str) -> dict | None:
    """The numbers of a worker's log line (`summary`), found anywhere in `line` (a log prefix before it is
    fine): ints, seconds as floats, words as they are, `rchar` None where not measured. None for another line."""
    at = line.find(PREFIX)
    if at < 0 or "[" not in line[at:]:
        return None
    return {k: int(v) if v.isdigit() else float(v) if _DECIMAL.fullmatch(v) else None if v == "-" else v
            for k, v in _FIELD.findall(line[at:].rsplit("[", 1)[1].rstrip("]"))}
