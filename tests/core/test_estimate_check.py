"""The load-time model against loads measured on this machine (tests/data/estimate_runs.json, written by
`python -m benchmarks.estimate_check`): data in, data out, nothing loaded here. Each run is planned anew from the
checkpoint's recorded shapes by the planner in this tree and its figures taken from that plan as the benchmark
takes them; they equal the figures recorded from the plan the run loaded and agree with what the readers reported
while loading, the model's predictions from them and the fitted hardware are those recorded, and every phase is
within the model's claim (max(25%, 0.1 s)) except the misses docs/estimate.md names, each for its reason. A change
of the planner or the schedule that changes a run's figures or a prediction fails here."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.estimate_check import recorded_checkpoint, run_figures, run_plan
from raylazy.core.estimate import LoadFigures, predict

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "estimate_runs.json")

#: (run, phase) the model misses on this machine, and why (docs/estimate.md, "Checked here").
_START = "an actor's start on this shared 2-core machine varies up to 2x between identical loads (tp=4: 16.5-24.5 s)"
_FAULTS = ("cooperative ranks on strided pages read by page faults, whose read-around the model does not count, on "
           "2 cores shared by 8 processes")
_AHEAD = ("a cooperative rank's page faults on the NFS-like mount keep more than one request in flight (the "
          "kernel's asynchronous read-ahead); the model counts one per rank")
_ROUNDS = ("the exchange's round cost, fitted on one node's few rounds, is too high for two simulated nodes' "
           "1,500 rounds running side by side")
KNOWN_MISSES: dict[tuple[str, str], str] = {
    ("local-tp1", "read"): "one rank alone read 3.4 s in two repeats and 0.65 s in the third: not explained",
    ("local-tp4", "actors"): _START, ("local-tp4", "total"): _START,
    ("local-tp8", "actors"): _START, ("local-tp8", "total"): _START,
    ("local-tp8", "read"): "0.18 s under the 0.82 s predicted: the model's floor (each rank's setup) is too high",
    ("local-tp2-exchange", "read"): "the exchange over gloo with two ranks: 1.8-3.2 s between repeats",
    ("nfs-tp2", "plan"): "planning on the FUSE mount: 0.13-0.22 s between repeats, 0.03 s past the 0.1 s slack",
    ("s3-tp4", "plan"): "planning on S3 (the cost model's first GETs): 0.20 s, 0.05 s past the 0.1 s slack",
    ("local-tp8-4nodes", "read"): _FAULTS,
    ("local-tp2-replicas2", "actors"): _START,
    ("nfs-tp4-2nodes", "actors"): _START,
    ("nfs-tp4-2nodes", "read"): _AHEAD, ("nfs-tp4-2nodes", "total"): _AHEAD,
    ("s3-tp4-2nodes", "read"): _ROUNDS, ("s3-tp4-2nodes", "total"): _ROUNDS,
}


@pytest.fixture(scope="module")
def data() -> dict:
    with open(DATA) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def planned(data) -> dict[str, LoadFigures]:
    """Each run's figures from its plan made now from the recorded shapes."""
    ckpt = recorded_checkpoint(data["checkpoint"])
    return {r["name"]: run_figures(run_plan(ckpt, r), r) for r in data["runs"]}


@pytest.fixture(scope="module")
def predicted(data, planned) -> dict[str, dict[str, float]]:
    """Each run's phases as the model predicts them now from its plan's figures and the fitted hardware."""
    return {r["name"]: predict(planned[r["name"]], data["hardware"][r["storage"]]).phases for r in data["runs"]}


def _miss(predicted: float, measured: float, tolerance: float, slack: float) -> bool:
    return abs(predicted - measured) > max(tolerance * measured, slack)


def test_the_record_covers_what_the_model_claims_to_check(data):
    runs = data["runs"]
    assert len(runs) >= 12
    assert {r["storage"] for r in runs} == {"local", "nfs", "bucket", "s3"}
    assert {r["role"] for r in runs} == {"calibrate", "validate"}
    assert {r["tp"] for r in runs} >= {1, 2, 4, 8}
    assert max(len(r["figures"]["nodes"]) for r in runs) == 4 and any(r["replicas"] > 1 for r in runs)


def test_the_plans_made_now_have_the_recorded_figures(data, planned):
    """Bytes and requests from storage, stripes and the exchange's rounds, copies and replicas: the plan made now
    moves what the plan the run loaded moved."""
    for r in data["runs"]:
        assert planned[r["name"]] == LoadFigures.from_dict(r["figures"]), r["name"]


def test_the_figures_agree_with_what_the_readers_reported(data, planned):
    """The bytes the exchange's ranks received and the replicas copied, as each rank's reader counted them, are the
    bytes the model's figures move."""
    for r in data["runs"]:
        fig = planned[r["name"]]
        measured = [x["bytes_received"] for x in r["ranks"]]
        for n in fig.nodes:
            if n.backend == "exchange":
                assert sum(n.received_bytes) == sum(measured[k] for k in n.ranks), r["name"]
        copied = sum(x["bytes_from_replica"] for x in r["ranks"])
        assert copied == sum(n.replica_in + n.replica_local for n in fig.nodes), r["name"]


def test_each_prediction_is_the_models(data, predicted):
    """The predictions recorded are what the model in this tree computes from the plans made now and the hardware."""
    for r in data["runs"]:
        assert predicted[r["name"]] == pytest.approx(r["predicted"]), r["name"]


def test_predictions_are_within_the_claim_except_the_named_misses(data, predicted):
    misses = {(r["name"], ph) for r in data["runs"] for ph, m in r["measured"].items()
              if _miss(predicted[r["name"]][ph], m, data["tolerance"], data["slack_s"])}
    assert misses == set(KNOWN_MISSES)
