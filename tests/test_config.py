"""MoEConfig validates every field when it is built, with a message that names the field (issue 19, item 4f)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from moe_fx.config import MoEConfig

# field -> (values of the wrong type: TypeError, values of the right type but bad: ValueError, good values)
CASES = {
    "kernel": ([1, None, b"auto"], ["cublas", ""], ["auto", "reference", "triton", "deepgemm"]),
    "quantize": ([8, True], ["int8", "FP8"], [None, "fp8"]),
    "verify": ([False, None], ["sometimes"], ["auto", "always", "never"]),
    "verify_max_flops": (["big", None, True, [1.0]], [math.nan, math.inf, -1.0, 0], [1, 2e10, 1e3]),
    "enabled": (["no", 0, 1, None], [], [True, False]),
    "ep_group": ([3, 1.5, ["default"]], [""], [None, "default", "tp0"]),
    "max_tokens_per_rank": (["8", 8.0, True, None], [0, -4], [1, 128]),
    "eplb": (["yes", 1, None], [], [True, False]),
    "eplb_redundant_slots": (["2", 2.0, False], [-1], [0]),  # > 0 needs eplb=True: below
    "eplb_interval": ([None, 1.5], [-3], [0]),
    "inductor_options": ([None, [("a", 1)], {1: True}], [], [{}, {"max_autotune": True}]),
}


def test_every_field_has_a_check_and_a_case():
    """A field added to MoEConfig must say how it is checked (its metadata) and be covered here."""
    names = {f.name for f in dataclasses.fields(MoEConfig)}
    assert all("check" in f.metadata for f in dataclasses.fields(MoEConfig))
    assert names == set(CASES), f"add the new MoEConfig field(s) {names ^ set(CASES)} to CASES"


@pytest.mark.parametrize("name", sorted(CASES))
def test_field_is_validated_at_construction(name):
    wrong_type, bad_value, good = CASES[name]
    for value in wrong_type:
        with pytest.raises(TypeError, match=rf"MoEConfig\.{name}\b"):
            MoEConfig(**{name: value})
    for value in bad_value:
        with pytest.raises(ValueError, match=rf"MoEConfig\.{name}\b"):
            MoEConfig(**{name: value})
    for value in good:
        assert getattr(MoEConfig(**{name: value}), name) == value


def test_a_process_group_object_is_accepted():
    class FakeGroup:  # what the check reads of a ProcessGroup
        group_name = "0"

    group = FakeGroup()
    assert MoEConfig(ep_group=group).ep_group is group


def test_options_that_need_a_flag_say_so():
    for name in ("eplb_redundant_slots", "eplb_interval"):
        with pytest.raises(ValueError, match=rf"MoEConfig\.{name}=2 needs eplb=True"):
            MoEConfig(**{name: 2})
        assert getattr(MoEConfig(eplb=True, **{name: 2}), name) == 2
