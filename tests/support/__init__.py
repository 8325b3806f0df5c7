"""What the tests share: checkpoints they write, the oracles they check raylazy against, measurements of what a
reader did, the Ray tests' rank actor, and the scripts run in vLLM's virtualenv (vllm/)."""

import multiprocessing
from pathlib import Path

#: The repository's root (docs/, benchmarks/, examples/ beside tests/).
REPO = Path(__file__).resolve().parents[2]

#: How tests run a node's ranks as plain processes (no Ray): forked from a server that imported the modules whose
#: functions they run once (fast), never from the test process itself, whose threads (a Ray driver's, OpenMP's)
#: can leave a forked child waiting forever on a lock it inherited held.
RANK_PROCESSES = multiprocessing.get_context("forkserver")
RANK_PROCESSES.set_forkserver_preload(["torch", "tests.io.test_coop", "tests.io.test_exchange"])
