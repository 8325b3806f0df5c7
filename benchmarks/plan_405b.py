"""Benchmark: planning a Llama-3.1-405B-shaped checkpoint for tp=8, from headers alone.

Writes the checkpoint as sparse files (real tensor names, shapes and dtype, split
over 191 shards with an index and config.json as Hugging Face ships it): each file
holds a real safetensors header and is then truncated to its full size, so ~812 GB
of "weights" take no disk. Then it times `make_plan(dir, 8)` and header reading
alone, and the node I/O schedule of all ranks on one node (`with_node_schedules`), and counts the bytes planning actually reads from disk (`rchar` of
/proc/self/io), which must be the headers, the index and config.json, nothing more.

    python benchmarks/plan_405b.py                 # full size, tp=8
    python benchmarks/plan_405b.py --layers 4 --files 7 --tp 4

Target: planning, node schedule included, under 1 s on a 2-core machine. Planning is single-threaded, so the
pass mark is the process's CPU time; the wall time is printed next to it with the
load average, since on a shared machine it also measures the other processes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from raylazy.core.schedule import with_node_schedules  # noqa: E402
from raylazy.io.stats import io_delta, proc_io  # noqa: E402
from raylazy.planning import make_plan  # noqa: E402
from raylazy.storage import open_checkpoint  # noqa: E402

#: Llama-3.1-405B (meta-llama/Llama-3.1-405B config.json).
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 126,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
NUM_FILES = 191
BF16 = 2


def tensor_specs(layers: int = CONFIG["num_hidden_layers"]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, in the order transformers saves them."""
    h, i, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    specs = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        specs += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return specs


#: Bytes per element of the dtypes the sparse checkpoints hold.
DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def _nbytes(shape: tuple[int, ...], dtype: str = "BF16") -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def _partition(sizes: list[int], parts: int) -> list[int]:
    """Start index of each of `parts` contiguous, non-empty, roughly equal-byte groups."""
    if not 1 <= parts <= len(sizes):
        raise ValueError(f"cannot spread {len(sizes)} tensors over {parts} files")
    total, starts, cum, k = sum(sizes), [0], 0, 1
    for idx, size in enumerate(sizes):
        while k < parts and (cum >= k * total / parts or len(sizes) - idx <= parts - k) and idx > starts[-1]:
            starts.append(idx)
            k += 1
        cum += size
    while len(starts) < parts:  # only when the tail is too short: give each remaining tensor its own file
        starts.append(starts[-1] + 1)
    return starts


def write_checkpoint(out_dir: str, layers: int = CONFIG["num_hidden_layers"], num_files: int = NUM_FILES) -> dict:
    """Write the sparse checkpoint to `out_dir`; returns sizes for cross-checking the benchmark."""
    return write_sparse_checkpoint(out_dir, tensor_specs(layers), {**CONFIG, "num_hidden_layers": layers}, num_files)


