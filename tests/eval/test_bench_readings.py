"""The benchmarks' own reading of their inputs: a lettered prompt's question and options (the router
probe's ``--reading letters``), the features it keeps of a model's answer, and the context switches
the workers pair counts."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from backends.letters import FEATURES, features, parse
from benchmarks.meters import group_switches


def test_a_lettered_prompt_is_split_at_its_last_block_of_options() -> None:
    prompt = "A cell nucleus contains which of the following?\nI. DNA\nII. Protein\nA. I only\nB. II only\nAnswer:"
    assert parse(prompt) == (
        "A cell nucleus contains which of the following?\nI. DNA\nII. Protein",
        ("I only", "II only"),
    )
    assert parse("Find x.\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:") == ("Find x.", ("0", "4", "2", "6"))
    for bad in ("No options here.", "Q\nA. one\nAnswer:", "Q\nA. one\nC. three\nAnswer:", "Q\nA. one\nB. \nAnswer:"):
        assert parse(bad) is None, bad


def test_the_features_say_how_sure_not_which_letter() -> None:
    sure = features((math.log(0.97), math.log(0.01), math.log(0.01), math.log(0.01)), 0.9)
    flat = features(tuple(math.log(0.25) for _ in range(4)), 0.2)
    assert sure.shape == flat.shape == (FEATURES,)
    assert sure[0] == pytest.approx(0.97) and sure[4] < 0.2 and sure[5] == pytest.approx(0.9)
    assert flat[0] == pytest.approx(0.25) and flat[4] == pytest.approx(1.0)
    # the same confidence on another letter reads the same
    moved = features((math.log(0.01), math.log(0.01), math.log(0.97), math.log(0.01)), 0.9)
    assert np.allclose(moved, sure)
    # two options: the rest of the probabilities' slots are zeros, the entropy over log 2
    two = features((math.log(0.5), math.log(0.5)), 1.0)
    assert two[:4].tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0]) and two[4] == pytest.approx(1.0)


def test_the_switches_of_a_process_group_are_counted_over_its_threads() -> None:
    voluntary, involuntary = group_switches(os.getpgid(0))
    assert voluntary > 0 and involuntary >= 0  # this test's own process is in the group
    assert group_switches(2**22 + 12345) == (0, 0)  # no such group
