"""raylazy inside other systems, on the core and the readers (not the Ray layer): lazy weights (`lazy`, `recording`:
which bytes a consumer's use says to read; `runs`, `reload`: a load's and a reload's runs over them), and a vLLM
load format (`vllm`, `worker`; its log line is `raylazy.io.report`'s)."""
