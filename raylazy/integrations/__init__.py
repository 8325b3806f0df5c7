"""raylazy inside other systems, on the core and the readers (not the Ray layer): lazy weights (`lazy`, `recording`,
`options`, `serving`, `report`: which bytes a consumer's use says to read) and a vLLM load format (`vllm`)."""
