import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.lower.split_reduction import SplitReduction, chunk


def _canonical(mod):
    return relax.transform.CanonicalizeBindings()(mod)


def test_loss_mean_of_everything_becomes_two_float32_sums():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((32, 512, 1024), "bfloat16")):
            with R.dataflow():
                y = R.mean(x)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((32, 512, 1024), "bfloat16")):
            with R.dataflow():
                b = R.reshape(x, R.shape([16384, 1024]))
                a = R.astype(b, "float32")
                c = R.sum(a, axis=[1])
                d = R.sum(c, axis=[0])
                e = R.divide(d, R.const(16777216.0, "float32"))
                y = R.astype(e, "bfloat16")
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(_canonical(SplitReduction()(Before)), Expected)


def test_bias_gradient_column_sum_is_chunked_and_keepdims_restored():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((16384, 1024), "float32")):
            with R.dataflow():
                y = R.sum(x, axis=[0], keepdims=True)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((16384, 1024), "float32")):
            with R.dataflow():
                b = R.reshape(x, R.shape([128, 128, 1024]))
                c = R.sum(b, axis=[1])
                d = R.sum(c, axis=[0])
                y = R.reshape(d, R.shape([1, 1024]))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(_canonical(SplitReduction()(Before)), Expected)


def test_row_reductions_short_reductions_and_many_outputs_stay():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((16384, 1024), "float32"), s: R.Tensor((64, 8), "float32")):
            with R.dataflow():
                rows = R.sum(x, axis=[1])  # trailing axis: a block per row already
                small = R.max(s)  # 512 elements
                R.output(rows, small)
            return (rows, small)

    tvm.ir.assert_structural_equal(SplitReduction()(Before), Before)


def test_chunk_divides_the_reduced_extent():
    assert chunk(16777216, 1) == 1024
    assert chunk(16384, 1024) == 128
    assert chunk(16384, 4096) == 512
    assert chunk(1000, 1) is None  # below MIN_REDUCED
    assert chunk(16384, 65536) is None  # enough outputs
    c = chunk(3 * 7 * 4099, 2)  # awkward extent: still a divisor (or no split)
    assert c is None or (3 * 7 * 4099) % c == 0


@pytest.mark.parametrize("op,dtype,shape,axis,keepdims", [
    ("mean", "float32", (24, 512, 3), None, False),
    ("mean", "float16", (24, 512, 3), [0, 1], True),
    ("sum", "float16", (24, 512, 3), [0, 1], False),
    ("max", "float32", (6144, 5), [0], True),
    ("min", "float32", (24, 512, 3), None, True),
])
def test_split_reductions_compute_the_same_values(op, dtype, shape, axis, keepdims):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(getattr(relax.op, op)(x, axis=axis, keepdims=keepdims))
        bb.emit_func_output(out)
    mod = bb.get()
    split = SplitReduction()(mod)
    assert "R.reshape" in split.script(), "the reduction was expected to be split"
    data = np.random.default_rng().standard_normal(shape).astype(dtype)
    ex = tvm.compile(split, target=tvm.target.Target({"kind": "llvm"}))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(data)).numpy()
    axes = None if axis is None else tuple(axis)
    ref = getattr(np, op)(data.astype("float64"), axis=axes, keepdims=keepdims)
    # a sum's rounding error scales with the sum of magnitudes, not with the (cancelling) result
    scale = getattr(np, op)(np.abs(data.astype("float64")), axis=axes, keepdims=keepdims)
    tol = 2e-3 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(got.astype("float64"), ref, rtol=0, atol=tol * np.abs(scale).max())


