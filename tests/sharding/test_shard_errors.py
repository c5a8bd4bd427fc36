"""Golden messages of every ``fs.shard`` misuse: one test per rule.

Each message names the API and the function, the strategy and the value it describes
(argument name and type), the rule that was broken and a fix.
"""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import nn, ops

import fshard as fs

x = np.ones((32, 128), np.float32)
w = np.ones((128, 10), np.float32)
b = np.ones((10,), np.float32)
SEE = "See docs/errors.md#shardingerror"


def dense_relu(x, weight, bias):
    return ops.relu(ops.bias_add(ops.matmul(x, weight), bias))


def message(fn, cls=fs.ShardingError) -> str:
    with pytest.raises(cls) as info:
        fn()
    return str(info.value)


def call(in_strategy, *args, **kw):
    return lambda: fs.shard(dense_relu, in_strategy, mesh=8, **kw)(*(args or (x, w, b)))


def test_errors_are_value_errors():
    assert issubclass(fs.ShardingError, ValueError)
    assert issubclass(fs.CompositionError, ValueError)


# -- strategies ---------------------------------------------------------------


def test_strategy_of_the_wrong_rank():
    assert message(call(((4, 2, 1), None, None))) == (
        "shard(dense_relu): in_strategy[0] = (4, 2, 1) has 3 entries, but argument 'x' "
        "(f32[32,128]) has rank 2.\nRule: a strategy gives one split count per dimension.\n"
        f"Fix: give 2 split counts, e.g. (1, 1) for no split.\n{SEE}")


def test_in_strategy_of_the_wrong_length():
    assert message(call(((4, 2), None))) == (
        "shard(dense_relu): in_strategy has 2 entries, but dense_relu was called with 3 "
        "positional arguments.\nRule: in_strategy gives one strategy (or None) per "
        f"positional argument.\nFix: give 3 entries; None lets propagation choose.\n{SEE}")


def test_a_bare_strategy_for_one_argument():
    def double(x):
        return x * 2.0

    assert message(lambda: fs.shard(double, (4, 2), mesh=8)(x)) == (
        "shard(double): in_strategy has 2 entries, but double was called with 1 positional "
        "argument.\nRule: in_strategy gives one strategy (or None) per positional argument.\n"
        "Fix: give 1 entry; None lets propagation choose. For one argument, write "
        f"in_strategy=((4, 2),) (a tuple of strategies).\n{SEE}")


def test_in_strategy_that_is_not_a_tuple():
    assert message(lambda: fs.shard(dense_relu, "data")) == (
        "shard(dense_relu): in_strategy must be a tuple with one entry per positional "
        "argument; got str 'data'.\nFix: e.g. in_strategy=((4, 2), None, None).\n" + SEE)


def test_split_counts_exceeding_the_devices():
    assert message(call(((4, 4), None, None))) == (
        "shard(dense_relu): in_strategy[0] = (4, 4) splits argument 'x' (f32[32,128]) into "
        "16 blocks, but the mesh has only 8 devices.\nRule: the product of the split counts "
        "must divide the device count (the remaining factor holds replicas).\nFix: use split "
        "counts whose product is 1, 2, 4 or 8, or another mesh (fs.Mesh, mesh=N or "
        f"FSHARD_DEVICES).\n{SEE}")


def test_split_counts_not_dividing_the_devices():
    assert message(call(((3, 1), None, None))) == (
        "shard(dense_relu): in_strategy[0] = (3, 1) splits argument 'x' (f32[32,128]) into 3 "
        "blocks, which does not divide the 8 devices of the mesh.\nRule: the product of the "
        "split counts must divide the device count (the remaining factor holds replicas).\n"
        "Fix: use split counts whose product is 1, 2, 4 or 8, or another mesh (fs.Mesh, "
        f"mesh=N or FSHARD_DEVICES).\n{SEE}")


def test_dimension_not_divisible_by_its_split_count():
    x12, w12 = np.ones((32, 12), np.float32), np.ones((12, 10), np.float32)
    assert message(call(((1, 8), None, None), x12, w12, b)) == (
        "shard(dense_relu): in_strategy[0] = (1, 8) splits dimension 1 (size 12) of argument "
        "'x' (f32[32,12]) into 8 parts, but 12 is not divisible by 8.\nRule: every split "
        "dimension must be divisible by its split count; fshard never falls back to "
        f"replication.\nFix: split it into 1, 2 or 4 parts, or pad it to a multiple of 8.\n{SEE}")


