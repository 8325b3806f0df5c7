"""Runs inside the vLLM virtualenv (tests/test_vllm.py starts it): starts one vLLM engine per run (a checkpoint
and a load format) in turn, all at one tensor-parallel size, and prints one line per engine, `RESULT` and JSON:
the model, the format and the greedy tokens of each prompt. The loader's log lines of an engine come before its
RESULT line, the engine's own load first.

With `--check-loaders F ...`, each worker of the engine also loads a fresh copy of the model with each load format
F (the weights as the loader leaves them, before vLLM's CPU post-processing repacks the linear layers and empties
their parameters) and the result holds, per format, per rank, a sha256 of every parameter. Format
`raylazy+peer` loads with raylazy while rank 0 is fed its neighbour's bytes (peer_loader.py).
"""

from __future__ import annotations

import argparse
import gc
import json


def loaded_digests(worker, load_format: str) -> dict[str, str]:
    """Runs in each worker: a fresh model loaded with `load_format` -> {parameter name: sha256 of its bytes}."""
    import hashlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    fmt, _, variant = load_format.partition("+")
    cfg = worker.vllm_config
    if variant == "peer":
        from peer_loader import PeerBytesLoader  # beside this script, on the workers' sys.path too

        loader = PeerBytesLoader(LoadConfig(load_format=fmt))
    else:
        loader = get_model_loader(LoadConfig(load_format=fmt))
    # The copy's attention layers register under the serving model's names: let them, aside, for the copy only.
    layers = cfg.compilation_config.static_forward_context
    cfg.compilation_config.static_forward_context = {}
    try:
        with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
            loader.load_weights(model, cfg.model_config)
    finally:
        cfg.compilation_config.static_forward_context = layers
    return {name: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, p in model.named_parameters()}


def run(model: str, tp: int, load_format: str, prompts: list[list[int]], max_tokens: int, check: list[str]) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, load_format=load_format, tensor_parallel_size=tp, dtype="float32", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=128, max_num_seqs=len(prompts), seed=0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        loaded = {f: llm.collective_rpc(loaded_digests, args=(f,)) for f in check}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"model": model, "format": load_format, "tokens": tokens, "loaded": loaded}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", required=True, metavar="MODEL_DIR=FORMAT", help="engines to start, in order")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--check-loaders", nargs="*", default=[], metavar="FORMAT",
                    help="load formats each worker of a raylazy engine also loads a fresh model with")
    args = ap.parse_args()
    for spec in args.runs:
        model, _, fmt = spec.rpartition("=")
        check = args.check_loaders if fmt == "raylazy" else []
        result = run(model, args.tp, fmt, json.loads(args.prompts), args.max_tokens, check)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
