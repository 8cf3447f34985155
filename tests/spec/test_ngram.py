import numpy as np
import pytest
import torch

from slipstream.spec.base import ProposeRequest
from slipstream.spec.ngram import NgramProposer, lookup


def test_lookup_prefers_the_longest_latest_match():
    t = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    # suffix [1, 2, 3] matched at 0 -> continuation [9, 9, 2]
    assert lookup(t, 3, 1, 3).tolist() == [9, 9, 2]
    # only bigrams: [2, 3] latest earlier match at 5 -> [7, 8]
    assert lookup(t, 2, 1, 2).tolist() == [7, 8]
    assert lookup(np.array([5, 6, 7]), 3, 1, 4).tolist() == []
    # continuation runs into the end of the history: fewer than k tokens
    assert lookup(np.array([4, 4, 4]), 2, 1, 5).tolist() == [4]


def test_proposer_gives_chains_and_checks_options():
    p = NgramProposer(2, max_n=2)
    trees = p.propose([ProposeRequest("a", [1, 2, 3, 1, 2]), ProposeRequest("b", [1])])
    assert trees[0].tokens.tolist() == [3, 1] and trees[0].is_chain
    assert trees[1].num_nodes == 0
    with pytest.raises(ValueError):
        NgramProposer(2, max_n=1, min_n=2)
