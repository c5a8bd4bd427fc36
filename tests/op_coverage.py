"""The op coverage database: every public function of ``mindspore.ops``, ``mindspore.mint``
and ``mindspore.mint.nn.functional`` and every ``mindspore.nn`` layer, with a sample
input, checked under fshard's four transforms (in the spirit of PyTorch's OpInfo).

For each op, ``sample(name)`` finds arguments it runs on eagerly on the CPU: an explicit
builder from ``EXPLICIT`` / ``LAYERS`` where the defaults do not fit, otherwise the first
of a list of default argument forms (one float tensor; two; a tensor and an axis; a square
matrix; an image batch; ...) that eager MindSpore accepts. Then ``check(name)`` compares:

- ``jit``: ``fs.jit(f)(*xs)`` against eager MindSpore ``f(*xs)``;
- ``grad``: ``fs.grad`` against ``mindspore.grad`` of a weighted sum of the floating
  outputs, with respect to the floating inputs;
- ``vmap``: ``fs.vmap(f)`` over two examples against a loop of eager calls, stacked;
- ``shard``: ``fs.shard(f)`` on a virtual mesh of 2, each input split along its first
  axis where that divides, against the unsharded result.

``classify(name)`` is the cheap part: how fshard traces the op (``native``: fshard's own
primitives; ``generic``: MindSpore's primitive as one equation, named; ``refused``:
fshard raises, with why). ``docs/gen_ops.py`` writes the table of ``docs/ops.md`` from
``sweep()``; ``tests/test_op_coverage.py`` checks it.
"""

from __future__ import annotations

import inspect
import signal
import warnings
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

import fshard as fs
from fshard.errors import FshardError

CHECKS = ("jit", "grad", "vmap", "shard")
TIMEOUT = 60  # seconds per check; a check that takes longer is recorded, not waited for
MESH_SIZE = 2

# ---------------------------------------------------------------------------
# Enumeration
# ---------------------------------------------------------------------------

_MODULES = (("ops", ops), ("mint", mint), ("mint.nn.functional", mint.nn.functional))


def _public_functions(module) -> list[str]:
    out = []
    for n in dir(module):
        if n.startswith("_"):
            continue
        v = getattr(module, n)
        if callable(v) and not inspect.isclass(v) and not inspect.ismodule(v):
            out.append(n)
    return sorted(out)


# Containers, wrappers, training cells, optimizers, learning-rate schedules and
# metrics: not layers of a model.
_NOT_LAYERS = ("Cell", "SequentialCell", "CellList", "CellDict", "GraphCell",
               "ForwardValueAndGrad", "GetNextSingleOp", "DistributedGradReducer",
               "PipelineCell", "PipelineGradReducer", "MicroBatchInterleaved",
               "GradAccumulationCell", "WithEvalCell", "WithGradCell", "WithLossCell",
               "ParameterUpdate", "TimeDistributed", "DataWrapper", "Partial")
_NOT_LAYER_BASES = tuple(getattr(nn, b) for b in (
    "Optimizer", "LearningRateSchedule", "TrainOneStepCell", "TrainOneStepWithLossScaleCell",
    "LossBase", "Metric", "DynamicLossScaleUpdateCell", "FixedLossScaleUpdateCell")
    if hasattr(nn, b))


def layer_names() -> list[str]:
    out = []
    for n in dir(nn):
        v = getattr(nn, n)
        if not (inspect.isclass(v) and issubclass(v, nn.Cell)) or n in _NOT_LAYERS:
            continue
        if issubclass(v, _NOT_LAYER_BASES) and not issubclass(v, nn.LossBase):
            continue
        out.append(n)
    return sorted(out)


def op_names() -> list[str]:
    """Every op of the database, as ``module.name`` (``nn.`` for layers)."""
    names = [f"{prefix}.{n}" for prefix, m in _MODULES for n in _public_functions(m)]
    return names + [f"nn.{n}" for n in layer_names()]


def resolve(name: str):
    prefix, _, attr = name.rpartition(".")
    module = {"ops": ops, "mint": mint, "mint.nn.functional": mint.nn.functional,
              "nn": nn}[prefix]
    return getattr(module, attr)


# ---------------------------------------------------------------------------
# Ops left out on purpose (never called: they have effects outside the value)
# ---------------------------------------------------------------------------

_COLLECTIVE = ("all_gather", "all_reduce", "all_to_all", "barrier", "batch_isend_irecv",
               "broadcast", "gather_into_tensor", "irecv", "isend", "recv", "reduce",
               "reduce_scatter", "scatter_tensor", "send", "get_rank", "get_group_size",
               "matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul")


# Helpers of MindSpore's graph compiler over Python lists, tuples and scalars (some crash
# the process when given a tensor).
_INTERNAL = ("list_", "tuple_", "scalar_", "string_", "dict_", "sequence_", "make_",
             "bool_", "int_", "is_sequence", "environ_", "env_", "is_dynamic_sequence",
             "ms_", "prim_")
_INTERNAL_NAMES = ("in_dict", "not_in_dict", "switch", "switch_layer", "geswitch", "op_info",
                   "iter_converter", "zip_operation", "hastype", "is_", "is_not",
                   "isconstant", "mixed_precision_cast", "reduced_shape", "shape_mul",
                   "array_to_scalar", "get_vm_impl_fn", "kernel", "partial", "merge",
                   "embed", "ref_to_embed", "distribute", "typeof", "tail",
                   "op_info_register", "custom_info_register")


