"""The vLLM benchmark's verdict on paired repetitions (`benchmarks.vllm_load.sign_p`) against every split of signs
counted out: the two-sided sign test's chance of a split at least as uneven where each sign is a coin toss."""

from __future__ import annotations

from itertools import product

import pytest

from benchmarks.vllm_load import sign_p


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
