"""Seed 000 (functional operator sharding): Net1, whose block1 is sharded in place by
``Cell.shard``, as written, with ``import fshard`` added (fshard's ``Cell.shard``); run on
a batch (the seed shows no training loop)."""

import numpy as np
import mindspore as ms
import fshard  # noqa: F401
from mindspore.communication import init
ms.set_context(mode=ms.PYNATIVE_MODE)
init()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.AUTO_PARALLEL,
                             search_mode="sharding_propagation", device_num=8)

import mindspore.nn as nn


class BasicBlock(nn.Cell):
    def __init__(self):
        super(BasicBlock, self).__init__()
        self.dense1 = nn.Dense(32, 32)
        self.gelu = nn.GELU()
        self.dense2 = nn.Dense(32, 32)

    def construct(self, x):
        # two dimensional input x
        x = self.dense1(x)
        x = self.gelu(x)
        x = self.dense2(x)
        return x


class Net(nn.Cell):
    def __init__(self):
        super(Net, self).__init__()
        self.block1 = BasicBlock()
        self.block2 = BasicBlock()
        self.block3 = BasicBlock()

    def construct(self, x):
        # All three blocks are executed as PyNative mode.
        x = self.block1(x)
        x = self.block2(x)
        x = self.block3(x)
        return x


class Net1(Net):
    def __init__(self):
        super(Net1, self).__init__()
        # slice input along the second axis and make output as data-parallel layout
        self.block1.shard(in_strategy=((1, 8),),
                          parameter_plan={'self.block1.dense2.weight': (8, 1)})

    def construct(self, x):
        # block1 is executed as GRAPH.
        x = self.block1(x)
        # block2 and block3 are executed as PyNative mode.
        x = self.block2(x)
        x = self.block3(x)
        return x


net = Net1()
x = ms.Tensor(np.random.default_rng(0).uniform(0, 1, (16, 32)), ms.float32)
out = net(x)
want = Net.construct(net, x)  # the same blocks, unsharded
print("Net1 max difference:", float(np.abs(out.asnumpy() - want.asnumpy()).max()))
