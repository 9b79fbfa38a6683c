"""ConvertConvLayout: NHWC convolutions with the layout carried between them, no 0-d permutes."""
import tvm
from tvm import relax

from tvm_evt import models
from tvm_evt.frontend import from_torch
from tvm_evt.relax_passes.training.convert_conv_layout import ConvertConvLayout
from tvm_evt.relax_passes.training.conv2d_to_matmul import Conv2dToMatmul

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


def test_loss_over_every_axis_reads_the_nhwc_value():
    """MSE's mean over every axis, after ExpandSmallPower's square: ConvertLayout transposed the
    squared NHWC error back to NCHW for it (ResNet-50 conv3_x: 0.36 ms for 411 MB on H100); the
    reduction reads the NHWC value, and the loss is unchanged."""
    import numpy as np

    from tvm_evt.relax_passes.training.expand_small_power import ExpandSmallPower

    before = ExpandSmallPower()(_imported("resnet_basic"))
    after = ConvertConvLayout()(before)
    mean = _calls(after, tvm.ir.Op.get("relax.mean"))[-1]
    producers = {b.var: b.value for block in after["main"].body.blocks for b in block.bindings}
    assert producers[mean.args[0]].op != PERMUTE, producers[mean.args[0]]

    def loss(mod):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        rng = np.random.default_rng(0)
        args = [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype(str(p.ty.dtype))
                if "float" in str(p.ty.dtype) else np.zeros([int(d) for d in p.ty.shape.values], str(p.ty.dtype))
                for p in mod["main"].params]
        return float(vm["main"](*[tvm.runtime.tensor(a) for a in args])[0].numpy())  # (loss, BN statistics...)

    np.testing.assert_allclose(loss(after), loss(before), rtol=1e-5)


def test_transposes_around_ops_without_a_layout_rule_cancel():
    """ConvertLayout keeps ReLU6's clip (no layout rule) and the residual add after it NCHW, between
    transposes; the second transpose moves back through them and cancels the first, so the block
    runs NHWC throughout (a broadcast operand, which would need its own permute, stops it)."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 4, 4, 8), "float32"), b: R.Tensor((2, 4, 4, 8), "float32"),
                 c: R.Tensor((1, 8, 1, 1), "float32")):
            with R.dataflow():
                an = R.permute_dims(a, axes=[0, 3, 1, 2])
                clipped = R.clip(an, R.prim_value(0.0), R.prim_value(6.0))
                bn = R.permute_dims(b, axes=[0, 3, 1, 2])
                summed = R.add(clipped, bn)
                back = R.permute_dims(summed, axes=[0, 2, 3, 1])
                scaled = R.multiply(summed, c)  # broadcast [1, C, 1, 1]: stays NCHW
                kept = R.permute_dims(scaled, axes=[0, 2, 3, 1])
                out = (back, kept)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 4, 4, 8), "float32"), b: R.Tensor((2, 4, 4, 8), "float32"),
                 c: R.Tensor((1, 8, 1, 1), "float32")):
            with R.dataflow():
                an = R.permute_dims(a, axes=[0, 3, 1, 2])
                clipped = R.clip(an, R.prim_value(0.0), R.prim_value(6.0))
                bn = R.permute_dims(b, axes=[0, 3, 1, 2])
                summed = R.add(clipped, bn)
                clipped_nhwc = R.clip(a, R.prim_value(0.0), R.prim_value(6.0))
                back = R.add(clipped_nhwc, b)
                scaled = R.multiply(summed, c)
                kept = R.permute_dims(scaled, axes=[0, 2, 3, 1])
                out = (back, kept)
                R.output(out)
            return out

    from tvm_evt.relax_passes.training.convert_conv_layout import _SimplifyPermutes
    from tvm_evt.relax_passes._rewrite import mutate_relax_functions

    after = mutate_relax_functions(_SimplifyPermutes(Before), Before)
    after = relax.transform.CanonicalizeBindings()(after)
    tvm.ir.assert_structural_equal(after, Expected)


def test_reductions_over_permuted_axes_read_the_unpermuted_value():
    """The global average pool of an NHWC value ConvertLayout wrote NCHW (through ReLU6's clip, which
    it keeps NCHW): the pool reads the NHWC value over its H and W (no transpose; the result, with
    keepdims, reshaped: only unit axes move). A reduction whose kept axes would change order stays."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 4, 4, 8), "float32"), b: R.Tensor((2, 3, 5), "float32")):
            with R.dataflow():
                an = R.permute_dims(a, axes=[0, 3, 1, 2])
                clipped = R.clip(an, R.prim_value(0.0), R.prim_value(6.0))
                pooled = R.mean(clipped, axis=[2, 3], keepdims=True)
                channels = R.sum(an, axis=[1])
                bt = R.permute_dims(b, axes=[0, 2, 1])
                kept = R.sum(bt, axis=[0])  # [5, 3]: b's kept axes swapped
                out = (pooled, channels, kept)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 4, 4, 8), "float32"), b: R.Tensor((2, 3, 5), "float32")):
            with R.dataflow():
                an = R.permute_dims(a, axes=[0, 3, 1, 2])
                clipped = R.clip(an, R.prim_value(0.0), R.prim_value(6.0))
                clipped_nhwc = R.clip(a, R.prim_value(0.0), R.prim_value(6.0))
                pooled_nhwc = R.mean(clipped_nhwc, axis=[1, 2], keepdims=True)
                pooled = R.reshape(pooled_nhwc, R.shape([2, 8, 1, 1]))
                channels = R.sum(a, axis=[3])
                bt = R.permute_dims(b, axes=[0, 2, 1])
                kept = R.sum(bt, axis=[0])
                out = (pooled, channels, kept)
                R.output(out)
            return out

    from tvm_evt.relax_passes._rewrite import mutate_relax_functions
    from tvm_evt.relax_passes.training.convert_conv_layout import _SimplifyPermutes

    after = mutate_relax_functions(_SimplifyPermutes(Before), Before)
    after = relax.transform.CanonicalizeBindings()(after)
    tvm.ir.assert_structural_equal(after, Expected)
