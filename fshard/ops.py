"""fshard's op functions: one per primitive (plus a few composites), the base layer
that tracing of native MindSpore code maps onto. They accept Tracers, MindSpore
Tensors, NumPy arrays and Python scalars, with MindSpore's promotion and NumPy
broadcasting.

>>> import numpy as np, fshard as fs
>>> fs.ops.add(np.float32(1), 2.0)
Tensor(shape=[], dtype=Float32, value= 3)
"""

from fshard.primitives.elementwise import (  # noqa: F401
    abs as abs,
    add as add,
    bitwise_and as bitwise_and,
    bitwise_or as bitwise_or,
    bitwise_xor as bitwise_xor,
    shift_left as shift_left,
    shift_right as shift_right,
    cast as cast,
    cos as cos,
    div as div,
    equal as equal,
    erf as erf,
    erfc as erfc,
    exp as exp,
    gelu as gelu,
    greater as greater,
    greater_equal as greater_equal,
    less as less,
    less_equal as less_equal,
    log as log,
    maximum as maximum,
    minimum as minimum,
    mul as mul,
    neg as neg,
    not_equal as not_equal,
    pow as pow,
    relu as relu,
    rsqrt as rsqrt,
    select as select,
    sigmoid as sigmoid,
    sign as sign,
    floor as floor,
    round as round,  # noqa: A004
    sin as sin,
    sqrt as sqrt,
    square as square,
    sub as sub,
    tanh as tanh,
    where as where,
    zeros_like as zeros_like,
)
from fshard.primitives.linalg import matmul as matmul  # noqa: F401
from fshard.primitives.nn import (  # noqa: F401
    bias_add as bias_add,
    layer_norm as layer_norm,
    log_softmax as log_softmax,
    logsumexp as logsumexp,
    softmax as softmax,
    softmax_cross_entropy as softmax_cross_entropy,
)
from fshard.primitives.reductions import (  # noqa: F401
    argmax as argmax,
    argmin as argmin,
    count as count,
    dim_size as dim_size,
    mean as mean,
    reduce_max as reduce_max,
    reduce_min as reduce_min,
    reduce_sum as reduce_sum,
)
from fshard.primitives.structural import (  # noqa: F401
    broadcast_to as broadcast_to,
    concat as concat,
    expand_dims as expand_dims,
    flatten as flatten,
    full as full,
    gather as gather,
    getitem as getitem,
    one_hot as one_hot,
    ones as ones,
    pad as pad,
    reshape as reshape,
    scatter_add as scatter_add,
    slice_array as slice_array,
    split as split,
    squeeze as squeeze,
    stack as stack,
    stop_gradient as stop_gradient,
    swapaxes as swapaxes,
    transpose as transpose,
    zeros as zeros,
)

sum = reduce_sum  # noqa: A001
max = reduce_max  # noqa: A001
min = reduce_min  # noqa: A001