def excluded(name: str) -> str | None:
    """Why ``name`` is not called at all (None: it is)."""
    short = name.rpartition(".")[2]
    low = short.lower()
    if short in ("broadcast_to",):
        return None
    if any(low == c or low.startswith(c + "_") or low.endswith("_" + c) for c in _COLLECTIVE):
        return "a collective: it needs a launched job (docs/collectives.md)"
    if low in ("print_", "tensor_dump", "hook", "add_flags", "constexpr", "j", "grad",
               "value_and_grad", "vjp", "jvp", "vmap", "jacfwd", "jacrev", "derivative",
               "jet", "custom_info_register", "jit_forbidden_register",
               "jit_view_unsupported", "stop_gradient", "depend", "hook_fn",
               "insert_gradient_of", "item", "tolist", "move_to", "sync_stream",
               "deprecated", "print", "tensordump", "dump"):
        return "not a tensor op (a transform, decorator or side effect)"
    if low.startswith(("coo_", "csr_", "row_tensor", "dense_to_sparse", "sparse_")):
        return "a sparse-tensor op (COOTensor, CSRTensor, RowTensor): fshard traces dense tensors"
    if low.startswith(_INTERNAL) or low in _INTERNAL_NAMES:
        return "an internal helper of MindSpore's graph compiler, not a tensor op"
    if low in ("empty", "empty_like"):
        return "uninitialised values: nothing to compare"
    if "dump" in low or "summary" in low:
        return "not a tensor op (a side effect)"
    return None


# ---------------------------------------------------------------------------
# Sample inputs
# ---------------------------------------------------------------------------

_RNG = np.random.default_rng(0)


def _u(*shape, lo=0.2, hi=0.8):
    return Tensor(_RNG.uniform(lo, hi, shape).astype(np.float32))


X = _u(4, 6)          # in (0.2, 0.8): inside the domain of log, sqrt, acos, atanh, erfinv...
Y = _u(4, 6)
Z = _u(4, 6)
V = _u(6)
V4 = _u(4)
M = Tensor((np.eye(4) * 2 + 0.1 * _RNG.uniform(-1, 1, (4, 4))).astype(np.float32))
SPD = Tensor((lambda a: (a @ a.T + 4 * np.eye(4)).astype(np.float32))(
    _RNG.uniform(-1, 1, (4, 4))))
B3 = _u(2, 4, 6)      # a batch of matrices
IMG = _u(2, 4, 8, 8)  # (N, C, H, W)
SEQ = _u(2, 4, 8)     # (N, C, L)
VOL = _u(2, 4, 4, 4, 4)
IDX = Tensor(np.array([2, 0, 3], np.int32))
IDX64 = Tensor(np.array([2, 0, 3], np.int64))
LABELS = Tensor(np.array([1, 0, 5, 2], np.int32))
MASK = Tensor(_RNG.uniform(0, 1, (4, 6)) > 0.5)


@dataclass
class Sample:
    """``fn(*args)``: the call to check; ``args`` the tensors the transforms see."""
    fn: object
    args: tuple
    note: str = ""

    def fresh(self) -> tuple:
        """Copies of ``args``: an op may write into its operands (``assign_add``)."""
        return tuple(_copy(a) for a in self.args)


def _copy(a):
    return Tensor(_np(a).copy()) if isinstance(a, Tensor) else a


def _s(fn, *args, note=""):
    return lambda op: Sample(lambda *a: fn(op, *a), args, note)


# Default argument forms, tried in order: the first that eager MindSpore accepts.
DEFAULTS = (
    _s(lambda op, x: op(x), X),
    _s(lambda op, x, y: op(x, y), X, Y),
    _s(lambda op, x: op(x, 1), X),
    _s(lambda op, x: op(x, 0.5), X),
    _s(lambda op, x, y, z: op(x, y, z), X, Y, Z),
    _s(lambda op, m: op(m), SPD),
    _s(lambda op, m, y: op(m, y), SPD, X),
    _s(lambda op, x: op(x), IMG),
    _s(lambda op, x: op(x, 2), IMG),
    _s(lambda op, x: op(x), SEQ),
    _s(lambda op, x: op(x, 2), SEQ),
    _s(lambda op, x: op(x), VOL),
    _s(lambda op, x: op(x, 2), VOL),
    _s(lambda op, x: op(x, (4, 6)), X),
    _s(lambda op, x: op(x), V),
    _s(lambda op, x, y: op(x, y), V, V),
    _s(lambda op, x, y: op(x, y), X, V),
    _s(lambda op, x, y: op(x, y), B3, _u(2, 6, 3)),
    _s(lambda op, x: op([x, x * 2]), X),
    _s(lambda op, x, y: op(x, LABELS), X),
)