def test_cast_joins_the_first_stage_kernel_and_reshape_chains_collapse():
    """Reshape (a view) before the float32 cast, so FuseOps gives the cast to the reduction's
    kernel instead of writing a float32 copy; a reshape of a reshape is reshaped once."""

    @I.ir_module
    class Before:
        @R.function
        def main(g: R.Tensor((16384, 1024), "bfloat16")):
            with R.dataflow():
                r = R.reshape(g, R.shape([32, 512, 1024]))
                y = R.sum(r, axis=[0, 1])
                R.output(y)
            return y

    after = _canonical(SplitReduction()(Before))
    calls = [b.value for b in after["main"].body.blocks[0].bindings]
    first_reshape = next(c for c in calls if c.op == tvm.ir.Op.get("relax.reshape") and c.args[0].name == "g"
                         and [int(d) for d in c.ty.shape] != [32, 512, 1024])
    assert [int(d) for d in first_reshape.ty.shape][-1] == 1024
    fused = relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(after)))
    groups = [f for gv, f in fused.functions_items() if isinstance(f, relax.Function) and gv.name_hint != "main"]
    for f in groups:  # the cast never runs as a kernel of its own (or with reshapes only)
        names = [b.value.args[0].name_hint for b in f.body.blocks[0].bindings]
        if any(n.startswith("cast") for n in names):
            assert any(n.startswith("sum") for n in names), names
    assert any(any(b.value.args[0].name_hint.startswith("cast") for b in f.body.blocks[0].bindings) for f in groups)


