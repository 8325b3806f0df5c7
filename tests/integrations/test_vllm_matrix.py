"""Every architecture vLLM serves, on load_format="raylazy" at tp=2, against vLLM's default loader.

Tiny random checkpoints are written by transformers in this environment (benchmarks/harness/tiny_checkpoints.py:
vLLM's own transformers is older than some configs it writes) and served in vLLM's virtualenv by one subprocess
(benchmarks/harness/vllm_engines.py's `serve`), one raylazy engine per architecture at tp=2. The
oracles are vLLM's own: in every worker, a fresh model loaded by vLLM's default loader and one by raylazy's, every
parameter equal by digest; and the engine's greedy tokens equal those the same engine generates once vLLM's
in-place reload (`reload_weights`) has put the weights vLLM's default loader reads into it (an engine start
fewer than a second engine on the default loader), or, where that reload is not the default loader's engine
(`SECOND_ENGINE`), those of a second engine on the default loader.

`ARCHS` (benchmarks/harness/vllm_engines.py) holds every architecture whose vLLM loader reshapes or fuses weights on load (Falcon's per-kv-head q|k|v
viewed and concatenated, Bloom's per-head q|k|v viewed and transposed, GPT-2's Conv1D transposed, GPT-BigCode's
multi-query c_attn split, GPT-NeoX's per-head query_key_value, Phi-3's fused qkv and gate_up, ...) and the common
dense and mixture-of-experts ones; `LEFT_OUT` those that cannot be compared here, and why (each found by trying).
The suite runs `SUITE`; `python -m pytest tests/integrations/test_vllm_matrix.py -m matrix` runs `ARCHS`, and
`python -m benchmarks.vllm_matrix` prints the bytes each worker read beside its parameters'.
"""

from __future__ import annotations

import pytest

from benchmarks.harness.vllm_engines import ARCHS, LEFT_OUT, MAX_TOKENS, PROMPTS, RERUN, TP, serve
from tests.integrations.test_vllm import _same_weights, vllm_python  # noqa: F401

#: What the suite runs: Falcon (a view that regroups its fused q|k|v, read at once), GPT-2 (Conv1D, transposed), a
#: Llama in int8 W8A8 (per-tensor scales stored by index into its fused layers' scale parameters) and Falcon-H1 (a
#: hybrid: Mamba2's mixer loaded by its own sharded loader, beside attention).
SUITE = ("falcon", "gpt2", "llama-w8a8", "falcon_h1")

pytestmark = [pytest.mark.own_processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]


def _selected(config) -> tuple[str, ...]:
    return tuple(a for a in ARCHS if a not in LEFT_OUT) if "matrix" in (config.getoption("markexpr") or "") else SUITE


def pytest_generate_tests(metafunc):
    if "arch" in metafunc.fixturenames:
        metafunc.parametrize("arch", _selected(metafunc.config))


@pytest.fixture(scope="module")
def served(request, vllm_python, tmp_path_factory) -> dict[str, dict]:  # noqa: F811
    # the engines record and replay (the path every loader's ops must be followed on); their checks, the
    # checkpoint in the page cache, copy out of it at once
    return serve(vllm_python, _selected(request.config), tmp_path_factory.mktemp("vllm_matrix"),
                 extra={"warm_copies": False})


def _served(served: dict, arch: str, generated: bool = True) -> dict:
    """The engine's result once it started (and, `generated`, generated). Where vLLM's default loader fails the
    same engine at the same stage on this CPU (its probe: docs/testing.md, "What depends on the CPU") the test skips
    with vLLM's error; where only raylazy's engine failed it fails."""
    result = served[arch]
    error, probe = result["error"], (result.get("probe") or {}).get("error")
    if error and (generated or error["stage"] in ("start", "crash")):
        if probe and probe["stage"] == error["stage"] != "crash":
            pytest.skip(f"vLLM's default loader fails the same engine on this CPU: {probe['message'][:300]}")
        pytest.fail(f"{arch}: {error}; vLLM's default loader: {probe or 'runs the same engine'}", pytrace=False)
    assert not result["check_errors"], result["check_errors"]
    return result


@pytest.mark.matrix
def test_every_workers_weights_are_the_default_loaders(served, arch):
    """Every parameter of every worker, loaded by raylazy, equals by digest the one vLLM's default loader loads."""
    _same_weights(_served(served, arch, generated=False)["checks"], "raylazy", TP)


@pytest.mark.matrix
def test_greedy_tokens_are_the_default_loaders(served, arch):
    """The raylazy engine's greedy tokens equal the same engine's once it holds the default loader's weights."""
    result = _served(served, arch)
    assert len(result["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in result["tokens"])
    assert result["tokens"] == result["reloaded_tokens"]


@pytest.mark.matrix
def test_each_worker_reports_its_load(served, arch):
    """Each worker logs its load (raylazy/io/report.py): the engine's replayed (run again, where `RERUN`
    says why), its check's copied at once out of the page cache, their parameters' bytes counted, and no region
    taken only on a second run."""
    result = _served(served, arch, generated=False)
    lines, checks = result["lines"], [c["line"] for c in result["checks"]["raylazy"]]
    assert [s["rank"] for s in lines] == [s["rank"] for s in checks] == list(range(TP))
    mode = "rerun" if arch in RERUN else "replay"
    assert [s["mode"] for s in lines + checks] == [mode] * TP + ["at-once"] * TP
    assert all(s["param_bytes"] > 0 and s["unplanned_regions"] == 0 for s in lines + checks), lines + checks
