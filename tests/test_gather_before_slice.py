"""GatherBeforeSlice: a pick from a prefix slice (a padded LM head's logits sliced back) reads the
padded tensor; other slices are left alone."""
import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.lower.gather_before_slice import GatherBeforeSlice, prefix_slice_along


def _module(begin: int = 0, end: int = 13, axes=(1,), gather_axis: int = 1, strides=None, pick_from_source=False):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    i = relax.Var("i", relax.TensorType((4, 1) if gather_axis == 1 else (1, 13), "int64"))
    with bb.function("main", [x, i]):
        with bb.dataflow():
            s = bb.emit(relax.op.strided_slice(x, list(axes), [begin], [end], strides))
            g = bb.emit_output(relax.op.gather_elements(x if pick_from_source else s, i, gather_axis))
        bb.emit_func_output(g)
    return bb.get()


@pytest.mark.parametrize("strides", [None, [1]], ids=["default_stride", "stride_1"])
def test_a_pick_from_a_prefix_slice_reads_the_sliced_tensor(strides):
    after = relax.transform.DeadCodeElimination()(GatherBeforeSlice()(_module(strides=strides)))
    expected = relax.transform.DeadCodeElimination()(_module(strides=strides, pick_from_source=True))
    tvm.ir.assert_structural_equal(after, expected)


@pytest.mark.parametrize("kwargs", [{"begin": 2}, {"strides": [2]}, {"axes": (0,), "end": 3, "gather_axis": 1},
                                    {"gather_axis": 0}],
                         ids=["offset", "strided", "other_axis_cut", "gathered_along_another_axis"])
def test_other_slices_are_left_alone(kwargs):
    before = _module(**kwargs)
    tvm.ir.assert_structural_equal(GatherBeforeSlice()(before), before)


def test_the_pick_gives_the_same_numbers():
    from tvm_evt.training import as_target

    before, after = _module(), GatherBeforeSlice()(_module())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype("float32")
    i = rng.integers(0, 13, (4, 1)).astype("int64")
    outs = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, target=as_target("llvm")), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(i)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], np.take_along_axis(x[:, :13], i, axis=1))


def test_prefix_slice_along_reads_the_bounds():
    call = _module().functions_items()[0][1].body.blocks[0].bindings[0].value
    assert prefix_slice_along(call, 1) and not prefix_slice_along(call, 0)
