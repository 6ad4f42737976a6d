"""did_you_mean: the suggestion an unknown name's error carries."""

from __future__ import annotations

import pytest

from ndplan.errors import NdplanError, did_you_mean
from ndplan.model.presets import load_model
from ndplan.strategy import get_precision

KNOWN = ["a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200"]


def test_a_unique_prefix_is_suggested() -> None:
    assert did_you_mean("h100", KNOWN) == " (did you mean 'h100-sxm'?)"
    assert did_you_mean("H100", KNOWN) == " (did you mean 'h100-sxm'?)"


def test_an_ambiguous_prefix_falls_back_to_the_closest_name() -> None:
    # both a100 presets start with "a100": difflib picks the nearer spelling
    assert did_you_mean("a100-80", KNOWN) == " (did you mean 'a100-80gb'?)"


def test_nothing_close_suggests_nothing() -> None:
    assert did_you_mean("tpu", KNOWN) == ""
    assert did_you_mean("", KNOWN) == ""


def test_model_and_precision_errors_carry_the_suggestion() -> None:
    with pytest.raises(NdplanError, match=r"unknown model 'qwen3-30b' \(did you mean 'qwen3-30b-a3b'\?\); presets: "):
        load_model("qwen3-30b")
    with pytest.raises(NdplanError, match=r"unknown precision policy 'megatron-bf' \(did you mean 'megatron-bf16'\?\)"):
        get_precision("megatron-bf")