# Ops the defaults get wrong or cannot reach: name -> builder(op) -> Sample.
EXPLICIT = {
    "ops.gather": _s(lambda op, x: op(x, IDX, 0), X),
    "ops.gather_d": _s(lambda op, x: op(x, 1, Tensor(np.array([[0, 2]] * 4, np.int32))), X),
    "ops.gather_elements": _s(
        lambda op, x: op(x, 1, Tensor(np.array([[0, 2]] * 4, np.int32))), X),
    "ops.index_select": _s(lambda op, x: op(x, 0, IDX), X),
    "mint.index_select": _s(lambda op, x: op(x, 0, IDX64), X),
    "mint.gather": _s(lambda op, x: op(x, 1, Tensor(np.array([[0, 2]] * 4, np.int64))), X),
    "ops.reshape": _s(lambda op, x: op(x, (6, 4)), X),
    "mint.reshape": _s(lambda op, x: op(x, (6, 4)), X),
    "ops.transpose": _s(lambda op, x: op(x, (1, 0)), X),
    "ops.permute": _s(lambda op, x: op(x, (1, 0)), X),
    "mint.permute": _s(lambda op, x: op(x, (1, 0)), X),
    "ops.broadcast_to": _s(lambda op, x: op(x, (3, 4, 6)), X),
    "mint.broadcast_to": _s(lambda op, x: op(x, (3, 4, 6)), X),
    "ops.tile": _s(lambda op, x: op(x, (2, 1)), X),
    "mint.tile": _s(lambda op, x: op(x, (2, 1)), X),
    "ops.split": _s(lambda op, x: op(x, 2, 1), X),
    "mint.split": _s(lambda op, x: op(x, 2, 1), X),
    "ops.matmul": _s(lambda op, x, y: op(x, y), X, _u(6, 3)),
    "mint.matmul": _s(lambda op, x, y: op(x, y), X, _u(6, 3)),
    "mint.mm": _s(lambda op, x, y: op(x, y), X, _u(6, 3)),
    "ops.mm": _s(lambda op, x, y: op(x, y), X, _u(6, 3)),
    "mint.bmm": _s(lambda op, x, y: op(x, y), B3, _u(2, 6, 3)),
    "ops.bmm": _s(lambda op, x, y: op(x, y), B3, _u(2, 6, 3)),
    "ops.batch_matmul": _s(lambda op, x, y: op(x, y), B3, _u(2, 6, 3)),
    "ops.dense": _s(lambda op, x, w, b: op(x, w, b), X, _u(3, 6), _u(3)),
    "mint.nn.functional.linear": _s(lambda op, x, w, b: op(x, w, b), X, _u(3, 6), _u(3)),
    "ops.cross_entropy": _s(lambda op, x: op(x, LABELS), X),
    "mint.nn.functional.cross_entropy": _s(lambda op, x: op(x, LABELS.astype(ms.int64)), X),
    "ops.nll_loss": _s(lambda op, x: op(x, LABELS), X),
    "mint.nn.functional.nll_loss": _s(lambda op, x: op(x, LABELS.astype(ms.int64)), X),
    "ops.one_hot": _s(lambda op: op(LABELS, 6, Tensor(1.0), Tensor(0.0))),
    "ops.masked_fill": _s(lambda op, x: op(x, MASK, -1.0), X),
    "ops.where": _s(lambda op, x, y: op(MASK, x, y), X, Y),
    "mint.where": _s(lambda op, x, y: op(MASK, x, y), X, Y),
    "ops.select": _s(lambda op, x, y: op(MASK, x, y), X, Y),
    "ops.conv2d": _s(lambda op, x, w: op(x, w), IMG, _u(3, 4, 3, 3)),
    "mint.nn.functional.conv2d": _s(lambda op, x, w: op(x, w), IMG, _u(3, 4, 3, 3)),
    "ops.conv1d": _s(lambda op, x, w: op(x, w), SEQ, _u(3, 4, 3)),
    "ops.conv3d": _s(lambda op, x, w: op(x, w), VOL, _u(3, 4, 2, 2, 2)),
    "ops.max_pool2d": _s(lambda op, x: op(x, 2), IMG),
    "ops.avg_pool2d": _s(lambda op, x: op(x, 2), IMG),
    "ops.adaptive_avg_pool2d": _s(lambda op, x: op(x, (2, 2)), IMG),
    "ops.layer_norm": _s(lambda op, x, w, b: op(x, (6,), w, b), X, _u(6), _u(6)),
    "mint.nn.functional.layer_norm": _s(lambda op, x, w, b: op(x, (6,), w, b), X, _u(6), _u(6)),
    "ops.group_norm": _s(lambda op, x: op(x, 2), IMG),
    "mint.nn.functional.group_norm": _s(lambda op, x: op(x, 2), IMG),
    "ops.batch_norm": _s(lambda op, x, m, v, w, b: op(x, m, v, w, b), X * 1, V, V, V, V),
    "mint.nn.functional.batch_norm": _s(lambda op, x, m, v, w, b: op(x, m, v, w, b),
                                        X * 1, V, V, V, V),
    "ops.interpolate": _s(lambda op, x: op(x, size=(4, 4), mode="bilinear"), IMG),
    "mint.nn.functional.interpolate": _s(lambda op, x: op(x, size=(4, 4), mode="bilinear"),
                                         IMG),
    "ops.scatter_nd": _s(lambda op, u: op(Tensor(np.array([[1], [3]], np.int32)), u, (4, 6)),
                         _u(2, 6)),
    "ops.tensor_scatter_add": _s(
        lambda op, x, u: op(x, Tensor(np.array([[1], [3]], np.int32)), u), X, _u(2, 6)),
    "ops.gather_nd": _s(lambda op, x: op(x, Tensor(np.array([[1, 2], [3, 0]], np.int32))), X),
    "ops.narrow": _s(lambda op, x: op(x, 1, 1, 3), X),
    "mint.narrow": _s(lambda op, x: op(x, 1, 1, 3), X),
    "ops.pad": _s(lambda op, x: op(x, (1, 2)), X),
    "mint.nn.functional.pad": _s(lambda op, x: op(x, (1, 2)), X),
    "ops.roll": _s(lambda op, x: op(x, 1, 0), X),
    "mint.roll": _s(lambda op, x: op(x, 1, 0), X),
    "ops.topk": _s(lambda op, x: op(x, 2), X),
    "mint.topk": _s(lambda op, x: op(x, 2), X),
    "ops.repeat_interleave": _s(lambda op, x: op(x, 2, 1), X),
    "mint.repeat_interleave": _s(lambda op, x: op(x, 2, 1), X),
    "ops.flip": _s(lambda op, x: op(x, (0,)), X),
    "mint.flip": _s(lambda op, x: op(x, (0,)), X),
    "ops.stack": _s(lambda op, x, y: op([x, y], 1), X, Y),
    "mint.stack": _s(lambda op, x, y: op([x, y], 1), X, Y),
    "ops.cat": _s(lambda op, x, y: op([x, y], 1), X, Y),
    "ops.concat": _s(lambda op, x, y: op([x, y], 1), X, Y),
    "mint.cat": _s(lambda op, x, y: op([x, y], 1), X, Y),
    "mint.concat": _s(lambda op, x, y: op([x, y], 1), X, Y),
    "ops.einsum": _s(lambda op, x, y: op("ij,kj->ik", x, y), X, Y),
    "mint.einsum": _s(lambda op, x, y: op("ij,kj->ik", x, y), X, Y),
    "ops.softmax": _s(lambda op, x: op(x, 1), X),
    "ops.log_softmax": _s(lambda op, x: op(x, 1), X),
    "mint.softmax": _s(lambda op, x: op(x, 1), X),
    "mint.nn.functional.softmax": _s(lambda op, x: op(x, 1), X),
    "mint.nn.functional.log_softmax": _s(lambda op, x: op(x, 1), X),
    "ops.cumsum": _s(lambda op, x: op(x, 1), X),
    "ops.cumprod": _s(lambda op, x: op(x, 1), X),
    "mint.cumsum": _s(lambda op, x: op(x, 1), X),
    "mint.cumprod": _s(lambda op, x: op(x, 1), X),
    "ops.addmm": _s(lambda op, c, a, b: op(c, a, b), X, _u(4, 3), _u(3, 6)),
    "mint.addmm": _s(lambda op, c, a, b: op(c, a, b), X, _u(4, 3), _u(3, 6)),
    "ops.addbmm": _s(lambda op, c, a, b: op(c, a, b), X, _u(2, 4, 3), _u(2, 3, 6)),
    "mint.addbmm": _s(lambda op, c, a, b: op(c, a, b), X, _u(2, 4, 3), _u(2, 3, 6)),
    "ops.baddbmm": _s(lambda op, c, a, b: op(c, a, b), B3, _u(2, 4, 3), _u(2, 3, 6)),
    "mint.baddbmm": _s(lambda op, c, a, b: op(c, a, b), B3, _u(2, 4, 3), _u(2, 3, 6)),
    "ops.addmv": _s(lambda op, c, a, v: op(c, a, v), V4, X, V),
    "mint.addmv": _s(lambda op, c, a, v: op(c, a, v), V4, X, V),
    "ops.addr": _s(lambda op, c, a, b: op(c, a, b), X, V4, V),
    "ops.addcdiv": _s(lambda op, a, b, c: op(a, b, c, Tensor(0.5)), X, Y, Z),
    "ops.addcmul": _s(lambda op, a, b, c: op(a, b, c, Tensor(0.5)), X, Y, Z),
    "mint.addcdiv": _s(lambda op, a, b, c: op(a, b, c, value=0.5), X, Y, Z),
    "mint.addcmul": _s(lambda op, a, b, c: op(a, b, c, value=0.5), X, Y, Z),
    "ops.cross": _s(lambda op, a, b: op(a, b, 1), _u(4, 3), _u(4, 3)),
    "mint.cross": _s(lambda op, a, b: op(a, b, 1), _u(4, 3), _u(4, 3)),
    "ops.conv_transpose2d": _s(lambda op, x, w: op(x, w), IMG, _u(4, 3, 3, 3)),
    "ops.embedding": _s(lambda op, w: op(LABELS, w), _u(8, 3)),
    "mint.nn.functional.embedding": _s(lambda op, w: op(LABELS.astype(ms.int64), w), _u(8, 3)),
    "ops.expand": _s(lambda op, x: op(x[:1], Tensor(np.array([3, 6], np.int32))), X),
    "ops.fmin": _s(lambda op, x, y: op(x, y), X, Y),
    "ops.index_add": _s(lambda op, x, y: op(x, IDX, y, 0), X, _u(3, 6)),
    "ops.index_fill": _s(lambda op, x: op(x, 0, IDX, 1.5), X),
    "ops.matrix_band_part": _s(lambda op, x: op(x, 1, 2), X),
    "ops.moveaxis": _s(lambda op, x: op(x, 0, 2), B3),
    "ops.movedim": _s(lambda op, x: op(x, 0, 2), B3),
    "ops.rms_norm": _s(lambda op, x, g: op(x, g), X, V),
    "ops.rot90": _s(lambda op, x: op(x, 1, (0, 1)), X),
    "ops.scatter": _s(lambda op, x, u: op(x, 0, Tensor(np.array([[1, 3, 0]], np.int64)), u),
                      X, _u(1, 3)),
    "ops.scatter_add": _s(lambda op, x, u: op(x, Tensor(np.array([1, 3], np.int32)), u),
                          X, _u(2, 6)),
    "ops.select_scatter": _s(lambda op, x, u: op(x, u, 0, 1), X, V),
    "ops.slice": _s(lambda op, x: op(x, (1, 0), (2, 3)), X),
    "ops.strided_slice": _s(lambda op, x: op(x, (0, 1), (4, 6), (2, 2)), X),
    "ops.swapaxes": _s(lambda op, x: op(x, 0, 1), X),
    "ops.swapdims": _s(lambda op, x: op(x, 0, 1), X),
    "ops.take": _s(lambda op, x: op(x, Tensor(np.array([0, 7, 23], np.int64))), X),
    "ops.tensor_dot": _s(lambda op, x, y: op(x, y, ((1,), (1,))), X, Y),
    "ops.threshold": _s(lambda op, x: op(x, 0.5, -1.0), X),
    "ops.unsorted_segment_sum": _s(lambda op, x: op(x, Tensor(np.array([0, 2, 0, 1], np.int32)),
                                                     3), X),
    "ops.unsorted_segment_max": _s(lambda op, x: op(x, Tensor(np.array([0, 2, 0, 1], np.int32)),
                                                     3), X),
    "ops.reverse": _s(lambda op, x: op(x, (0,)), X),
    "ops.renorm": _s(lambda op, x: op(x, 2, 0, 1.0), X),
    "ops.tensor_scatter_mul": _s(
        lambda op, x, u: op(x, Tensor(np.array([[1], [3]], np.int32)), u), X, _u(2, 6)),
    "ops.tensor_scatter_sub": _s(
        lambda op, x, u: op(x, Tensor(np.array([[1], [3]], np.int32)), u), X, _u(2, 6)),
    "ops.tensor_scatter_div": _s(
        lambda op, x, u: op(x, Tensor(np.array([[1], [3]], np.int32)), u), X, _u(2, 6)),
    "ops.tensor_scatter_max": _s(
        lambda op, x, u: op(x, Tensor(np.array([[1], [3]], np.int32)), u), X, _u(2, 6)),
    "ops.tensor_scatter_min": _s(
        lambda op, x, u: op(x, Tensor(np.array([[1], [3]], np.int32)), u), X, _u(2, 6)),
    "ops.tensor_scatter_update": _s(
        lambda op, x, u: op(x, Tensor(np.array([[1], [3]], np.int32)), u), X, _u(2, 6)),
    "ops.tensor_scatter_elements": _s(
        lambda op, x, u: op(x, Tensor(np.array([[1, 3, 0]], np.int32)), u, 0), X, _u(1, 3)),
    "ops.multi_margin_loss": _s(lambda op, x: op(x, LABELS.astype(ms.int64)), X),
    "ops.soft_margin_loss": _s(lambda op, x, y: op(x, y), X, Y),
    "ops.triplet_margin_loss": _s(lambda op, a, p, n: op(a, p, n), X, Y, Z),
    "ops.cosine_embedding_loss": _s(
        lambda op, a, b: op(a, b, Tensor(np.array([1, -1, 1, -1], np.int32))), X, Y),
    "ops.mse_loss_ext": _s(lambda op, x, y: op(x, y), X, Y),
    "ops.lp_pool2d": _s(lambda op, x: op(x, 2, 2), IMG),
    "ops.lp_pool1d": _s(lambda op, x: op(x, 2, 2), SEQ),
    "ops.quantile": _s(lambda op, x: op(x, 0.3, 1), X),
    "ops.nanquantile": _s(lambda op, x: op(x, 0.3, 1), X),
    "ops.diagonal_scatter": _s(lambda op, x, u: op(x, u), X, V4),
    "ops.matrix_exp": _s(lambda op, m: op(m), M),
    "ops.grid_sample": _s(lambda op, x, g: op(x, g, align_corners=False), IMG,
                          _u(2, 3, 3, 2, lo=-0.9, hi=0.9)),
    "ops.fold": _s(lambda op, x: op(x, Tensor(np.array([4, 4], np.int32)), 2, stride=2),
                   _u(2, 8, 4)),
    "ops.unfold": _s(lambda op, x: op(x, 2, stride=2), IMG),
    "ops.mirror_pad": _s(lambda op, x: op(x, Tensor(np.array([[1, 1], [2, 2]], np.int32)),
                                          "REFLECT"), X),
    "ops.matrix_set_diag": _s(lambda op, x, d: op(x, d), X, V4),
    "ops.crop_and_resize": _s(lambda op, x: op(
        x, Tensor(np.array([[0.1, 0.1, 0.8, 0.9]], np.float32)), Tensor(np.array([1], np.int32)),
        (3, 3)), _u(2, 8, 8, 4)),
    "ops.clamp": _s(lambda op, x: op(x, 0.3, 0.6), X),
    "ops.clip": _s(lambda op, x: op(x, 0.3, 0.6), X),
    "mint.clamp": _s(lambda op, x: op(x, 0.3, 0.6), X),
    "mint.clip": _s(lambda op, x: op(x, 0.3, 0.6), X),
}

