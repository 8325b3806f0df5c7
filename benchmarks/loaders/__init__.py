"""Loaders compared: naive safetensors, lazy slices, fastsafetensors, Run:ai streamer, raylazy, raw reads.

    python -m benchmarks.loaders                    # ~2 GB Llama-shaped checkpoint, tp 1, 2, 4
    python -m benchmarks.loaders --help

See docs/benchmarks.md for what is measured and how, and the results on one machine.
"""