def write_sparse_checkpoint(out_dir: str, specs: list[tuple], config: dict, num_files: int) -> dict:
    """Write tensors `specs` ((name, shape) in bf16, or (name, shape, dtype)) over `num_files` sparse shards (real
    headers, data a hole), the index and `config` as config.json to `out_dir`; returns sizes for cross-checking
    a benchmark."""
    os.makedirs(out_dir, exist_ok=True)
    specs = [(s[0], s[1], s[2] if len(s) > 2 else "BF16") for s in specs]
    sizes = [_nbytes(shape, dtype) for _, shape, dtype in specs]
    starts = _partition(sizes, num_files) + [len(specs)]
    weight_map, header_bytes, data_bytes = {}, 0, 0
    for f in range(num_files):
        fname = f"model-{f + 1:05d}-of-{num_files:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for (name, shape, dtype), size in zip(specs[starts[f] : starts[f + 1]], sizes[starts[f] : starts[f + 1]]):
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            weight_map[name] = fname
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes
        path = os.path.join(out_dir, fname)
        with open(path, "wb") as fh:
            fh.write(struct.pack("<Q", len(blob)) + blob)
        os.truncate(path, 8 + len(blob) + offset)  # a hole: the data takes no disk
        header_bytes += 8 + len(blob)
        data_bytes += offset
    index = {"metadata": {"total_size": data_bytes}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    side = sum(os.path.getsize(os.path.join(out_dir, n)) for n in ("model.safetensors.index.json", "config.json"))
    return {"files": num_files, "tensors": len(specs), "header_bytes": header_bytes, "data_bytes": data_bytes,
            "side_bytes": side}


def mount_table_bytes() -> int:
    """Bytes of this process's mount table, which planning reads once to name the checkpoint's storage kind."""
    with open("/proc/self/mountinfo", "rb") as f:
        return len(f.read())


def measure_read_bytes(fn) -> tuple[object, int]:
    """fn() and the bytes this process read (read/pread syscalls) while running it; -1 where /proc/self/io is
    absent (the readings' own bytes are left out: `raylazy.io.stats.io_delta`)."""
    before = proc_io()
    out = fn()
    return out, -1 if before is None else io_delta(before, proc_io())["rchar"]


def _timed(fn, runs: int) -> tuple[float, list[float], float]:
    """Median wall time, every wall time, and median CPU time of this process (robust to a busy machine). What
    `fn` returns is freed after the clocks stop: freeing a plan is not planning it."""
    times, cpu = [], []
    for _ in range(runs):
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()  # held until the clocks stop: freed by the del below, not by the next call
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        del result
    return statistics.median(times), times, statistics.median(cpu)


#: A fresh process's planning calls, in CPU seconds: its first call, then `runs` more (`fresh_process_times`).
_FRESH = r"""
import json, sys, time
from raylazy.planning import make_plan
times = []
for _ in range(1 + int(sys.argv[2])):
    t0 = time.process_time(); plan = make_plan(sys.argv[1], **json.loads(sys.argv[3])); times.append(time.process_time() - t0)
    del plan
print(json.dumps(times))
"""
#: The checkout these benchmarks are in (its raylazy/ is the one timed unless told otherwise).
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_process_times(model_dir: str, options: dict, runs: int = 0, tree: str = HERE) -> list[float] | str:
    """CPU seconds of each `make_plan(model_dir, **options)` in a fresh Python process, raylazy (source tree
    `tree`) imported before the clock starts: the process's first call (its heap and regular expressions new: the
    case a user's job meets), then `runs` more; or the process's last error line."""
    res = subprocess.run([sys.executable, "-c", _FRESH, model_dir, str(runs), json.dumps(options)],
                         capture_output=True, text=True, cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": tree})
    if res.returncode:
        return (res.stderr.strip().splitlines() or ["failed"])[-1][:160]
    return json.loads(res.stdout)


def _gap(proj: str, tp: int) -> int:
    """Bytes between one rank's consecutive rows of a row-parallel weight (o_proj or down_proj)."""
    cols = CONFIG["num_attention_heads"] * CONFIG["head_dim"] if proj == "o_proj" else CONFIG["intermediate_size"]
    return (cols - cols // tp) * BF16


def _load() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.3f} MB" if n >= 1e4 else f"{n} B"


def run(model_dir: str, info: dict, tp: int = 8, runs: int = 5, profile: bool = False, out=print) -> dict:
    """Time planning of `model_dir` and print a report; returns the numbers."""
    make_plan(model_dir, tp)  # warm-up: imports, page cache for the headers
    plan, planning_rchar = measure_read_bytes(lambda: make_plan(model_dir, tp))
    _, header_rchar = measure_read_bytes(lambda: open_checkpoint(model_dir))
    plan_s, plan_all, plan_cpu = _timed(lambda: with_node_schedules(make_plan(model_dir, tp), ["node"] * tp), runs)
    head_s, _, head_cpu = _timed(lambda: open_checkpoint(model_dir), runs)
    ckpt = open_checkpoint(model_dir)
    pure_s, _, pure_cpu = _timed(lambda: make_plan(ckpt, tp), runs)
    node_s, _, node_cpu = _timed(lambda: with_node_schedules(plan, ["node"] * tp), runs)
    stripes = len(with_node_schedules(plan, ["node"] * tp).nodes[0].stripes)
    t0 = time.perf_counter()
    text = plan.to_json()
    json_s = time.perf_counter() - t0
    expected_rchar = info["header_bytes"] + info["side_bytes"] + mount_table_bytes()

    out(f"checkpoint: {info['tensors']} tensors in {info['files']} files, {_gb(info['data_bytes'])} of data "
        f"(sparse), {_gb(info['header_bytes'])} of headers; tp={tp}")
    out("")
    out(f"{'rank':>4} {'tensors':>8} {'shard bytes':>14} {'bytes read':>14} {'requests':>10} {'files':>6}")
    for rp in plan.ranks:
        s = rp.stats
        out(f"{rp.rank:>4} {s.tensors:>8} {_gb(s.shard_bytes):>14} {_gb(s.bytes_read):>14} {s.requests:>10,} {s.files:>6}")
    out(f"{'all':>4} {'':>8} {_gb(sum(r.stats.shard_bytes for r in plan.ranks)):>14} {_gb(plan.bytes_read):>14} "
        f"{sum(r.stats.requests for r in plan.ranks):>10,}   ({plan.bytes_read / plan.checkpoint_bytes:.3f}x the checkpoint)")
    out("")
    out(f"{'max_gap':>9} {'bytes read, all ranks':>22} {'x ckpt':>7} {'requests':>11}  (gap rows: o_proj "
        f"{_gap('o_proj', tp):,} B, down_proj {_gap('down_proj', tp):,} B)")
    for gap in sorted({0, _gap("o_proj", tp), _gap("down_proj", tp)}):
        g = plan if gap == plan.max_gap else make_plan(ckpt, tp, max_gap=gap)
        out(f"{gap:>9,} {_gb(g.bytes_read):>22} {g.bytes_read / g.checkpoint_bytes:>7.3f} "
            f"{sum(r.stats.requests for r in g.ranks):>11,}")
    out("")
    rows = [
        ("with_node_schedules(make_plan(dir, tp), one node), median wall", f"{plan_s * 1e3:,.1f} ms",
         f"CPU {plan_cpu * 1e3:.0f} ms; runs: " + ", ".join(f"{t * 1e3:.0f}" for t in plan_all) + " ms"),
        ("  open_checkpoint (headers) alone", f"{head_s * 1e3:,.1f} ms", f"CPU {head_cpu * 1e3:.0f} ms"),
        ("  make_plan(Checkpoint, tp) alone", f"{pure_s * 1e3:,.1f} ms", f"CPU {pure_cpu * 1e3:.0f} ms: rules, slicing, reads"),
        ("  with_node_schedules(plan, one node) alone", f"{node_s * 1e3:,.1f} ms", f"CPU {node_cpu * 1e3:.0f} ms: {stripes:,} stripes"),
        ("plan.to_json()", f"{json_s * 1e3:,.1f} ms", f"{_gb(len(text))} of JSON"),
        ("bytes read while planning (rchar)", f"{planning_rchar:,}", f"expected {expected_rchar:,} = headers "
         f"{info['header_bytes']:,} + index/config {info['side_bytes']:,} + mount table"),
        ("bytes read by header reading (rchar)", f"{header_rchar:,}", f"{header_rchar / max(info['data_bytes'], 1):.2e} of the data"),
        ("target: planning < 1 s (CPU time)", "PASS" if plan_cpu < 1.0 else "FAIL",
         f"wall {'PASS' if plan_s < 1.0 else 'FAIL'}; load average {_load()} on {os.cpu_count()} CPUs "
         "(wall time on a busy machine measures the neighbours)"),
    ]
    w = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        out(f"{name:<{w}}  {value:>14}  {note}")
    if profile:
        out("")
        prof = cProfile.Profile()
        prof.runcall(make_plan, model_dir, tp)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    return {"plan_s": plan_s, "plan_cpu_s": plan_cpu, "target_cpu_s": plan_cpu, "header_s": head_s,
            "pure_plan_s": pure_s, "planning_rchar": planning_rchar, "header_rchar": header_rchar,
            "expected_rchar": expected_rchar, "plan": plan}


def parser(doc: str, layers: int, num_files: int) -> argparse.ArgumentParser:
    """The options of a planning benchmark on a sparse checkpoint (this one and plan_deepseek.py)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--files", type=int, default=num_files)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", help="write the checkpoint here (default: a temporary directory, removed after)")
    return ap


def on_checkpoint(args, prefix: str, write, bench) -> int:
    """Write the sparse checkpoint (`write(dir, layers, files)`), run `bench(dir, info)` on it; 0 when planning
    took under 1 s of CPU (the benchmark's `target_cpu_s`) and read only the headers, index and config.json."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        model_dir = args.dir or tmp
        t0 = time.perf_counter()
        info = write(model_dir, args.layers, args.files)
        print(f"wrote the sparse checkpoint to {model_dir} in {time.perf_counter() - t0:.2f} s")
        res = bench(model_dir, info)
    return 0 if res["target_cpu_s"] < 1.0 and res["planning_rchar"] in (-1, res["expected_rchar"]) else 1


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, CONFIG["num_hidden_layers"], NUM_FILES)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one make_plan call")
    args = ap.parse_args(argv)
    return on_checkpoint(args, "plan405b-", write_checkpoint,
                         lambda d, info: run(d, info, args.tp, args.runs, args.profile))


if __name__ == "__main__":
    sys.exit(main())