# nn layers: name -> (constructor arguments, inputs).
LAYERS = {
    "Dense": ((6, 3), (X,)),
    "Conv1d": ((4, 3, 3), (SEQ,)),
    "Conv2d": ((4, 3, 3), (IMG,)),
    "Conv3d": ((4, 3, 2), (VOL,)),
    "Conv1dTranspose": ((4, 3, 3), (SEQ,)),
    "Conv2dTranspose": ((4, 3, 3), (IMG,)),
    "Conv3dTranspose": ((4, 3, 2), (VOL,)),
    "MaxPool1d": ((2, 2), (SEQ,)),
    "MaxPool2d": ((2, 2), (IMG,)),
    "MaxPool3d": ((2, 2), (VOL,)),
    "AvgPool1d": ((2, 2), (SEQ,)),
    "AvgPool2d": ((2, 2), (IMG,)),
    "AvgPool3d": ((2, 2), (VOL,)),
    "AdaptiveAvgPool1d": ((2,), (SEQ,)),
    "AdaptiveAvgPool2d": (((2, 2),), (IMG,)),
    "AdaptiveAvgPool3d": (((2, 2, 2),), (VOL,)),
    "AdaptiveMaxPool1d": ((2,), (SEQ,)),
    "AdaptiveMaxPool2d": (((2, 2),), (IMG,)),
    "AdaptiveMaxPool3d": (((2, 2, 2),), (VOL,)),
    "BatchNorm1d": ((6,), (X,)),
    "BatchNorm2d": ((4,), (IMG,)),
    "BatchNorm3d": ((4,), (VOL,)),
    "GroupNorm": ((2, 4), (IMG,)),
    "InstanceNorm1d": ((4,), (SEQ,)),
    "InstanceNorm2d": ((4,), (IMG,)),
    "InstanceNorm3d": ((4,), (VOL,)),
    "LayerNorm": (((6,),), (X,)),
    "PReLU": ((), (X,)),
    "MultiheadAttention": ((6, 2), (B3, B3 * 1, B3 * 1)),
    "TransformerEncoderLayer": ((6, 2, 8), (B3,)),
    "TransformerDecoderLayer": ((6, 2, 8), (B3, B3 * 1)),
    "TransformerEncoder": ("encoder", (B3,)),
    "TransformerDecoder": ("decoder", (B3, B3 * 1)),
    "Transformer": ((6, 2, 1, 1, 8), (B3, B3 * 1)),
    "LSTM": ((6, 5), (B3,)),
    "GRU": ((6, 5), (B3,)),
    "RNN": ((6, 5), (B3,)),
    "LSTMCell": ((6, 5), (X,)),
    "GRUCell": ((6, 5), (X,)),
    "RNNCell": ((6, 5), (X,)),
    "Embedding": ((8, 3), (LABELS,)),
    "Flatten": ((), (IMG,)),
    "Unflatten": ((1, (2, 3)), (X,)),
    "Upsample": (("size", (4, 4)), (IMG,)),
    "PixelShuffle": ((2,), (IMG,)),
    "PixelUnshuffle": ((2,), (IMG,)),
    "BiDense": ((6, 6, 3), (X, Y)),
    "Bilinear": ((6, 6, 3), (X, Y)),
}

