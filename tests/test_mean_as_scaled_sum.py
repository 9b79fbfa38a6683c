"""MeanAsScaledSum (relax_passes/lower/mean_as_scaled_sum.py): a float32 mean of an elementwise
op's result, or over axes that keep the innermost one (a column mean), becomes sum / n; other
means stay."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.lower.mean_as_scaled_sum import MeanAsScaledSum


@I.ir_module
class RMSStatistic:  # RMSNorm's rsqrt(mean(x * x) + eps), and means the pass leaves alone
    @R.function
    def main(x: R.Tensor((4, 16, 64), "float32"), h: R.Tensor((4, 16, 64), "bfloat16")):
        with R.dataflow():
            sq = R.multiply(x, x)
            m = R.mean(sq, axis=[-1], keepdims=True)
            r = R.rsqrt(R.add(m, R.const(1e-6, "float32")))
            plain = R.mean(x, axis=[1, 2])  # the operand is a parameter, not an elementwise result
            low = R.mean(R.multiply(h, h), axis=[-1], keepdims=True)  # bfloat16
            pool = R.mean(x, axis=[0, 1], keepdims=True)  # a column mean: the innermost axis kept
            R.output(r, plain, low, pool)
        return (r, plain, low, pool)


def test_mean_of_an_elementwise_result_becomes_a_sum_over_n():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 16, 64), "float32"), h: R.Tensor((4, 16, 64), "bfloat16")):
            with R.dataflow():
                sq = R.multiply(x, x)
                s = R.sum(sq, axis=[-1], keepdims=True)
                m = R.divide(s, R.const(64.0, "float32"))
                r = R.rsqrt(R.add(m, R.const(1e-6, "float32")))
                plain = R.mean(x, axis=[1, 2])
                low = R.mean(R.multiply(h, h), axis=[-1], keepdims=True)
                pool_sum = R.sum(x, axis=[0, 1], keepdims=True)
                pool = R.divide(pool_sum, R.const(64.0, "float32"))
                R.output(r, plain, low, pool)
            return (r, plain, low, pool)

    tvm.ir.assert_structural_equal(MeanAsScaledSum()(RMSStatistic), Expected)


@I.ir_module
class RMSNorm:
    @R.function
    def main(x: R.Tensor((4, 16, 64), "float32"), w: R.Tensor((64,), "float32")):
        with R.dataflow():
            m = R.mean(R.multiply(x, x), axis=[-1], keepdims=True)
            y = R.multiply(R.multiply(x, R.rsqrt(R.add(m, R.const(1e-6, "float32")))), w)
            R.output(y)
        return y


def test_fuse_ops_fuses_the_square_into_the_sum_and_the_numbers_stay():
    """Without the pass the square is a kernel of its own; with it, it is fused into the sum's.
    Both compute the same norm on llvm."""

    def kernels(mod) -> list[str]:
        mod = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(mod))
        mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))
        return sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))

    assert "multiply" in kernels(RMSNorm)  # x * x written out
    after = kernels(MeanAsScaledSum()(RMSNorm))
    assert any(k.startswith("fused_multiply") and "sum" in k for k in after), after
    assert len(after) == len(kernels(RMSNorm))  # the square's kernel gone, the divide's joined the readers

    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.standard_normal(shape, "float32")) for shape in ((4, 16, 64), (64,))]
    llvm = tvm.target.Target({"kind": "llvm"})
    ref, out = (relax.VirtualMachine(tvm.compile(mod, target=llvm), tvm.cpu())["main"](*args).numpy()
                for mod in (RMSNorm, MeanAsScaledSum()(RMSNorm)))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
