"""Runs inside the vLLM virtualenv (`vllm_engines.start` runs it): starts one vLLM engine per run in turn and
prints, for each, `READY <n>` once the engine can serve (the loader's log lines of its own load come before it)
and then one line `RESULT` and JSON: the run, the greedy tokens of each prompt, and its checks. Before the
first run, one line `PLUGINS` and JSON: what vLLM's plugin loading makes of the format (`plugins`).

A run is a JSON object: `model`, `format`, `tp`, `pp` (default 1), `ep` (enable_expert_parallel), `dtype`
(default float32), `bind` (VLLM_CPU_OMP_THREADS_BIND for its workers; none: vLLM's own), `extra`
(model_loader_extra_config), `generate` (default true: vLLM's CPU build cannot generate with pipeline or expert
parallelism, whatever the load format; false: no tokens), `reload` (true: after generating, every worker reloads
the served model in place, vLLM's `reload_weights`, from what vLLM's default loader reads of the same checkpoint,
and the engine generates again: `reloaded_tokens`, the default loader's weights' tokens) and `checks`: loads
each worker of the engine also makes of a fresh copy of the model (the weights as the loader leaves them, before vLLM's CPU post-processing
repacks the linear layers and empties their parameters), each `{"name", "format", "extra", "cold"}`. A check's result holds, per rank, a
sha256 of every parameter, the parameters' elements, and what the worker's process read during the loader's
`load_weights`, measured from /proc/self/io (`rchar`: bytes its read calls returned; `read_bytes`: bytes it
made the storage read, for a `cold` check, whose checkpoint pages the engine process evicts first), the
generation of each pass Python's collector made during raylazy's step (`collections`:
`raylazy.integrations.worker.load_weights`, which its loader runs with the collector paused; as it resumes, a
young pass may follow), and the numbers of raylazy's log line when the format is raylazy. A check's `loader`
("module:Class", importable in the workers) is a loader class made in place of the format's (the tests' broken
one: tests/support/vllm/peer_loader.py).

An engine that fails is reported, not fatal: its `RESULT` carries `error` ({"stage": "start", "generate" or "reload",
"message": vLLM's error}), a check that fails its own in `check_errors`, and the next run starts. The checks
run before `generate`, so an engine whose generation vLLM cannot run on this CPU still has its weights checked.
An engine that failed is started again on vLLM's default loader, its `probe`: whether vLLM itself can run it.
Faults the tests inject to show this: `fail` (a message: each worker's model runner raises it in place of running
the model, as vLLM's CPU attention does for a kernel it lacks, so the error travels vLLM's own path), `crash`
(this process dies as the run starts, as in a segfault: the caller restarts it with the runs after) and `engine`
(LLM keyword arguments over the harness's own: a setting vLLM refuses).
"""

from __future__ import annotations

import argparse
import gc
import glob
import importlib
import json
import os
import sys


def loaded(worker, load_format: str, extra: dict, loader_class: str | None = None) -> dict:
    """Runs in each worker: a fresh model loaded with `load_format` and `extra` (see the module's docstring)."""
    import hashlib
    import logging

    import torch
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from benchmarks.vllm_step import fresh_copy
    from raylazy.integrations import worker as raylazy_worker
    from raylazy.io.report import fields
    from raylazy.io.stats import io_delta, proc_io

    cfg = worker.vllm_config
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=extra)
    if loader_class:
        module, _, name = loader_class.partition(":")
        loader = getattr(importlib.import_module(module), name)(load_config)
    else:
        loader = get_model_loader(load_config)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("vllm.raylazy").addHandler(handler)
    try:
        with fresh_copy(cfg, loader) as model:
            passes: list[int] = []  # the generation of each pass of the collector during raylazy's step

            def count(phase: str, info: dict) -> None:
                if phase == "start":
                    passes.append(info["generation"])

            def counted(*args, **kwargs):  # raylazy's step, which its loader runs with the collector paused
                gc.callbacks.append(count)
                try:
                    return step(*args, **kwargs)
                finally:
                    gc.callbacks.remove(count)

            step, raylazy_worker.load_weights = raylazy_worker.load_weights, counted
            before = proc_io()
            try:
                loader.load_weights(model, cfg.model_config)
            finally:
                after = proc_io()
                raylazy_worker.load_weights = step
    finally:
        logging.getLogger("vllm.raylazy").removeHandler(handler)
    digests = {name: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
               for name, p in model.named_parameters()}
    return {"digests": digests, "numel": sum(p.numel() for p in model.parameters()),
            **io_delta(before, after), "collections": passes, "line": next(filter(None, map(fields, lines)), None)}


