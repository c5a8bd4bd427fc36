"""Every primitive, declared once with all of its rules, by family."""

from fshard.primitives import elementwise, linalg, nn, reductions, structural  # noqa: F401
from fshard.primitives import scans  # noqa: F401
from fshard.primitives import conv  # noqa: F401
from fshard.primitives import spmd  # noqa: F401
from fshard.primitives import collectives  # noqa: F401
from fshard.primitives import pipeline  # noqa: F401
from fshard.primitives import generic  # noqa: F401
from fshard.primitives import optimizers  # noqa: F401
from fshard.primitives import control  # noqa: F401  (after the families its rules use)
from fshard.primitives import remat  # noqa: F401  (on control's call helpers)
from fshard.core.rules import all_primitives as all_primitives