_LAYER_DEFAULT_CTORS = ((), (6,), (4,), (2,), (6, 3))
_LAYER_DEFAULT_INPUTS = ((X,), (IMG,), (SEQ,), (B3,), (X, Y), (VOL,))


def _layer(name: str, cls) -> Sample:
    ms.set_seed(0)
    if name in LAYERS:
        ctor, inputs = LAYERS[name]
        if ctor == "encoder":
            cell = cls(nn.TransformerEncoderLayer(6, 2, 8, dropout=0.0), 1)
        elif ctor == "decoder":
            cell = cls(nn.TransformerDecoderLayer(6, 2, 8, dropout=0.0), 1)
        elif len(ctor) == 2 and ctor[0] == "size":
            cell = cls(size=ctor[1], mode="bilinear")
        else:
            cell = cls(*ctor)
        cands = [(cell, inputs)]
    else:
        cands = []
        for ctor in _LAYER_DEFAULT_CTORS:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cell = cls(*ctor)
            except Exception:  # noqa: BLE001  (probing: the next form may fit)
                continue
            cands += [(cell, inputs) for inputs in _LAYER_DEFAULT_INPUTS]
            break
    first = None
    for cell, inputs in cands:
        cell.set_train(False)  # dropout off; BatchNorm uses its moving statistics
        s = Sample(lambda *a, c=cell: c(*a), tuple(inputs))
        err = _runs(s)
        if err is None:
            return s
        first = first or err
    raise _NoSample(first or "no constructor form fits")


