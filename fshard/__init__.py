"""fshard: composable function transformations for MindSpore.

``jit``, ``vmap``, the ``grad`` family and ``shard``, built on a trace-then-rewrite
interpreter: a function written with ``mindspore.ops``, Tensor operators or
``nn.Cell``s is traced into fshard's IR, rewritten, and evaluated or lowered to a
MindSpore GRAPH-mode program.

>>> import fshard as fs
"""

from fshard import debug as debug
from fshard.meshes import distributed as distributed
from fshard.core import dtypes as dtypes
from fshard import errors as errors
from fshard.adapter import interop as _interop  # noqa: F401  (MindSpore code traces: see staging)
from fshard import ops as ops
from fshard.core import rules as rules
from fshard.adapter import tensor_methods as _tensor_methods  # noqa: F401  (Tracer operators)
from fshard.core import tree as tree
from fshard.adapter.cells import functional as functional
from fshard.core.tracing import ArrayType as ArrayType
from fshard.core.tracing import Symbol as Symbol
from fshard.core.tracing import typeof as typeof
from fshard.errors import (  # noqa: F401
    ArgumentError as ArgumentError,
    CheckpointError as CheckpointError,
    AxisNameError as AxisNameError,
    BatchingError as BatchingError,
    CompositionError as CompositionError,
    DifferentiationError as DifferentiationError,
    DistributedError as DistributedError,
    FshardError as FshardError,
    GenericOpWarning as GenericOpWarning,
    KeyReuseWarning as KeyReuseWarning,
    MissingRuleError as MissingRuleError,
    OperatorStrategyWarning as OperatorStrategyWarning,
    PipelineBalanceWarning as PipelineBalanceWarning,
    ProgramTypeError as ProgramTypeError,
    ShapeError as ShapeError,
    ProcessLocalError as ProcessLocalError,
    ShardingError as ShardingError,
    TracerConversionError as TracerConversionError,
    TracerLeakError as TracerLeakError,
    UnsupportedDtypeError as UnsupportedDtypeError,
    UnsupportedOpError as UnsupportedOpError,
)
from fshard.core.ir import verify as verify
from fshard.meshes.layout import Layout as Layout
from fshard.meshes.mesh import Mesh as Mesh
from fshard.sharding.local import RemoteArray as RemoteArray
from fshard.sharding.local import ShardedArray as ShardedArray
from fshard.sharding.local import gather_sharded as gather_sharded
from fshard.sharding.placement import block_until_ready as block_until_ready
from fshard.sharding.placement import device_put as device_put
from fshard.sharding.user_layouts import with_sharding_constraint as with_sharding_constraint
from fshard.transforms.eval_shape import eval_shape as eval_shape
from fshard.primitives.collectives import (  # noqa: F401
    all_gather as all_gather,
    all_to_all as all_to_all,
    axis_index as axis_index,
    broadcast as broadcast,
    pmax as pmax,
    pmean as pmean,
    pmin as pmin,
    ppermute as ppermute,
    psum as psum,
    psum_scatter as psum_scatter,
)
from fshard.primitives.control import custom_jvp as custom_jvp
from fshard.primitives.control import custom_vjp as custom_vjp
from fshard.primitives.pipeline import pipeline_split as pipeline_split
from fshard.primitives.structural import stop_gradient as stop_gradient
from fshard.core.staging import make_ir as make_ir
from fshard.transforms.sharded_jit import jit as jit
from fshard.transforms.jit import disable_jit as disable_jit
from fshard.transforms.ad import grad as grad
from fshard.transforms.ad import hessian as hessian
from fshard.transforms.ad import jacfwd as jacfwd
from fshard.transforms.ad import jacrev as jacrev
from fshard.transforms.ad import jvp as jvp
from fshard.transforms.ad import linearize as linearize
from fshard.transforms.ad import value_and_grad as value_and_grad
from fshard.transforms.ad import vjp as vjp
from fshard.transforms.remat import remat as remat
from fshard.transforms.remat import remat_policies as remat_policies
from fshard.primitives.remat import checkpoint_name as checkpoint_name
from fshard.transforms.shard import shard as shard
from fshard.transforms.shard_map import shard_map as shard_map
from fshard.transforms.vmap import vmap as vmap
from fshard.transforms.control_flow import (  # noqa: F401
    cond as cond,
    fori_loop as fori_loop,
    scan as scan,
    switch as switch,
    while_loop as while_loop,
)
from fshard.meshes.visualize import visualize_sharding as visualize_sharding
from fshard.profiling import profile as profile  # noqa: E402  (tools layer)
from fshard import nn as nn  # noqa: E402
from fshard import random as random  # noqa: E402
from fshard.training import optim as optim  # noqa: E402  (training layer: above the transforms)
from fshard.training import checkpoint as checkpoint  # noqa: E402
from fshard.training import amp as amp  # noqa: E402
from fshard.training import parallel as parallel  # noqa: E402
from fshard.training.parallel import AutoParallel as AutoParallel  # noqa: E402
from fshard.training.parallel import Model as Model  # noqa: E402
from fshard.training.parallel import TrainState as TrainState  # noqa: E402

# The public modules keep their short dotted paths now that they live in the layer
# folders: ``from fshard.optim import adam``, ``import fshard.tree`` and ``from
# fshard.parallel.ms_optimizers import from_mindspore`` still work (one module object
# under two names, so state and isinstance checks are shared; a package's submodules
# are all imported by now, so none is ever loaded twice under the short name).
import sys as _sys  # noqa: E402

for _name, _module in (("dtypes", dtypes), ("tree", tree), ("rules", rules),
                       ("distributed", distributed), ("optim", optim),
                       ("checkpoint", checkpoint), ("amp", amp), ("parallel", parallel)):
    _real = _module.__name__
    for _sub in [m for m in _sys.modules if m == _real or m.startswith(_real + ".")]:
        _sys.modules.setdefault(f"fshard.{_name}{_sub[len(_real):]}", _sys.modules[_sub])
del _sys, _name, _module, _real, _sub

__version__ = "0.1.0"