def test_view_is_pushed_above_elementwise_producers():
    """Batch norm's second moment of a fp16 conv output: reshaped after ``astype`` and ``x*x``
    (an injective op), those were a kernel writing a float32 copy; reshaped before, the reshape
    is a view and the cast and square join the reduction's kernel.  A producer that other ops
    read too is recomputed only when it reads no more bytes than its value: ``x * z`` (six
    bytes an element for four) is read as it is."""

    @I.ir_module
    class Before:
        @R.function
        def main(y: R.Tensor((128, 28, 28, 128), "float16"), z: R.Tensor((128, 28, 28, 128), "float32")):
            with R.dataflow():
                x = R.astype(y, "float32")
                sq = R.multiply(x, x)
                m = R.mean(sq, axis=[0, 1, 2], keepdims=True)
                p = R.multiply(x, z)
                s = R.sum(p, axis=[0, 1, 2])
                R.output(m, s, p)
            return (m, s, p)

    @I.ir_module
    class Expected:
        @R.function
        def main(y: R.Tensor((128, 28, 28, 128), "float16"), z: R.Tensor((128, 28, 28, 128), "float32")):
            with R.dataflow():
                x = R.astype(y, "float32")
                v = R.reshape(y, R.shape([1024, 98, 128]))
                xv = R.astype(v, "float32")
                sqv = R.multiply(xv, xv)
                c = R.sum(sqv, axis=[1])
                d = R.sum(c, axis=[0])
                e = R.divide(d, R.const(100352.0, "float32"))
                m = R.reshape(e, R.shape([1, 1, 1, 128]))
                p = R.multiply(x, z)
                pv = R.reshape(p, R.shape([1024, 98, 128]))
                c1 = R.sum(pv, axis=[1])
                s = R.sum(c1, axis=[0])
                R.output(m, s, p)
            return (m, s, p)

    after = relax.transform.DeadCodeElimination()(_canonical(SplitReduction()(Before)))
    tvm.ir.assert_structural_equal(after, Expected)
    rng = np.random.default_rng(0)
    y, z = (rng.standard_normal((128, 28, 28, 128)).astype(dtype) for dtype in ("float16", "float32"))
    vm = relax.VirtualMachine(tvm.compile(after, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    m, s, _ = (o.numpy() for o in vm["main"](tvm.runtime.tensor(y), tvm.runtime.tensor(z)))
    x = y.astype("float64")
    for got, want in ((m, (x * x).mean(axis=(0, 1, 2), keepdims=True)), (s, (x * z).sum(axis=(0, 1, 2)))):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_view_is_pushed_above_a_product_only_the_reduction_reads():
    """Batch norm's backward ``sum(-dy * x / sigma)``: the product has no other reader, so the
    reduction's kernel reads the factors (and the per-channel ``sigma``, viewed as
    ``[1, 1, C]``) rather than a copy of their product."""

    @I.ir_module
    class Before:
        @R.function
        def main(dy: R.Tensor((128, 28, 28, 128), "float16"), x: R.Tensor((128, 28, 28, 128), "float16"),
                 sigma: R.Tensor((1, 1, 1, 128), "float16")):
            with R.dataflow():
                n = R.negative(dy)
                m = R.multiply(n, x)
                p = R.divide(m, sigma)
                s = R.sum(p, axis=[0, 1, 2])
                R.output(s)
            return s

    @I.ir_module
    class Expected:
        @R.function
        def main(dy: R.Tensor((128, 28, 28, 128), "float16"), x: R.Tensor((128, 28, 28, 128), "float16"),
                 sigma: R.Tensor((1, 1, 1, 128), "float16")):
            with R.dataflow():
                dv = R.reshape(dy, R.shape([1024, 98, 128]))
                nv = R.negative(dv)
                xv = R.reshape(x, R.shape([1024, 98, 128]))
                mv = R.multiply(nv, xv)
                sv = R.reshape(sigma, R.shape([1, 1, 128]))
                pv = R.divide(mv, sv)
                f = R.astype(pv, "float32")
                c = R.sum(f, axis=[1])
                d = R.sum(c, axis=[0])
                s = R.astype(d, "float16")
                R.output(s)
            return s

    after = relax.transform.DeadCodeElimination()(_canonical(SplitReduction()(Before)))
    tvm.ir.assert_structural_equal(after, Expected)
    rng = np.random.default_rng(0)
    dy, x = (rng.standard_normal((128, 28, 28, 128)).astype("float16") for _ in range(2))
    sigma = rng.uniform(0.5, 2.0, (1, 1, 1, 128)).astype("float16")
    vm = relax.VirtualMachine(tvm.compile(after, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    got = vm["main"](*(tvm.runtime.tensor(a) for a in (dy, x, sigma))).numpy().astype("float64")
    # the reference rounds each elementwise result to float16, as the kernel does
    p = ((-dy) * x / sigma).astype("float64")
    want = p.sum(axis=(0, 1, 2))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


def test_view_is_pushed_through_a_layer_norm_recomputed_from_its_statistics():
    """A layer norm's weight gradient and a loss on its output, recomputed from bf16 x and the
    row statistics (FuseLayerNorm's recompute): the row statistics ``[..., 1]`` split with the
    rows (``[R / c, c, 1]`` when the last axis is kept; ``[R / n, 1]`` when everything is reduced
    a row at a time) and ``gamma`` along the last axis stay broadcasts, so each reduction's kernel
    reads x16 and no float32 copy of xhat or z is made."""

    @I.ir_module
    class Before:
        @R.function
        def main(x16: R.Tensor((8, 512, 1024), "bfloat16"), mean: R.Tensor((8, 512, 1), "float32"),
                 rstd: R.Tensor((8, 512, 1), "float32"), gamma: R.Tensor((1, 1, 1024), "float32")):
            with R.dataflow():
                x = R.astype(x16, "float32")
                xhat = R.multiply(R.subtract(x, mean), rstd)
                z = R.multiply(xhat, gamma)
                dgamma = R.sum(R.multiply(z, xhat), axis=[0, 1])
                loss = R.mean(R.multiply(z, z))
                R.output(dgamma, loss)
            return (dgamma, loss)

    after = relax.transform.DeadCodeElimination()(SplitReduction()(Before))
    reshaped = [b.value.args[0] for b in after["main"].body.blocks[0].bindings
                if isinstance(b.value, relax.Call) and b.value.op.name == "relax.reshape"]
    shapes = sorted(tuple(int(s) for s in b.var.ty.shape.values) for b in after["main"].body.blocks[0].bindings
                    if isinstance(b.value, relax.Call) and b.value.op.name == "relax.reshape")
    params = after["main"].params
    assert all(any(r.same_as(p) for p in params) for r in reshaped), "only the inputs are viewed"
    assert (128, 32, 1) in shapes and (4096, 1) in shapes and (1, 1024) in shapes
    rng = np.random.default_rng(0)
    import ml_dtypes

    x16 = rng.standard_normal((8, 512, 1024)).astype(ml_dtypes.bfloat16)
    mean, rstd = rng.standard_normal((8, 512, 1)).astype("float32"), rng.uniform(0.5, 2, (8, 512, 1)).astype("float32")
    gamma = rng.standard_normal((1, 1, 1024)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(after, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    dgamma, loss = (o.numpy() for o in vm["main"](*(tvm.runtime.tensor(a) for a in (x16, mean, rstd, gamma))))
    xhat = (x16.astype("float64") - mean) * rstd
    z = xhat * gamma
    np.testing.assert_allclose(dgamma, (z * xhat).sum(axis=(0, 1)), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(loss, (z * z).mean(), rtol=1e-4)