class _NoSample(Exception):
    pass


def _runs(s: Sample) -> str | None:
    """None if eager MindSpore computes ``s``, else the first line of its error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = s.fn(*s.fresh())
        leaves = _leaves(out)
        if not any(isinstance(t, Tensor) for t in leaves):
            return "returns no tensor"
        for t in leaves:
            if isinstance(t, Tensor):
                t.asnumpy()
    except Exception as e:  # noqa: BLE001  (probing)
        return _first_line(e)
    return None


def sample(name: str) -> Sample:
    """Arguments ``name`` runs on eagerly; raises ``_NoSample`` with MindSpore's reason."""
    op = resolve(name)
    if name.startswith("nn."):
        return _layer(name[3:], op)
    cands = [EXPLICIT[name]] if name in EXPLICIT else list(DEFAULTS)
    errors = []
    for build in cands:
        s = build(op)
        err = _runs(s)
        if err is None:
            return s
        errors.append(err)
    raise _NoSample(_telling(errors))


_ARITY = ("missing", "positional argument", "number of input", "takes ", "inputs number",
          "input number", "Expects ")


def _telling(errors: list) -> str:
    """The error that says most about why an op does not run: a missing kernel rather
    than a wrong number of arguments."""
    for e in errors:
        if "unregistered" in e or "not supported" in e or "kernel" in e.lower():
            return e
    return next((e for e in errors if not any(a in e for a in _ARITY)), errors[0])


