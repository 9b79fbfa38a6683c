"""ConvertConvLayout: NHWC convolutions with the layout carried between them, no 0-d permutes."""
import tvm
from tvm import relax

from tvm_evt import models
from tvm_evt.frontend import from_torch
from tvm_evt.relax_passes.convert_conv_layout import ConvertConvLayout
from tvm_evt.relax_passes.conv2d_to_matmul import Conv2dToMatmul

PERMUTE = tvm.ir.Op.get("relax.permute_dims")


def _imported(name):
    entry = models.ZOO[name]()
    return from_torch(entry.model, entry.example_inputs(), entry.loss_fn).mod


def _calls(mod, op):
    return [b.value for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and b.value.op == op]


def test_resnet_block_runs_nhwc_between_its_convolutions():
    mod = ConvertConvLayout()(_imported("resnet_basic"))
    convs = _calls(mod, tvm.ir.Op.get("relax.nn.conv2d"))
    assert len(convs) == 2 and all(c.attrs.data_layout == "NHWC" and c.attrs.kernel_layout == "OHWI" for c in convs)
    assert all(p.args[0].ty.ndim > 0 for p in _calls(mod, PERMUTE))  # TVM's 0-d permute of the loss is gone
    # activations are transposed only where NCHW tensors come in: the block's input (for the first
    # convolution and for the residual add) and the regression target the NHWC output is compared
    # with; the other permutes are of weights and [C] statistics
    acts = [p for p in _calls(mod, PERMUTE) if int(p.args[0].ty.shape.values[0]) == 2]
    assert len(acts) == 3 and all(tuple(int(a) for a in p.attrs.axes) == (0, 2, 3, 1) for p in acts)
    after = Conv2dToMatmul()(mod)
    assert not _calls(after, tvm.ir.Op.get("relax.nn.conv2d"))


def test_models_without_conv2d_are_left_alone():
    mod = _imported("mlp")
    tvm.ir.assert_structural_equal(ConvertConvLayout()(mod), mod)
