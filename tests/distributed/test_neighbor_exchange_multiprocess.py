"""MindSpore's ops.NeighborExchangeV2 in a real 4-process job (a 2x2 grid of ranks),
against a NumPy reference: each rank's output is its window of the global image,
widened by the halos it receives; ops.NeighborExchange on a ring of the 4 ranks; ranks
that receive nothing (they still take part), asymmetric sends, uneven blocks, and the
errors raised on every rank. The refusals that need no job are in
tests/test_ms_collectives.py."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from fshard import launch

pytestmark = pytest.mark.full  # a launched job

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _window(rank, recv_ids, recv_lens, H, W, G):
    """The part of the global image ``G`` that rank ``rank``'s output covers: its
    block, widened by ``recv_lens`` on each side that has a neighbour."""
    i, j = divmod(rank, 2)
    top = recv_lens[0] if recv_ids[0] != -1 else 0
    bottom = recv_lens[1] if recv_ids[4] != -1 else 0
    left = recv_lens[2] if recv_ids[6] != -1 else 0
    right = recv_lens[3] if recv_ids[2] != -1 else 0
    return (slice(i * H - top, (i + 1) * H + bottom), slice(j * W - left, (j + 1) * W + right))


def test_neighbor_exchange_v2_on_a_2x2_grid_of_ranks(tmp_path):
    from neighbor_exchange_checks import (
        RECV_LENS,
        C,
        G,
        H,
        N,
        W,
        block,
        grid_ids,
        tensor_a,
        tensor_b,
        weights,
    )

    result = launch.run(os.path.join(HERE, "neighbor_exchange_checks.py"), 4,
                        [str(tmp_path)], timeout=600)
    assert result.ok, result.message + "\n" + "\n".join(result.output(r)[-3000:]
                                                        for r in range(4))
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    # the gradient of the job's total loss sum_r <out_r, weights_r>: each rank's
    # weights land on the part of the image its output covered
    dG = np.zeros_like(G)
    for r, out in enumerate(outs):
        rows, cols = _window(r, grid_ids(r), RECV_LENS, H, W, G)
        want = G[:, :, rows, cols]
        np.testing.assert_array_equal(np.array(out["grid"]), want, err_msg=f"rank {r}")
        np.testing.assert_array_equal(np.array(out["after"]), want, err_msg=f"rank {r}")
        np.testing.assert_array_equal(np.array(out["cell"]), 2 * want, err_msg=f"rank {r}")
        dG[:, :, rows, cols] += weights(want.shape, r)
    for r, out in enumerate(outs):
        i, j = divmod(r, 2)
        want = dG[:, :, i * H:(i + 1) * H, j * W:(j + 1) * W]
        np.testing.assert_allclose(np.array(out["grad"]), want, rtol=1e-6, atol=1e-6,
                                   err_msg=f"rank {r}")
    # ranks 0 and 1 swap columns (rank 0 sends 3 to the right, rank 1 sends 2 to the
    # left); 2 and 3 keep theirs
    top = G[:, :, :H]
    np.testing.assert_array_equal(np.array(outs[0]["pair"]), top[:, :, :, :W + 2])
    np.testing.assert_array_equal(np.array(outs[1]["pair"]), top[:, :, :, W - 3:])
    for r in (2, 3):
        np.testing.assert_array_equal(np.array(outs[r]["pair"]), block(r))
    assert (N, C) == np.array(outs[0]["grid"]).shape[:2]
    assert outs[0]["doc_example"] == [[[[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]]]
    assert outs[1]["doc_example"] == [[[[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]]]
    assert outs[2]["doc_example"] == [[[[3.0, 3.0], [3.0, 3.0]]]]
    for r, out in enumerate(outs):  # NeighborExchange on a ring, and its gradients
        np.testing.assert_array_equal(np.array(out["ring"][0]), tensor_a((r - 1) % 4))
        np.testing.assert_array_equal(np.array(out["ring"][1]), tensor_b((r + 2) % 4))
        # A_r went to r + 1, B_r to r + 2: their weights come back
        np.testing.assert_array_equal(np.array(out["ring_grad"][0]),
                                      weights(tensor_a(r).shape, (r + 1) % 4))
        np.testing.assert_array_equal(np.array(out["ring_grad"][1]),
                                      weights((3,), (r + 2) % 4))
        assert out["ring_shapes_differ"].startswith("ArgumentError"), out["ring_shapes_differ"]
        assert "rank 2 receives a [3, 2] tensor from rank 1, but rank 1 sends [2, 2]" in \
            out["ring_shapes_differ"]
        # ranks that receive nothing get None (MindSpore's shape inference), and still
        # take part: the others get what MindSpore's semantics give
        assert out["one_way"] == ([tensor_a(0).tolist()] if r == 1 else None), out["one_way"]
        assert out["one_way_beside"] == [tensor_a(0).tolist() if r == 1 else None,
                                         (2 * tensor_a(0)).tolist()]
        assert out["no_sender_ne"].startswith("ArgumentError"), out["no_sender_ne"]
        assert "rank 1 receives a [1, 2] tensor from rank 0, but rank 0 sends nothing" in \
            out["no_sender_ne"]
    # asymmetric sends: rank 0 sends P (2, 3) to rank 1 and Q (1,) to rank 3, rank 1
    # sends R (4,) to rank 0; rank 2 takes no part
    P = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    Q, R = np.array([7.5], np.float32), np.array([1, -2, 3, -4], np.float32)
    assert outs[0]["asym"] == [R.tolist()]
    assert outs[1]["asym"] == [P.tolist()]
    assert outs[2]["asym"] is None
    assert outs[3]["asym"] == [Q.tolist()]
    # NeighborExchangeV2 one way (rank 0's bottom row to rank 2), and its gradient: rank
    # 0 receives nothing, but gets rank 2's cotangent of the row it sent
    for r in (1, 3):
        np.testing.assert_array_equal(np.array(outs[r]["one_way_v2"]), block(r))
        np.testing.assert_array_equal(np.array(outs[r]["one_way_v2_grad"]),
                                      weights(block(r).shape, r))
    np.testing.assert_array_equal(np.array(outs[0]["one_way_v2"]), block(0))
    want2 = np.concatenate([block(0)[:, :, -1:], block(2)], axis=2)
    np.testing.assert_array_equal(np.array(outs[2]["one_way_v2"]), want2)
    np.testing.assert_array_equal(np.array(outs[2]["one_way_v2_grad"]),
                                  weights(want2.shape, 2)[:, :, 1:])
    want0 = weights(block(0).shape, 0)
    want0[:, :, -1:] += weights(want2.shape, 2)[:, :, :1]
    np.testing.assert_allclose(np.array(outs[0]["one_way_v2_grad"]), want0, rtol=1e-6,
                               atol=1e-6)
    # uneven blocks (rank 2 one row taller): rank 0 sends 2 rows down, rank 2 one up
    full = {r: np.full((N, C, H + (r == 2), W), r, np.float32) for r in range(4)}
    np.testing.assert_array_equal(np.array(outs[0]["uneven"]),
                                  np.concatenate([full[0], full[2][:, :, :1]], axis=2))
    np.testing.assert_array_equal(np.array(outs[2]["uneven"]),
                                  np.concatenate([full[0][:, :, -2:], full[2]], axis=2))
    for r in (1, 3):
        np.testing.assert_array_equal(np.array(outs[r]["uneven"]), full[r])
    for r, out in enumerate(outs):  # every rank raises the same error: no rank hangs
        # only the halos travel, so inputs may differ in shape where the pieces fit
        assert out["shapes_differ"].startswith("ArgumentError"), out["shapes_differ"]
        assert ("rank 2 receives its right piece from rank 3 as 4 x 1 (H x W; its recv_lens "
                "[2, 1, 2, 1]), but rank 3 sends 5 x 1 (its send_lens [1, 2, 1, 2], input "
                "(1, 2, 5, 5))") in out["shapes_differ"]
        assert out["dtype_differ"].startswith("ArgumentError"), out["dtype_differ"]
        assert "the ranks' inputs differ in dtype: rank(s) [3] hold another than rank 0" in \
            out["dtype_differ"]
        assert out["channels_differ"].startswith("ShapeError"), out["channels_differ"]
        assert ("rank 0 (input (1, 2, 4, 5)) receives its right piece from rank 1 (input "
                "(1, 3, 4, 5)), whose N and C differ") in out["channels_differ"]
        assert out["lens_differ"].startswith("ArgumentError"), out["lens_differ"]
        assert "rank 0 receives its bottom-right piece from rank 3 as 2 x 1" in out["lens_differ"]
        assert out["no_sender"].startswith("ArgumentError"), out["no_sender"]
        assert "rank 1 sends nothing to it" in out["no_sender"]
        assert out["corner"].startswith("ArgumentError"), out["corner"]
        assert "top-left corner (index 7)" in out["corner"]


@pytest.mark.parametrize("mode, n, refused, why", [
    ("one_way_grad", 2, [0], "differentiating it on rank 0, which sends tensors but "
     "receives nothing"),
    ("mute_grad", 3, [0, 1], "while rank(s) [2] send nothing"),
])
def test_differentiating_a_neighbor_exchange_that_could_not_come_back_is_refused(
        mode, n, refused, why):
    # (the ranks that differentiate it refuse; the launcher stops the others, which
    # would otherwise wait in the exchange)
    result = launch.run(os.path.join(HERE, "neighbor_exchange_checks.py"), n, [mode],
                        timeout=300)
    assert not result.ok
    # the first rank to refuse stops the job, perhaps before another one refuses
    texts = {r: result.output(r) for r in refused}
    said = [r for r, t in texts.items() if "UnsupportedOpError: ops.NeighborExchange" in t]
    assert said, "\n".join(t[-3000:] for t in texts.values())
    for r in said:
        assert why.replace("rank 0", f"rank {r}") in texts[r], texts[r][-3000:]
        assert "Fix: have every rank send and receive a tensor" in texts[r]
