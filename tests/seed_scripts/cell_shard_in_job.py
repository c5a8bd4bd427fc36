"""A Cell annotated by ``cell.shard``, called eagerly in a job (as seed 000's Net1 is):
it runs as ``fs.shard`` (MindSpore's own would compile it with its partitioner, which
refuses the CPU), with the numbers of the unsharded layer computed by NumPy."""

import numpy as np
import mindspore as ms
import fshard  # noqa: F401
from mindspore import nn
from mindspore.communication import init, get_group_size

init()
n = get_group_size()
dense = nn.Dense(32, 16)
w, b = dense.weight.asnumpy(), dense.bias.asnumpy()
dense.shard(in_strategy=((1, n),), parameter_plan={"weight": (1, n)})
x = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
out = dense(ms.Tensor(x)).asnumpy()
print("cell.shard eager max difference:", float(np.abs(out - (x @ w.T + b)).max()))
print("cell.shard eager runs in:", dense._shard_fn.__module__)
