"""The vLLM benchmark's verdict on paired repetitions (`benchmarks.vllm_load.sign_p`) against every split of signs
counted out: the two-sided sign test's chance of a split at least as uneven where each sign is a coin toss; and its
pairing (`paired`) of each measure against the differences taken by hand."""

from __future__ import annotations

from itertools import product

import pytest

from benchmarks.vllm_load import PAIRED, paired, sign_p


def _enumerated(slower: int, faster: int) -> float:
    """The share of all 2^n sign patterns whose split is at least as far from even as slower : faster."""
    n = slower + faster
    far = abs(slower - faster)
    return sum(abs(2 * sum(signs) - n) >= far for signs in product((0, 1), repeat=n)) / 2**n


@pytest.mark.parametrize("slower, faster", [(5, 2), (7, 0), (0, 7), (6, 1), (3, 4), (9, 3), (1, 0)])
def test_sign_p_is_the_share_of_sign_patterns_as_uneven(slower, faster):
    diffs = [0.01] * slower + [-0.02] * faster + [0.0]  # a tie says nothing either way
    assert sign_p(diffs) == pytest.approx(_enumerated(slower, faster))


def test_no_difference_at_all_is_no_evidence():
    assert sign_p([0.0, 0.0]) == sign_p([]) == 1.0


def test_each_measure_is_paired_within_its_repetition():
    # a slow spell in repetition 2 moves both formats: pairing leaves it out, a difference of medians would not
    times = {"raylazy": [(1.0, 0.20, 0.31, 9.0), (1.1, 0.21, 0.30, 9.2), (3.0, 0.60, 0.90, 20.0)],
             "auto": [(0.9, 0.22, 0.27, 9.1), (1.3, 0.20, 0.24, 9.0), (2.5, 0.65, 0.80, 19.0)]}
    rows = [{"run": run, "format": fmt, "tp": 2, "cache": "warm", "dtype": "bfloat16", "before_load_s": before,
             "node_load_s": step, "loader_s": loader, "after_load_s": after, "ready_s": before + step + after}
            for fmt, reps in times.items() for run, (before, step, loader, after) in enumerate(reps)]
    lines = paired(rows, "raylazy")
    assert len(lines) == len(PAIRED)
    for key, what in PAIRED.items():
        diffs = [r[key] - a[key] for r, a in zip(rows[:3], rows[3:])]
        line = next(x for x in lines if f": {what} " in x)
        assert f"{sorted(diffs)[1]:+.3f} s by the median of 3 paired repetitions" in line
        assert f"raylazy longer in {sum(d > 0 for d in diffs)} of them" in line
