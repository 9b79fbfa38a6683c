import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.graph.eliminate_masked_fill_gradient import EliminateMaskedFillGradient


def _module(fill: float = float("-inf"), same_mask: bool = True):
    """Causal softmax and the gradient of the fill: dS = where(c, 0, P * (dP - D))."""
    bb = relax.BlockBuilder()
    s = relax.Var("s", relax.TensorType((2, 8, 8), "float32"))
    dp = relax.Var("dp", relax.TensorType((2, 8, 8), "float32"))
    d = relax.Var("d", relax.TensorType((2, 8, 1), "float32"))
    c = relax.Var("c", relax.TensorType((8, 8), "bool"))
    c2 = relax.Var("c2", relax.TensorType((8, 8), "bool"))
    with bb.function("main", [s, dp, d, c, c2]):
        with bb.dataflow():
            m = bb.emit(relax.op.where(c, relax.const(fill, "float32"), s))
            p = bb.emit(relax.op.nn.softmax(m, axis=-1))
            pb = bb.emit(relax.op.astype(p, "bfloat16"))  # SaveSoftmaxLowPrecision's bf16 P
            t = bb.emit(relax.op.multiply(relax.op.subtract(dp, d), relax.op.astype(pb, "float32")))
            tb = bb.emit(relax.op.astype(t, "bfloat16"))
            g = bb.emit(relax.op.where(c if same_mask else c2, relax.const(0.0, "bfloat16"), tb))
            out = bb.emit_output(relax.op.astype(g, "float32"))
        bb.emit_func_output(out)
    return bb.get()


@I.ir_module
class Expected:
    @R.function
    def main(s: R.Tensor((2, 8, 8), "float32"), dp: R.Tensor((2, 8, 8), "float32"),
             d: R.Tensor((2, 8, 1), "float32"), c: R.Tensor((8, 8), "bool"), c2: R.Tensor((8, 8), "bool")):
        with R.dataflow():
            m = R.where(c, R.const(float("-inf"), "float32"), s)
            p = R.nn.softmax(m, axis=-1)
            pb = R.astype(p, "bfloat16")
            t = R.multiply(R.subtract(dp, d), R.astype(pb, "float32"))
            tb = R.astype(t, "bfloat16")
            out = R.astype(tb, "float32")
            R.output(out)
        return out


def _run(mod, args):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def test_mask_of_the_filled_softmax_gradient_goes():
    before = _module()
    after = EliminateMaskedFillGradient()(before)
    tvm.ir.assert_structural_equal(after, Expected)
    rng = np.random.default_rng()
    causal = ~np.tril(np.ones((8, 8), dtype=bool))
    args = [rng.standard_normal((2, 8, 8)).astype("float32"), rng.standard_normal((2, 8, 8)).astype("float32"),
            rng.standard_normal((2, 8, 1)).astype("float32"), causal, causal]
    got, want = _run(after, args), _run(before, args)
    np.testing.assert_array_equal(got, want)  # exactly: P is 0 wherever the mask wrote 0
    assert (got[:, causal] == 0).all() and (got[:, ~causal] != 0).any()


@pytest.mark.parametrize("fill,same_mask", [(-1e4, True), (float("-inf"), False)])
def test_other_fills_and_masks_stay(fill, same_mask):
    """A finite fill leaves P nonzero under the mask; another mask is not the fill's."""
    before = _module(fill, same_mask)
    tvm.ir.assert_structural_equal(EliminateMaskedFillGradient()(before), before)


def test_causal_gpt2_block_loses_its_backward_mask():
    """In the zoo's GPT-2 block the gradient's causal where goes; the forward fill stays."""
    from tvm_evt import models, tuning
    from tvm_evt.pipeline import pre_partition_passes

    _, graph = tuning.training_graph(models.ZOO["gpt2_block"](), "bf16")
    mod = tvm.transform.Sequential(pre_partition_passes())(graph.mod)
    wheres = [b.value for block in mod["train_step"].body.blocks for b in block.bindings
              if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.where")
              and tuple(int(x) for x in b.value.ty.shape) == (2, 4, 16, 16)]
    # left: the forward fill and dropout's masks (forward, backward); the causal one of dS is gone
    assert len(wheres) == 3, [str(w) for w in wheres]
