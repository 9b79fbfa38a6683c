import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.training.expand_small_power import ExpandSmallPower


def test_square_becomes_multiply_and_other_exponents_stay():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                a = R.power(x, R.const(2.0, "float32"))
                b = R.power(x, R.const(0.5, "float32"))
                c = R.power(x, R.const(2.5, "float32"))
                d = R.add(R.add(a, b), c)
                R.output(d)
            return d

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                a = R.multiply(x, x)
                b = R.sqrt(x)
                c = R.power(x, R.const(2.5, "float32"))
                d = R.add(R.add(a, b), c)
                R.output(d)
            return d

    after = relax.transform.CanonicalizeBindings()(ExpandSmallPower()(Before))
    tvm.ir.assert_structural_equal(after, Expected)


def test_cube_of_negative_base_is_exact():
    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((16,), "float32")):
            with R.dataflow():
                y = R.power(x, R.const(3.0, "float32"))
                R.output(y)
            return y

    ex = tvm.compile(ExpandSmallPower()(Mod), target=tvm.target.Target({"kind": "llvm"}))
    x = np.random.default_rng().standard_normal(16).astype("float32")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(out, x**3, rtol=1e-6)