@pytest.mark.parametrize("count,shown", [(2.0, "2.0 (float)"), ("2", "'2' (str)"),
                                         (True, "True (bool)")])
def test_non_integer_split_count(count, shown):
    assert message(call(((4, count), None, None))) == (
        f"shard(dense_relu): in_strategy[0] = (4, {count!r}) has the split count {shown} for "
        "dimension 1.\nRule: split counts are positive ints.\nFix: use 1 for a dimension "
        f"that is not split.\n{SEE}")


@pytest.mark.parametrize("count", [0, -2])
def test_non_positive_split_count(count):
    assert message(call(((count, 1), None, None))) == (
        f"shard(dense_relu): in_strategy[0] = ({count}, 1) has the split count {count} for "
        "dimension 0.\nRule: split counts are positive ints.\nFix: use 1 for a dimension "
        f"that is not split.\n{SEE}")


def test_layout_whose_device_matrix_does_not_match_the_mesh():
    layout = fs.Layout((2, 2), ("dp", "mp"))
    assert message(call((layout("dp", "mp"), None, None))) == (
        "shard(dense_relu): in_strategy[0] = Layout((2, 2), ('dp', 'mp'))('dp', 'mp') has a "
        "device matrix of 4 devices, but the mesh has 8.\nRule: the product of a Layout's "
        "device_matrix must equal the device count.\nFix: use a device matrix whose product "
        f"is 8, or a mesh of 4 devices.\n{SEE}")


def test_layout_view_of_the_wrong_rank():
    layout = fs.Layout((2, 4), ("dp", "mp"))
    assert message(call((layout("dp"), None, None))) == (
        "shard(dense_relu): in_strategy[0] = Layout((2, 4), ('dp', 'mp'))('dp') has 1 entry, "
        "but argument 'x' (f32[32,128]) has rank 2.\nRule: a Layout view gives one entry per "
        f"dimension.\nFix: give 2 entries ('None' for a dimension that is not split).\n{SEE}")


def test_layout_that_is_not_a_view():
    layout = fs.Layout((2, 4), ("dp", "mp"))
    assert message(call((layout, None, None))) == (
        "shard(dense_relu): in_strategy[0] = Layout((2, 4), ('dp', 'mp')) is a Layout, not a "
        "view of a tensor.\nFix: call it with one entry per dimension, e.g. layout('dp', "
        f"'None').\n{SEE}")


def test_layout_dimension_not_divisible():
    layout = fs.Layout((2, 4), ("dp", "mp"))
    x6 = np.ones((6, 128), np.float32)
    assert message(call((layout("mp", "None"), None, None), x6, w, b)) == (
        "shard(dense_relu): in_strategy[0] = Layout((2, 4), ('dp', 'mp'))('mp', 'None') "
        "splits dimension 0 (size 6) of argument 'x' (f32[6,128]) into 4 parts, but 6 is not "
        "divisible by 4.\nRule: every split dimension must be divisible by its split count; "
        "fshard never falls back to replication.\nFix: split it into 1 or 2 parts, or pad it "
        f"to a multiple of 4.\n{SEE}")


def test_data_parallel_batch_not_divisible():
    x12 = np.ones((12, 128), np.float32)
    assert message(call((None, (1, 1), (1,)), x12, w, b,
                        dataset_strategy="data_parallel")) == (
        "shard(dense_relu): dataset_strategy='data_parallel' makes each unannotated argument "
        "a batch slice per device, the strategy = (8, 1) splits dimension 0 (size 12) of "
        "argument 'x' (f32[12,128]) into 8 parts, but 12 is not divisible by 8.\nRule: every "
        "split dimension must be divisible by its split count; fshard never falls back to "
        f"replication.\nFix: split it into 1, 2 or 4 parts, or pad it to a multiple of 8.\n{SEE}")


# -- out_strategy --------------------------------------------------------------


