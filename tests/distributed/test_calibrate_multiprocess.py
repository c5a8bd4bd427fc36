"""``fs.sharding.calibrate()`` in a real 2-process job: every rank measures the job's
compute and MindSpore's collectives between the processes, keeps rank 0's numbers (the
ranks must plan alike), caches a job table of its own, and the job's plans are priced
with it (``explain``)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fshard import launch

pytestmark = pytest.mark.full  # a launched job

HERE = os.path.dirname(os.path.abspath(__file__))
NUMBERS = ("call_s", "op_s", "arg_s", "flops_per_s", "matmul_c", "matmul_p", "point_s")


def test_calibrate_in_a_job_measures_the_job_and_every_rank_keeps_one_table(tmp_path):
    result = launch.run(os.path.join(HERE, "calibration_checks.py"), 2, [str(tmp_path)],
                        timeout=600)
    assert result.ok, result.message + "\n" + "\n".join(result.output(r)[-3000:]
                                                        for r in range(2))
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for out in outs:
        assert "devices=3" in out["refused"] and "job of 2 processes" in out["refused"]
        assert "Fix:" in out["refused"]
        table = out["table"]
        assert table["devices"] == 2 and table["lanes"] is False
        assert set(table["all_reduce"]) == set(table["all_gather"]) == {"2"}
        assert table["flops_per_s"] > 0 and table["point_s"] > 0 and table["op_s"] >= 0
        assert out["saved"].endswith("-job2.json") and out["exists"]
        # priced with the job's table: the call's own cost counts (the default rates
        # have none)
        assert out["default_call_s"] == 0.0 and out["call_s"] > 0.0
        assert out["predicted_s"] > 0 and out["measured_s"] > 0
    a, b = (o["table"] for o in outs)
    for k in NUMBERS:
        assert a[k] == b[k], k
    assert a["all_reduce"] == b["all_reduce"] and a["all_gather"] == b["all_gather"]
    # the measured matmul sizes too: the ranks price every plan alike
    assert a["matmul_points"] == b["matmul_points"] and len(a["matmul_points"]) >= 2
    assert a["adam_points"] == b["adam_points"] and len(a["adam_points"]) == 2
    assert a["matmul_elem_s"] == b["matmul_elem_s"] > 0
    # AutoParallel's sharding_propagation in the job: three paths (greedy propagation,
    # following the inputs, computing everything whole), the lowest priced taken; it
    # trains as one device does on the global batch
    for out in outs:
        assert out["job_model"] is True
        assert out["chosen"] == min(out["paths"])
        # the step runs the plan priced: computed whole, only the batch is gathered
        # (the same kinds of collective: a job buckets the step's AllReduces)
        assert set(out["collectives"]) == set(out["picked_collectives"])
        if out["chosen"] == out["paths"][2] < min(out["paths"][:2]):
            # (the rows and the targets: one bucket where the job's AllGather latency
            # makes it worth it)
            assert out["collectives"] in (["all_gather"], ["all_gather", "all_gather"])
        np.testing.assert_allclose(out["losses"], out["one_device"], rtol=1e-5)
        # explain prices the check of the processes' slices every call makes
        assert 0 < out["checks_s"] < 0.1
        # in a job AllReduces are bucketed by default: one for the loss and both
        # gradients, explained so; off, three; the same numbers either way
        fused, off = out["fusion"]["default"], out["fusion"]["off"]
        # (as many merged as the job's measured AllReduce latency makes worth it: all
        # three at this machine's usual 0.5 ms, none where a busy run fits it to ~0)
        assert off["collectives"] == ["psum"] * 3 and off["fused"] == 0 == off["fusion_s"]
        assert fused["collectives"] == ["psum"] * (3 - fused["fused"])
        assert fused["explained_collectives"] == 3 - fused["fused"]
        assert (fused["fusion_s"] < 0) == (fused["fused"] > 0)
        assert fused["losses"] == off["losses"] and fused["w0"] == off["w0"]
        np.testing.assert_allclose(fused["losses"], out["one_device"], rtol=1e-5)
        # fs.shard too: its value_and_grad's three AllReduces in one bucket, the numbers
        # the unsharded ones
        sf = out["shard_fusion"]
        assert sf["collectives"] == ["psum"] * (3 - sf["fused"]), sf
        np.testing.assert_allclose(*sf["value"], rtol=1e-5)
        assert sf["grads_close"]
        # and its AllGathers: rows, int32 and int64 labels in one bucket, exact
        gf = out["gather_fusion"]
        assert gf["collectives"] == ["all_gather"] * (3 - gf["fused"]), gf
        assert gf["exact"], gf
        # recursive_programming on a whole batch: never priced above computing
        # everything whole (semi_auto's plan, no collective), the one-device numbers
        wb = out["whole_batch"]
        assert wb["semi_auto"]["collectives"] == []
        assert wb["recursive_programming"]["price"] <= \
            wb["semi_auto"]["price"] * (1 + 1e-9), wb
        for mode in ("semi_auto", "recursive_programming"):
            np.testing.assert_allclose(wb[mode]["losses"], wb["one_device"], rtol=1e-5)
    assert outs[0]["collectives"] == outs[1]["collectives"]
    assert outs[0]["chosen"] == outs[1]["chosen"]
    print("paths:", outs[0]["paths"], "collectives:", outs[0]["collectives"])
    print("predicted / measured step:", [o["predicted_s"] / o["measured_s"] for o in outs])
