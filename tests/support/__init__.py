"""What the tests share: checkpoints they write, the oracles they check raylazy against, measurements of what a
reader did, the Ray tests' rank actor, and the scripts run in vLLM's virtualenv (vllm/)."""

from pathlib import Path

#: The repository's root (docs/, benchmarks/, examples/ beside tests/).
REPO = Path(__file__).resolve().parents[2]