def test_out_strategy_of_the_wrong_length():
    assert message(call(((4, 2), None, None), out_strategy=((8, 1), (8, 1)))) == (
        "shard(dense_relu): out_strategy has 2 entries, but dense_relu returns 1 array "
        "(f32[32,10]).\nRule: out_strategy gives one strategy per output.\nFix: give one "
        f"entry, e.g. out_strategy=((8, 1),), or None for the default layout.\n{SEE}")


def test_out_strategy_for_several_outputs_of_the_wrong_length():
    def two(x):
        return x + 1.0, x * 2.0

    assert message(lambda: fs.shard(two, ((8, 1),), out_strategy=((8, 1),) * 3, mesh=8)(x)) == (
        "shard(two): out_strategy has 3 entries, but two returns 2 outputs ('f32[32,128]', "
        "'f32[32,128]').\nRule: out_strategy gives one strategy per output.\nFix: give one "
        f"entry per output (None for the default layout of that output).\n{SEE}")


def test_out_strategy_of_the_wrong_rank():
    assert message(call(((4, 2), None, None), out_strategy=((8,),))) == (
        "shard(dense_relu): out_strategy = (8,) has 1 entry, but output 0 (f32[32,10]) has "
        "rank 2.\nRule: a strategy gives one split count per dimension.\nFix: give 2 split "
        f"counts, e.g. (1, 1) for no split.\n{SEE}")


# -- device, level, mesh, dataset_strategy ---------------------------------------


def test_device_that_is_not_available():
    assert message(lambda: fs.shard(dense_relu, ((4, 2), None, None), device="GPU")) == (
        "shard(dense_relu): device='GPU' is not available: MindSpore runs on 'CPU' here "
        "(mindspore.get_context('device_target')).\nFix: pass device='CPU' or None, or run "
        f"where GPU devices exist and call mindspore.set_device('GPU') first.\n{SEE}")


def test_unknown_device():
    assert message(lambda: fs.shard(dense_relu, ((4, 2), None, None), device="TPU")) == (
        "shard(dense_relu): device must be 'CPU', 'GPU', 'Ascend' or None; got 'TPU'.\nFix: "
        f"pass the device MindSpore runs on, or None to use it.\n{SEE}")


@pytest.mark.parametrize("level", [3, -1, "fast", True])
def test_unknown_level(level):
    assert message(lambda: fs.shard(dense_relu, ((4, 2), None, None), level=level)) == (
        "shard(dense_relu): level must be 0 (best compute/communication ratio), 1 (least "
        f"memory) or 2 (fastest); got {level!r}.\nFix: pass level=0, 1 or 2.\n{SEE}")


def test_unknown_dataset_strategy():
    assert message(lambda: fs.shard(dense_relu, ((4, 2), None, None),
                                    dataset_strategy="auto")) == (
        "shard(dense_relu): dataset_strategy must be 'full_batch' (inputs and outputs whole) "
        "or 'data_parallel' (inputs and outputs split along the batch); got 'auto'.\n" + SEE)


def test_invalid_mesh():
    assert message(lambda: fs.shard(dense_relu, ((4, 2), None, None), mesh="eight")) == (
        "shard(dense_relu): mesh must be an fs.Mesh, a positive device count, or None; got "
        f"str 'eight'.\nFix: mesh=8 or mesh=fs.Mesh((2, 4), ('dp', 'mp')).\n{SEE}")


def test_keyword_arguments():
    sharded = fs.shard(dense_relu, ((4, 2), None, None), mesh=8)
    assert message(lambda: sharded(x, w, bias=b)) == (
        "shard(dense_relu) was called with keyword arguments ['bias']; a sharded function "
        "takes its arrays positionally (one in_strategy entry each).\nFix: pass them "
        f"positionally.\n{SEE}")


# -- parameter_plan --------------------------------------------------------------


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(32, 32)
        self.dense2 = nn.Dense(32, 32)

    def construct(self, x):
        return self.dense2(self.dense1(x))


class Outer(nn.Cell):
    def __init__(self):
        super().__init__()
        self.block1 = Block()


