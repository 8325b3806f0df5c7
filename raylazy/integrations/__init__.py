"""raylazy inside other systems, built on the core and the readers (not on the Ray layer): `lazy` (tensor-like
checkpoint weights whose use says which bytes to read) and `vllm` (a vLLM load format)."""