def evict(model: str) -> None:
    """Drop the checkpoint's pages from the page cache (a cold start for the next load)."""
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def broken(worker, message: str) -> None:
    """Runs in each worker: its model runner raises `message` where it would run the model (an injected fault)."""

    def fail(*args, **kwargs):
        raise RuntimeError(message)

    worker.model_runner.execute_model = fail


def reload_default(worker) -> None:
    """Runs in each worker: the served model's weights reloaded in place (vLLM's `reload_weights`) from what vLLM's
    default loader reads of the same checkpoint."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    model_config = worker.vllm_config.model_config
    weights = get_model_loader(LoadConfig(load_format="auto")).get_all_weights(model_config, worker.model_runner.get_model())
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)


def greedy(llm, prompts: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def error(stage: str, e: BaseException) -> dict:
    return {"stage": stage, "message": f"{type(e).__name__}: {e}"[-2000:]}


def run(spec: dict, prompts: list[list[int]], max_tokens: int, ready: str | None) -> dict:
    """One engine's run (the module's docstring); `ready` is printed once it can serve."""
    from vllm import LLM, SamplingParams

    if spec.get("crash"):
        os._exit(3)
    if spec.get("bind"):  # the workers, started now, take it from the environment
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec["bind"]
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    kwargs = dict(tensor_parallel_size=spec["tp"], pipeline_parallel_size=spec.get("pp", 1),
                  enable_expert_parallel=spec.get("ep", False), model_loader_extra_config=spec.get("extra", {}),
                  dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                  max_num_seqs=len(prompts), seed=0)
    out = {"spec": spec, "tokens": None, "checks": {}, "check_errors": {}, "error": None}
    try:
        llm = LLM(model=spec["model"], load_format=spec["format"], **(kwargs | spec.get("engine", {})))
    except Exception as e:  # noqa: BLE001  (whatever vLLM raises is the run's outcome, reported to the tests)
        out["error"] = error("start", e)
        return out
    if ready:
        print(ready, flush=True)
    try:
        for check in spec.get("checks", []):
            if check.get("cold"):
                evict(spec["model"])
            try:
                out["checks"][check["name"]] = llm.collective_rpc(loaded, args=(check["format"], check.get("extra", {}),
                                                                     check.get("loader")))
            except Exception as e:  # noqa: BLE001  (likewise)
                out["check_errors"][check["name"]] = error("check", e)
        if spec.get("fail"):
            llm.collective_rpc(broken, args=(spec["fail"],))
        if spec.get("generate", True):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
            try:
                out["tokens"] = greedy(llm, prompts, params)
                if spec.get("reload"):
                    llm.collective_rpc(reload_default)
                    out["reloaded_tokens"] = greedy(llm, prompts, params)
            except Exception as e:  # noqa: BLE001  (likewise)
                out["error"] = error("reload" if out["tokens"] else "generate", e)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return out


def plugins() -> dict:
    """What vLLM's own plugin loading makes of load_format="raylazy" in a process that has not imported raylazy:
    the raylazy modules it imported, the loader's class and the raylazy modules imported once one is made (and
    whether Ray was), and what making it with each bad option raised."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out = {"registering imported": sorted(m for m in sys.modules if m.startswith("raylazy"))}
    config = LoadConfig(load_format="raylazy", model_loader_extra_config={"threads": 2})
    out["loader"] = type(get_model_loader(config)).__name__
    out["a loader imported"] = sorted(m for m in sys.modules if m.startswith("raylazy"))
    out["ray imported"] = "ray" in sys.modules  # no Ray cluster at hand (RAY_ADDRESS): no holder looked for
    for extra in ({"threads": 0}, {"bogus": 1}, {"backend": "nvme"}, {"replay": "no"}):
        try:
            get_model_loader(LoadConfig(load_format="raylazy", model_loader_extra_config=extra))
        except Exception as e:  # noqa: BLE001  (what it raised is the outcome)
            out[json.dumps(extra)] = f"{type(e).__name__}: {e}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True, help="JSON list of runs (see the module's docstring)")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    prompts = json.loads(args.prompts)
    print("PLUGINS " + json.dumps(plugins()), flush=True)
    for n, spec in enumerate(json.loads(args.runs)):
        result = run(spec, prompts, args.max_tokens, ready=f"READY {n}")
        if result["error"] and spec["format"] != "auto":  # can vLLM's own loader run this engine here?
            result["probe"] = run(spec | {"format": "auto", "checks": []}, prompts, args.max_tokens, ready=None)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