# ---------------------------------------------------------------------------
# Comparing values
# ---------------------------------------------------------------------------


def _leaves(out) -> list:
    if isinstance(out, (tuple, list)):
        return [leaf for o in out for leaf in _leaves(o)]
    return [out]


def _np(t):
    return t.asnumpy() if isinstance(t, Tensor) else np.asarray(t)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    return f"{type(e).__name__}: {text}"[:160]


def _float(t) -> bool:
    return isinstance(t, Tensor) and t.dtype in (ms.float16, ms.float32, ms.float64,
                                                  ms.bfloat16)


def compare(got, want, what: str) -> str | None:
    """None if equal (floats to a tolerance scaled to the values), else how they differ."""
    g, w = _leaves(got), _leaves(want)
    if len(g) != len(w):
        return f"{what}: {len(g)} outputs, MindSpore {len(w)}"
    for i, (a, b) in enumerate(zip(g, w)):
        if not isinstance(b, Tensor):
            if isinstance(a, Tensor) or a != b:
                return f"{what}: output {i} is {a!r}, MindSpore {b!r}"
            continue
        a, b = _np(a), _np(b)
        if a.shape != b.shape:
            return f"{what}: output {i} has shape {a.shape}, MindSpore {b.shape}"
        if a.dtype != b.dtype:
            return f"{what}: output {i} has dtype {a.dtype}, MindSpore {b.dtype}"
        if b.dtype.kind in "fc":
            fin = np.isfinite(b)
            scale = max(1.0, float(np.max(np.abs(b[fin]), initial=0.0)))
            if not np.allclose(a, b, rtol=1e-4, atol=1e-5 * scale, equal_nan=True):
                err = float(np.nanmax(np.abs(a - b))) if a.size else 0.0
                return f"{what}: output {i} differs (max abs error {err:.3g})"
        elif not np.array_equal(a, b):
            return f"{what}: output {i} differs"
    return None


