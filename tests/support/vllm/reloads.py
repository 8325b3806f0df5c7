"""Runs inside the vLLM virtualenv (tests/integrations/test_vllm_reload.py starts it): starts one vLLM engine per run in
turn, reloads its weights in place as an RL framework does (`collective_rpc("reload_weights", kwargs={"weights_path":
..., "is_checkpoint_format": True})`) step after step, and prints one line `RESULT` and JSON per run.

A run is a JSON object: `model`, `format`, `tp`, `dtype` (default float32), `bind` (VLLM_CPU_OMP_THREADS_BIND),
`extra` (model_loader_extra_config) and `steps`, each a reload: `path`, `extra` (the engine's load config's
extra config for this reload on: a reload makes a new loader from it), `fault` (the reload's Nth read of the
checkpoint, in every worker, raises OSError) and `weights` (true: also the weights checked). A step's result
has `error` (what the reload raised, or None), `logprobs` (the prompts' prompt logprobs after it), `lines` (per
rank: the numbers of raylazy's log line of the reload) and, with `weights`, per rank `loaded` (a sha256 of each
parameter as the weight loaders wrote it, taken before vLLM's CPU processing repacks it), `now` (the same of
each parameter as the engine holds it after the reload, repacked) and `fresh` (as `loaded`, of a fresh model the
worker loads with vLLM's default loader from the checkpoint the engine now names). The
run's own `logprobs` are those before any step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os


def digest(t) -> str:
    import hashlib

    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def arm(worker, fault: int | None) -> None:
    """Runs in each worker before a reload: collects raylazy's log lines and the digests of each layer's
    parameters as its weight loaders left them (before its quantization method processes them); with `fault`,
    the reload's `fault`th read of the checkpoint raises."""
    import logging

    from raylazy.io import regions

    model = worker.model_runner.get_model()
    names = {id(m): n for n, m in model.named_modules()}
    state = {"lines": [], "loaded": {}, "undo": []}
    worker.reload_test = state
    handler = logging.Handler()
    handler.emit = lambda record: state["lines"].append(record.getMessage())
    logging.getLogger("vllm.raylazy").addHandler(handler)
    state["undo"].append(lambda: logging.getLogger("vllm.raylazy").removeHandler(handler))
    def wrap(cls, orig):
        def process(self, layer, *args, **kwargs):
            for n, p in layer.named_parameters(recurse=False):
                state["loaded"][f"{names[id(layer)]}.{n}"] = digest(p)
            return orig(self, layer, *args, **kwargs)

        cls.process_weights_after_loading = process
        state["undo"].append(lambda: setattr(cls, "process_weights_after_loading", orig))

    for cls in {type(m.quant_method) for m in model.modules() if getattr(m, "quant_method", None) is not None}:
        wrap(cls, cls.process_weights_after_loading)
    if fault:
        read, calls = regions.RegionReader.read, [0]

        def failing(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == fault:
                raise OSError(f"injected: read {fault} of the reload failed")
            return read(self, *args, **kwargs)

        regions.RegionReader.read = failing
        state["undo"].append(lambda: setattr(regions.RegionReader, "read", read))


def disarm(worker, weights: bool) -> dict:
    """Runs in each worker after a reload: what `arm` collected, and with `weights` the digests (see the module's
    docstring)."""
    # the engines' script and raylazy: the repository is on every process's PYTHONPATH
    from benchmarks.harness.engines import loaded
    from raylazy.io.report import fields

    state = worker.reload_test
    for undo in state["undo"]:
        undo()
    out = {"line": next(filter(None, map(fields, state["lines"])), None)}
    if weights:
        now = {n: digest(p) for n, p in worker.model_runner.get_model().named_parameters()}
        fresh = loaded(worker, "auto", {})
        out["loaded"] = {n: state["loaded"].get(n, now.get(n)) for n in fresh["digests"]}
        out["now"], out["fresh"], out["numel"] = now, fresh["digests"], fresh["numel"]
    return out


def set_extra(worker, extra: dict) -> None:
    worker.vllm_config.load_config.model_loader_extra_config = extra


def run(spec: dict, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams

    if spec.get("bind"):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec["bind"]
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    llm = LLM(model=spec["model"], load_format=spec["format"], tensor_parallel_size=spec["tp"],
              model_loader_extra_config=spec.get("extra", {}), dtype=spec.get("dtype", "float32"),
              skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, max_num_seqs=len(prompts), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)

    def logprobs() -> list[list[float]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]

    out = {"spec": spec, "logprobs": logprobs(), "steps": []}
    try:
        for step in spec.get("steps", []):
            if "extra" in step:
                llm.collective_rpc(set_extra, args=(step["extra"],))
            llm.collective_rpc(arm, args=(step.get("fault"),))
            error = None
            try:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": step["path"], "is_checkpoint_format": True})
            except Exception as e:  # noqa: BLE001  (what the reload raised is the step's outcome)
                error = f"{type(e).__name__}: {e}"
            ranks = llm.collective_rpc(disarm, args=(step.get("weights", False),))
            out["steps"].append({"error": error, "logprobs": logprobs(), "lines": [r["line"] for r in ranks],
                                 **({k: [r[k] for r in ranks] for k in ("loaded", "now", "fresh", "numel")}
                                    if step.get("weights") else {})})
    finally:
        llm.llm_engine.engine_core.shutdown()
        gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True, help="JSON list of runs (see the module's docstring)")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    args = ap.parse_args()
    for spec in json.loads(args.runs):
        print("RESULT " + json.dumps(run(spec, json.loads(args.prompts))), flush=True)


if __name__ == "__main__":
    main()
