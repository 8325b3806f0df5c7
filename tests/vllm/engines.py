"""Runs inside the vLLM virtualenv (tests/test_vllm.py starts it): starts one vLLM engine per run in turn and
prints, for each, `READY <n>` once the engine can serve (the loader's log lines of its own load come before it)
and then one line `RESULT` and JSON: the run, the greedy tokens of each prompt, and its checks.

A run is a JSON object: `model`, `format`, `tp`, `pp` (default 1), `ep` (enable_expert_parallel), `dtype`
(default float32), `bind` (VLLM_CPU_OMP_THREADS_BIND for its workers; none: vLLM's own), `extra`
(model_loader_extra_config), `generate` (default true: vLLM's CPU build cannot generate with pipeline or expert
parallelism, whatever the load format; false: no tokens) and `checks`: loads each worker of the engine also
makes of a fresh copy of the model (the weights as the loader leaves them, before vLLM's CPU post-processing
repacks the linear layers and empties their parameters), each `{"name", "format", "extra", "cold"}`. A check's result holds, per rank, a
sha256 of every parameter, the parameters' elements, and what the worker's process read during the loader's
`load_weights`, measured from /proc/self/io (`rchar`: bytes its read calls returned; `read_bytes`: bytes it
made the storage read, for a `cold` check, whose checkpoint pages the engine process evicts first), and the
numbers of raylazy's log line when the format is raylazy. Format `raylazy+peer` loads with raylazy while rank
0 is fed its neighbour's bytes (peer_loader.py).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def loaded(worker, load_format: str, extra: dict) -> dict:
    """Runs in each worker: a fresh model loaded with `load_format` and `extra` (see the module's docstring)."""
    import hashlib
    import logging

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from raylazy.integrations.report import fields

    fmt, _, variant = load_format.partition("+")
    cfg = worker.vllm_config
    load_config = LoadConfig(load_format=fmt, model_loader_extra_config=extra)
    if variant == "peer":
        from peer_loader import PeerBytesLoader  # beside this script, on the workers' sys.path too

        loader = PeerBytesLoader(load_config)
    else:
        loader = get_model_loader(load_config)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("vllm.raylazy").addHandler(handler)
    # The copy's attention layers register under the serving model's names: let them, aside, for the copy only.
    layers = cfg.compilation_config.static_forward_context
    cfg.compilation_config.static_forward_context = {}
    try:
        with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
            before = proc_io()
            loader.load_weights(model, cfg.model_config)
            after = proc_io()
    finally:
        cfg.compilation_config.static_forward_context = layers
        logging.getLogger("vllm.raylazy").removeHandler(handler)
    digests = {name: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
               for name, p in model.named_parameters()}
    return {"digests": digests, "numel": sum(p.numel() for p in model.parameters()),
            "rchar": after["rchar"] - before["rchar"], "read_bytes": after["read_bytes"] - before["read_bytes"],
            "line": next(filter(None, map(fields, lines)), None)}


def evict(model: str) -> None:
    """Drop the checkpoint's pages from the page cache (a cold start for the next load)."""
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(spec: dict, n: int, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    if spec.get("bind"):  # the workers, started now, take it from the environment
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec["bind"]
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    llm = LLM(model=spec["model"], load_format=spec["format"], tensor_parallel_size=spec["tp"],
              pipeline_parallel_size=spec.get("pp", 1), enable_expert_parallel=spec.get("ep", False),
              model_loader_extra_config=spec.get("extra", {}), dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=128, max_num_seqs=len(prompts), seed=0)
    print(f"READY {n}", flush=True)
    try:
        tokens = None
        if spec.get("generate", True):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        checks = {}
        for check in spec.get("checks", []):
            if check.get("cold"):
                evict(spec["model"])
            checks[check["name"]] = llm.collective_rpc(loaded, args=(check["format"], check.get("extra", {})))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"spec": spec, "tokens": tokens, "checks": checks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True, help="JSON list of runs (see the module's docstring)")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    for n, spec in enumerate(json.loads(args.runs)):
        result = run(spec, n, json.loads(args.prompts), args.max_tokens)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