# ---------------------------------------------------------------------------
# The four checks
# ---------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _guarded(fn):
    """``fn()`` -> "pass" / "fail: ..." / "n/a: ...", never raising, within TIMEOUT."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except _Timeout:
        return f"fail: timed out after {TIMEOUT} s"
    except FshardError as e:
        return f"fail: {_first_line(e)}"
    except Exception as e:  # noqa: BLE001  (a raw MindSpore/Python error is a finding)
        return f"fail: raw {_first_line(e)}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _verdict(diff: str | None) -> str:
    return "pass" if diff is None else f"fail: wrong {diff}"


def check_jit(s: Sample) -> str:
    return _guarded(lambda: _verdict(compare(fs.jit(s.fn)(*s.fresh()), s.fn(*s.fresh()), "jit")))


def _weights(out) -> list:
    rng = np.random.default_rng(1)
    return [Tensor(rng.uniform(0.5, 1.5, t.shape).astype(_np(t).dtype)) if _float(t) else None
            for t in _leaves(out)]


# Where MindSpore's own gradient is wrong (fshard's is checked against finite differences
# in tests/test_native_ops.py): name -> why.
MINDSPORE_GRAD_WRONG = {
    "ops.kl_div": "MindSpore's KLDivLoss bprop gives the labels no gradient",
    "ops.selu": "MindSpore's SeLU bprop is wrong for x < 0",
    "mint.nn.functional.selu": "MindSpore's SeLU bprop is wrong for x < 0",
    "nn.KLDivLoss": "MindSpore's KLDivLoss bprop gives the labels no gradient",
    "nn.SoftmaxCrossEntropyWithLogits": "MindSpore's bprop assumes each row of labels sums "
                                        "to 1 (the sample's do not)",
    "ops.logit": "MindSpore's eager LogitGrad returns NaN in some sweeps, after other ops "
                 "ran in the process (fshard's matched 1/(x(1-x)) to 7e-7 there)",
}


def check_grad(s: Sample, name: str = "") -> str:
    if name in MINDSPORE_GRAD_WRONG:
        return f"n/a: {MINDSPORE_GRAD_WRONG[name]} (checked against differences elsewhere)"
    pos = tuple(i for i, a in enumerate(s.args) if _float(a))
    if not pos:
        return "n/a: no floating input"
    want_out = s.fn(*s.fresh())
    ws = _weights(want_out)
    if not any(w is not None for w in ws):
        return "n/a: no floating output"

    def loss(*a):
        outs = _leaves(s.fn(*a))
        return sum((o * w).sum() for o, w in zip(outs, ws) if w is not None)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = ms.grad(loss, grad_position=pos)(*s.fresh())
        for t in _leaves(want):
            _np(t)
    except Exception as e:  # noqa: BLE001
        return f"n/a: mindspore.grad fails ({_first_line(e)})"
    return _guarded(lambda: _verdict(compare(fs.grad(loss, argnums=pos)(*s.fresh()), want,
                                             "grad")))


def _second(a: Tensor) -> Tensor:
    """A second example: the elements reversed (same domain; a symmetric matrix stays
    symmetric positive definite)."""
    return Tensor(np.ascontiguousarray(np.flip(_np(a))))


def check_vmap(s: Sample) -> str:
    pos = [i for i, a in enumerate(s.args) if _float(a)]
    if not pos:
        return "n/a: no floating input"
    xs = list(s.fresh())
    ex2 = [(_second(a) if i in pos else a) for i, a in enumerate(s.args)]
    for i in pos:
        xs[i] = Tensor(np.stack([_np(s.args[i]), _np(ex2[i])]))
    in_axes = tuple(0 if i in pos else None for i in range(len(xs)))

    def run():
        outs = [_leaves(s.fn(*s.fresh())), _leaves(s.fn(*[_copy(a) for a in ex2]))]
        if not all(isinstance(t, Tensor) for t in outs[0]):
            return "n/a: an output is not a tensor"
        want = [Tensor(np.stack([_np(a), _np(b)])) for a, b in zip(*outs)]
        got = fs.vmap(s.fn, in_axes=in_axes)(*xs)
        return _verdict(compare(got, want, "vmap"))

    return _guarded(run)


def check_shard(s: Sample) -> str:
    tensors = [i for i, a in enumerate(s.args) if isinstance(a, Tensor)]
    if not tensors:
        return "n/a: no tensor input"
    strategy = []
    for a in s.args:
        shape = tuple(a.shape)
        split = len(shape) >= 1 and shape[0] % MESH_SIZE == 0
        strategy.append(((MESH_SIZE,) + (1,) * (len(shape) - 1)) if split
                        else (1,) * len(shape))
    mesh = fs.Mesh((MESH_SIZE,), ("d",))

    def run():
        want = s.fn(*s.fresh())
        got = fs.shard(s.fn, in_strategy=tuple(strategy), mesh=mesh)(*s.fresh())
        return _verdict(compare(got, want, "shard"))

    return _guarded(run)


_CHECKERS = {"jit": check_jit, "grad": check_grad, "vmap": check_vmap, "shard": check_shard}


# ---------------------------------------------------------------------------
# Classification (cheap: one trace) and the whole row
# ---------------------------------------------------------------------------

_DESIGNED = ("stateful MindSpore random op", "output shape that depends")


def _ms_ops(program, out: list) -> None:
    for eq in program.equations:
        if eq.prim.name == "ms_op":
            name = eq.params["fn"].call.name.replace("functional.", "")
            if name not in out:
                out.append(name)
        for v in eq.params.values():
            subs = v if isinstance(v, tuple) else (v,)
            for p in subs:
                if hasattr(p, "equations"):
                    _ms_ops(p, out)


def classify(s: Sample) -> tuple[str, str]:
    """("native" | "generic" | "refused", detail) from one trace of ``s``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = fs.make_ir(s.fn)(*s.fresh()).program
    except FshardError as e:
        return "refused", _first_line(e)
    except Exception as e:  # noqa: BLE001
        return "refused", f"raw {_first_line(e)}"
    names: list = []
    _ms_ops(program, names)
    if names:
        return "generic", ", ".join(names)
    return "native", ""


@dataclass
class Row:
    name: str
    status: str              # native / generic / refused / not run
    detail: str = ""         # generic: MindSpore ops; refused / not run: why
    counted: bool = False    # runs eagerly on CPU with a floating input
    checks: dict = field(default_factory=dict)  # check -> "pass" / "fail: ..." / "n/a: ..."

    @property
    def passes(self) -> bool:
        return self.counted and all(not c.startswith("fail") for c in self.checks.values())


def _random(s: Sample) -> bool:
    """Whether two eager calls on the same inputs differ (a random op)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compare(s.fn(*s.fresh()), s.fn(*s.fresh()), "") is not None


def row(name: str, checks=CHECKS) -> Row:
    why = excluded(name)
    if why is not None:
        return Row(name, "not run", why)
    try:
        s = sample(name)
    except _NoSample as e:
        return Row(name, "not run", f"no sample input runs eagerly on CPU ({e.args[0]})")
    status, detail = classify(s)
    r = Row(name, status, detail, counted=any(_float(a) for a in s.args))
    if _random(s):
        if status == "refused":
            r.counted = False
            r.detail = "random: refused by design (docs/random.md)"
        else:  # a draw traced once would be frozen into the program
            r.checks = {c: "fail: random, not refused (a traced draw is frozen)" for c in checks}
        return r
    if not r.counted:
        r.detail = (r.detail + "; " if r.detail else "") + "no floating input"
        return r
    if status == "refused":
        for c in checks:
            r.checks[c] = "fail: refused"
        if any(d in detail for d in _DESIGNED):
            r.counted = False  # refused by design (docs/random.md, docs/ops.md#limits)
            r.checks = {}
            r.detail = "by design, not counted: " + detail
        return r
    for c in checks:
        r.checks[c] = check_grad(s, name) if c == "grad" else _CHECKERS[c](s)
    return r
