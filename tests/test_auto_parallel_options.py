"""``fs.AutoParallel``'s configuration: ``ParallelMode`` and the frozen ``ParallelOptions``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fshard as fs
from fshard.parallel import ParallelMode, ParallelOptions


def _loss(p, x, y):
    return ((x @ p["w"] - y) ** 2).mean()


def _ap(mode="semi_auto"):
    return fs.AutoParallel(_loss, fs.optim.sgd(0.1), mode, mesh=2)


@pytest.mark.parametrize("given", ["semi_auto", "sharding_propagation",
                                   "recursive_programming", *ParallelMode])
def test_the_mode_is_a_member_equal_to_its_string(given):
    ap = _ap(given)
    assert isinstance(ap.parallel_mode, ParallelMode)
    assert ap.parallel_mode == str(given) and ap.parallel_mode is ParallelMode(str(given))
    assert ap.options.mode is ap.parallel_mode
    assert repr(ap) == f"fs.AutoParallel(_loss, parallel_mode={str(given)!r})"
    assert f"{ap.parallel_mode}" == str(given)


def test_mindsporess_positional_mode_and_the_enum_both_leave_out_the_optimizer():
    for mode in ("sharding_propagation", ParallelMode.SHARDING_PROPAGATION):
        ap = fs.AutoParallel(_loss, mode)
        assert ap.optimizer is None and ap.parallel_mode is ParallelMode.SHARDING_PROPAGATION


@pytest.mark.parametrize("bad, fix", [
    ("semi_auto_parallel", "ms.set_auto_parallel_context's spelling; AutoParallel's is "
                           "'semi_auto'"),
    ("auto_parallel", "'sharding_propagation' or 'recursive_programming'"),
    ("SEMI_AUTO", "parallel_mode='semi_auto'"),
    (3, "parallel_mode='semi_auto'"),
])
def test_an_unknown_mode_names_the_argument_the_choices_and_a_fix(bad, fix):
    with pytest.raises(fs.ArgumentError) as info:
        _ap(bad)
    msg = str(info.value)
    assert msg.startswith("AutoParallel(parallel_mode=...) must be one of ('semi_auto', "
                          "'sharding_propagation', 'recursive_programming')")
    assert f"got {bad!r}" in msg and "\nFix: " in msg and fix in msg


def test_setting_the_mode_afterwards_is_checked():
    ap = _ap()
    ap.parallel_mode = "recursive_programming"
    assert ap.options.mode is ParallelMode.RECURSIVE_PROGRAMMING
    with pytest.raises(fs.ArgumentError, match="parallel_mode"):
        ap.parallel_mode = "recursive"  # was stored as given, planning nothing it names
    assert ap.parallel_mode is ParallelMode.RECURSIVE_PROGRAMMING


def test_the_options_are_frozen_and_a_refused_value_changes_nothing():
    ap = _ap().hsdp(threshold=0).comm_fusion({"allreduce": {"mode": "size", "config": 2}})
    before = ap.options
    with pytest.raises(dataclasses.FrozenInstanceError):
        ap.options.hsdp = None
    for call in (lambda: ap.hsdp(optimizer_level="level4"),
                 lambda: ap.hsdp(threshold=-1),
                 lambda: ap.comm_fusion({"allreduce": {"mode": "index", "config": None}}),
                 lambda: ap.gradient_accumulation(0),
                 lambda: ap.dataset_strategy("model_parallel"),
                 lambda: ap.dataset_strategy(None),
                 lambda: ap.parameter_plan([("w", (2, 1))]),
                 lambda: ap.dump_local_norm(3)):
        with pytest.raises(fs.ArgumentError, match=r"^AutoParallel\.[a-z_]+\(.*\nFix: "):
            call()
        assert ap.options is before
    assert before.fusion_bytes == 2 * 2**20 and before.hsdp.threshold_bytes == 0


def test_the_plan_is_copied_when_given():
    plan = {"w": (2, 1)}
    ap = _ap().parameter_plan(plan)
    plan["w"] = (1, 2)
    assert dict(ap.options.parameter_plan) == {"w": (2, 1)}


def test_options_made_directly_are_checked_the_same_way():
    assert ParallelOptions(mode="recursive_programming").mode is \
        ParallelMode.RECURSIVE_PROGRAMMING
    with pytest.raises(fs.ArgumentError, match=r"gradient_accumulation\(k\)"):
        ParallelOptions(gradient_accumulation=1.5)
    with pytest.raises(fs.ArgumentError, match="fusion_bytes"):
        ParallelOptions(fusion_bytes=-1)
    with pytest.raises(fs.ArgumentError, match="must be a bool"):
        ParallelOptions(fp32_communication="yes")


def test_the_string_and_the_member_train_the_same():
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    y = np.ones((4, 1), np.float32)
    out = []
    for mode in ("sharding_propagation", ParallelMode.SHARDING_PROPAGATION):
        ap = _ap(mode)
        state = ap.init({"w": np.zeros((3, 1), np.float32)})
        state, loss = ap(state, x, y)
        out.append((float(loss.asnumpy()), state.params["w"].asnumpy()))
    assert out[0][0] == out[1][0] and np.array_equal(out[0][1], out[1][1])
