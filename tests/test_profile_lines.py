"""The equations a transform creates keep the line of the user's code they come from
(the backward pass of fs.grad, fs.vmap's batched forms), so ``fs.profile``'s
``by_line`` gives each line's forward-plus-backward time."""

import numpy as np

import fshard as fs

W1 = np.ones((8, 16), np.float32) * 0.1
W2 = np.ones((16, 4), np.float32) * 0.1
X = np.ones((5, 8), np.float32)


def loss(w1, w2, x):
    h = fs.ops.tanh(x @ w1)  # LINE_A
    y = fs.ops.relu(h @ w2)  # LINE_B
    return (y * y).sum()  # LINE_C


def _line(tag: str) -> str:
    with open(__file__) as fh:
        n = next(i for i, s in enumerate(fh, 1) if s.rstrip().endswith("# " + tag))
    return f"test_profile_lines.py:{n}"


def _sources(program):
    out: dict = {}
    for eq in program.equations:
        out[eq.source] = out.get(eq.source, 0) + 1
    return out


def test_backward_equations_keep_the_forward_lines():
    src = _sources(fs.make_ir(fs.grad(loss, argnums=(0, 1)))(W1, W2, X).program)
    a, b, c = _line("LINE_A"), _line("LINE_B"), _line("LINE_C")
    # forward and backward of each line: matmul, tanh / relu and their transposes
    assert src.get(a, 0) >= 4 and src.get(b, 0) >= 4 and src.get(c, 0) >= 2, src
    assert sum(src.values()) - src[a] - src[b] - src[c] <= 3, src  # the seed


def test_vmap_and_profile_by_line():
    per_example = fs.vmap(fs.grad(loss), in_axes=(None, None, 0))
    src = _sources(fs.make_ir(per_example)(W1, W2, X).program)
    assert src.get(_line("LINE_A"), 0) >= 4, src
    p = fs.profile(fs.grad(loss), repeat=1, compiled=False)(W1, W2, X)
    lines = p.by_line()
    assert _line("LINE_A") in lines and _line("LINE_B") in lines
    assert abs(sum(lines.values()) - p.eager_seconds) <= 1e-9 * max(1.0, p.eager_seconds)