def test_parameter_plan_key_that_names_no_parameter():
    block = Outer().block1
    assert message(lambda: fs.shard(block, ((8, 1),),
                                    parameter_plan={"self.block1.dense3.weight": (8, 1)})) == (
        "shard(Block): parameter_plan key 'self.block1.dense3.weight' names no parameter of "
        "the sharded Block.\nIts parameters (path inside the Cell, and MindSpore name) are: "
        "dense1.weight (block1.dense1.weight), dense1.bias (block1.dense1.bias), dense2.weight "
        "(block1.dense2.weight), dense2.bias (block1.dense2.bias).\nFix: use one of those "
        f"names, optionally prefixed with 'self.'.\n{SEE}")


def test_parameter_plan_naming_a_parameter_twice():
    block = Outer().block1
    assert message(lambda: fs.shard(block, ((8, 1),), parameter_plan={
        "dense2.weight": (8, 1), "block1.dense2.weight": (1, 8)})) == (
        "shard(Block): parameter_plan names the parameter 'dense2.weight' twice (as "
        f"'dense2.weight' and 'block1.dense2.weight').\nFix: keep one entry.\n{SEE}")


def test_parameter_plan_for_a_function():
    assert message(lambda: fs.shard(dense_relu, ((4, 2), None, None),
                                    parameter_plan={"weight": (1, 1)})) == (
        "shard(dense_relu): parameter_plan applies to the parameters of an nn.Cell, but "
        "dense_relu is a function.\nFix: pass the function's arrays as arguments and give "
        f"their strategies in in_strategy.\n{SEE}")


def test_parameter_plan_strategy_is_checked_against_the_parameter():
    block = Outer().block1
    sharded = fs.shard(block, ((8, 1),), parameter_plan={"dense2.weight": (3, 1)}, mesh=8)
    assert message(lambda: sharded(np.ones((8, 32), np.float32))) == (
        "shard(Block): parameter_plan['dense2.weight'] = (3, 1) splits parameter "
        "'dense2.weight' (f32[32,32]) into 3 blocks, which does not divide the 8 devices of "
        "the mesh.\nRule: the product of the split counts must divide the device count (the "
        "remaining factor holds replicas).\nFix: use split counts whose product is 1, 2, 4 or "
        f"8, or another mesh (fs.Mesh, mesh=N or FSHARD_DEVICES).\n{SEE}")


# -- composition -------------------------------------------------------------------


COMPOSE = "See docs/errors.md#compositionerror"


def test_vmap_of_shard_is_refused():
    sharded = fs.shard(dense_relu, ((4, 2), None, None), mesh=8)
    xs = np.ones((2, 32, 128), np.float32)
    assert message(lambda: fs.vmap(sharded, in_axes=(0, None, None))(xs, w, b),
                   fs.CompositionError) == (
        "shard(dense_relu) is applied inside vmap, which fshard does not allow.\nRule: shard "
        "must sit outside vmap (as in MindSpore).\nAllowed form: fs.shard(fs.vmap(dense_relu), "
        f"in_strategy=...); refused: fs.vmap(fs.shard(dense_relu, ...)).\n{COMPOSE}")


def test_shard_of_a_sharded_function_is_refused():
    sharded = fs.shard(dense_relu, ((4, 2), None, None))
    assert message(lambda: fs.shard(sharded, ((4, 2), None, None)), fs.CompositionError) == (
        "fs.shard was applied to fs.shard(dense_relu), which is already sharded.\nRule: shard "
        "cannot nest (as in MindSpore).\nAllowed form: a single fs.shard around the whole "
        f"computation.\n{COMPOSE}")


def test_shard_called_inside_a_sharded_function_is_refused():
    inner = fs.shard(dense_relu, ((4, 2), None, None), mesh=8)

    def outer(x, w, b):
        return inner(x, w, b) * 2.0

    assert message(lambda: fs.shard(outer, ((4, 2), None, None), mesh=8)(x, w, b),
                   fs.CompositionError) == (
        "shard(dense_relu) is nested inside another fs.shard, which fshard does not allow.\n"
        "Rule: shard cannot nest (as in MindSpore).\nAllowed form: one fs.shard around the "
        "whole computation; fix inner layouts with its in_strategy/out_strategy (or train "
        "with fs.AutoParallel, whose loss may call fs.shard to fix the layouts of a part: "
        "docs/shard.md).\n" + COMPOSE)
