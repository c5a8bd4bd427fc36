"""``fs.eval_shape``: the types of a function's outputs, found by tracing it (NB:
``jax.eval_shape``). Nothing runs: the function is staged on abstract inputs and the
Program's output types are read.
"""

from __future__ import annotations

from fshard.core import tree
from fshard.adapter.cells import maybe_cell
from fshard.core.tracing import typeof
from fshard.core.staging import check_function, trace_fun


def eval_shape(fun, *args, **kwargs):
    """The output types (``fs.ArrayType``: ``.shape``, ``.dtype``) of ``fun(*args,
    **kwargs)``, in the output's pytree structure, without computing anything.

    >>> import numpy as np, mindspore, fshard as fs
    >>> x = fs.ArrayType((128, 784), mindspore.float32)   # no data needed
    >>> w = np.zeros((784, 10), np.float32)              # or any array
    >>> out = fs.eval_shape(lambda x, w: {"logits": x @ w, "n": x.sum()}, x, w)
    >>> out["logits"].shape, out["logits"].dtype, str(out["n"])
    ((128, 10), mindspore.float32, 'f32[]')

    Args:
        fun: a function of pytrees of arrays, or an ``nn.Cell`` (its parameters are
            read, not run).
        *args: the arguments; each array leaf may be an ``fs.ArrayType``, any object
            with ``shape`` and ``dtype`` attributes (a ``jax.ShapeDtypeStruct``, a NumPy
            array, a MindSpore Tensor), or a Python scalar.
        **kwargs: keyword arguments, the same.

    Returns:
        the pytree ``fun`` returns, each array an ``fs.ArrayType``.

    See also: ``fs.make_ir`` (the whole traced program), ``fs.typeof``.
    """
    check_function("fs.eval_shape", fun)

    def types(f):
        def run(*a, **k):
            leaves, in_tree = tree.flatten((a, k))
            traced = trace_fun(f, in_tree, [typeof(x) for x in leaves])
            return tree.unflatten(traced.out_tree, traced.program.out_avals)

        return run

    return maybe_cell(fun, types)(*args, **kwargs)
