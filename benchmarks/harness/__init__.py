"""What the benchmarks and the tests both run: loopback Ray clusters (`ray_clusters`), tiny random checkpoints
written by transformers (`tiny_checkpoints`) and vLLM's engines in a virtualenv of their own (`vllm_engines`,
running `engines.py` there). The tests import it; it imports nothing of the tests."""
