"""PadUnalignedMatmuls: matmuls whose contiguous extents TMA cannot stride over, zero-padded to 16
bytes (output sliced back) so the partitioner gives them to CUTLASS; values unchanged."""
from __future__ import annotations

import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt import pipeline
from tvm_evt.relax_passes.partition.pad_unaligned_matmuls import PadUnalignedMatmuls


def _check(before, expected):
    tvm.ir.assert_structural_equal(PadUnalignedMatmuls()(before), expected)


def _run(mod, args):
    ex = tvm.compile(mod, target="llvm")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    return [o.numpy() for o in out] if isinstance(out, tvm.ir.Array) else [out.numpy()]


def _ops(mod, fn="main") -> list[str]:
    found = []
    relax.analysis.post_order_visit(mod[fn].body, lambda e: found.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return found


def _same_values(before):
    """The padded module computes what `before` does (llvm, random inputs of its dtypes)."""
    after = PadUnalignedMatmuls()(before)
    assert any(op == "relax.nn.pad" for op in _ops(after)), "nothing was padded"
    rng = np.random.default_rng(0)
    args = []
    for p in before["main"].params:
        shape, dtype = [int(d) for d in p.ty.shape.values], str(p.ty.dtype)
        x = rng.standard_normal(shape).astype("float32")
        args.append(x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x.astype(dtype))
    for want, got in zip(_run(before, args), _run(after, args)):
        assert want.shape == got.shape
        np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ the three extents
@I.ir_module
class UnalignedK:  # an im2col stem: K = 3·7·7, a K-major weight
    @R.function
    def main(x: R.Tensor((64, 147), "bfloat16"), w: R.Tensor((32, 147), "bfloat16")):
        with R.dataflow():
            wt = R.permute_dims(w, [1, 0])
            y = R.matmul(x, wt)
            R.output(y)
        return y


def test_an_unaligned_contraction_is_padded_on_both_operands():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((64, 147), "bfloat16"), w: R.Tensor((32, 147), "bfloat16")):
            with R.dataflow():
                xp = R.nn.pad(x, [0, 0, 0, 5])
                wp = R.nn.pad(w, [0, 0, 0, 5])
                wt = R.permute_dims(wp, [1, 0])  # still K-major: the main loop folds the transpose
                y = R.matmul(xp, wt)
                R.output(y)
            return y

    _check(UnalignedK, Expected)
    _same_values(UnalignedK)


@I.ir_module
class UnalignedN:  # a 100-class classifier
    @R.function
    def main(x: R.Tensor((64, 256), "bfloat16"), w: R.Tensor((100, 256), "bfloat16")):
        with R.dataflow():
            wt = R.permute_dims(w, [1, 0])
            y = R.matmul(x, wt)
            z = R.astype(y, "float32")
            R.output(z)
        return z


def test_an_unaligned_output_row_is_padded_and_sliced_back():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((64, 256), "bfloat16"), w: R.Tensor((100, 256), "bfloat16")):
            with R.dataflow():
                wp = R.nn.pad(w, [0, 4, 0, 0])
                wt = R.permute_dims(wp, [1, 0])
                yp = R.matmul(x, wt)
                y = R.strided_slice(yp, axes=[1], begin=[0], end=[100])
                z = R.astype(y, "float32")
                R.output(z)
            return z

    _check(UnalignedN, Expected)
    _same_values(UnalignedN)


def test_an_unaligned_n_major_weight_is_padded_on_its_rows():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((64, 256), "float16"), w: R.Tensor((256, 30522), "float16")):
            with R.dataflow():
                y = R.matmul(x, w, out_dtype="float32")
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((64, 256), "float16"), w: R.Tensor((256, 30522), "float16")):
            with R.dataflow():
                wp = R.nn.pad(w, [0, 0, 0, 6])
                yp = R.matmul(x, wp, out_dtype="float32")
                y = R.strided_slice(yp, axes=[1], begin=[0], end=[30522])
                R.output(y)
            return y

    _check(Before, Expected)


@I.ir_module
class MMajorA:  # a weight gradient dW = dYᵀ X over 256 tokens of 100 classes
    @R.function
    def main(dy: R.Tensor((256, 100), "bfloat16"), x: R.Tensor((256, 32), "bfloat16")):
        with R.dataflow():
            dyt = R.permute_dims(dy, [1, 0])
            dw = R.matmul(dyt, x)
            R.output(dw)
        return dw


def test_an_unaligned_m_major_operand_is_padded_under_its_transpose():
    @I.ir_module
    class Expected:
        @R.function
        def main(dy: R.Tensor((256, 100), "bfloat16"), x: R.Tensor((256, 32), "bfloat16")):
            with R.dataflow():
                dyp = R.nn.pad(dy, [0, 0, 0, 4])
                dyt = R.permute_dims(dyp, [1, 0])
                dwp = R.matmul(dyt, x)
                dw = R.strided_slice(dwp, axes=[0], begin=[0], end=[100])
                R.output(dw)
            return dw

    _check(MMajorA, Expected)
    _same_values(MMajorA)


def test_an_m_major_operand_smaller_than_the_output_is_left_to_the_partitioners_copy():
    """dW = dYᵀ X over 16 tokens: a transposed copy of dY (what the partitioner makes) moves fewer
    bytes than slicing the [100, 64] output, which would also take the epilogue away."""

    @I.ir_module
    class Before:
        @R.function
        def main(dy: R.Tensor((16, 100), "bfloat16"), x: R.Tensor((16, 64), "bfloat16")):
            with R.dataflow():
                dyt = R.permute_dims(dy, [1, 0])
                dw = R.matmul(dyt, x)
                R.output(dw)
            return dw

    _check(Before, Before)


# ------------------------------------------------------------------- views, batches, memoisation
@I.ir_module
class LMHead:
    """A language-model head and its two gradients: W, as [V, H], is read through one transpose
    by the logits and through two by dX; dlogits by dX and, transposed, by dW."""

    @R.function
    def main(x: R.Tensor((256, 64), "bfloat16"), w: R.Tensor((1001, 64), "float32"),
             dy: R.Tensor((256, 1001), "float32")):
        with R.dataflow():
            wb = R.astype(w, "bfloat16")
            wt = R.permute_dims(wb, [1, 0])
            logits = R.matmul(x, wt)
            dyb = R.astype(dy, "bfloat16")
            wtt = R.permute_dims(wt, [1, 0])
            dx = R.matmul(dyb, wtt, out_dtype="float32")
            dyt = R.permute_dims(dyb, [1, 0])
            dw = R.matmul(dyt, x, out_dtype="float32")
            R.output(logits, dx, dw)
        return logits, dx, dw


def test_a_tensor_is_padded_once_per_axis_and_transposes_compose():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((256, 64), "bfloat16"), w: R.Tensor((1001, 64), "float32"),
                 dy: R.Tensor((256, 1001), "float32")):
            with R.dataflow():
                wb = R.astype(w, "bfloat16")
                wp = R.nn.pad(wb, [0, 7, 0, 0])
                wt = R.permute_dims(wp, [1, 0])
                logits_p = R.matmul(x, wt)
                logits = R.strided_slice(logits_p, axes=[1], begin=[0], end=[1001])
                dyb = R.astype(dy, "bfloat16")
                dyp = R.nn.pad(dyb, [0, 0, 0, 7])
                dx = R.matmul(dyp, wp, out_dtype="float32")  # permute(permute(W)) is W
                dyt = R.permute_dims(dyp, [1, 0])
                dw_p = R.matmul(dyt, x, out_dtype="float32")
                dw = R.strided_slice(dw_p, axes=[0], begin=[0], end=[1001])
                R.output(logits, dx, dw)
            return logits, dx, dw

    _check(LMHead, Expected)
    _same_values(LMHead)


@I.ir_module
class BatchedScores:  # attention scores over 197 keys, K read through a [0, 1, 3, 2] transpose
    @R.function
    def main(q: R.Tensor((2, 3, 197, 64), "bfloat16"), k: R.Tensor((2, 3, 197, 64), "bfloat16"),
             p: R.Tensor((2, 3, 197, 197), "bfloat16"), v: R.Tensor((197, 64), "bfloat16")):
        with R.dataflow():
            kt = R.permute_dims(k, [0, 1, 3, 2])
            s = R.matmul(q, kt)
            o = R.matmul(p, v)  # a batched A over a 2-D B: K = 197 on both
            R.output(s, o)
        return s, o


def test_batched_matmuls_are_padded_on_their_last_two_axes():
    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((2, 3, 197, 64), "bfloat16"), k: R.Tensor((2, 3, 197, 64), "bfloat16"),
                 p: R.Tensor((2, 3, 197, 197), "bfloat16"), v: R.Tensor((197, 64), "bfloat16")):
            with R.dataflow():
                kp = R.nn.pad(k, [0, 0, 0, 0, 0, 3, 0, 0])
                kt = R.permute_dims(kp, [0, 1, 3, 2])
                sp = R.matmul(q, kt)
                s = R.strided_slice(sp, axes=[3], begin=[0], end=[197])
                pp = R.nn.pad(p, [0, 0, 0, 0, 0, 0, 0, 3])
                vp = R.nn.pad(v, [0, 3, 0, 0])
                o = R.matmul(pp, vp)
                R.output(s, o)
            return s, o

    _check(BatchedScores, Expected)
    _same_values(BatchedScores)


def test_float32_pads_to_four_elements():
    """tf32 GEMMs take K-major float32 operands with 16-byte rows: multiples of 4."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((64, 147), "float32"), w: R.Tensor((30, 147), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w, [1, 0])
                y = R.matmul(x, wt)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((64, 147), "float32"), w: R.Tensor((30, 147), "float32")):
            with R.dataflow():
                xp = R.nn.pad(x, [0, 0, 0, 1])
                wp = R.nn.pad(w, [0, 2, 0, 1])
                wt = R.permute_dims(wp, [1, 0])
                yp = R.matmul(xp, wt)
                y = R.strided_slice(yp, axes=[1], begin=[0], end=[30])
                R.output(y)
            return y

    _check(Before, Expected)
    _same_values(Before)


# ------------------------------------------------------------------------------------ left alone
def test_matmuls_the_codegen_refuses_for_other_reasons_are_left_alone():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((256, 99), "float32"), x: R.Tensor((256, 32), "float32"),
                 u: R.Tensor((64, 100), "bfloat16"), v: R.Tensor((100,), "bfloat16"),
                 c: R.Tensor((64, 100), "int8"), d: R.Tensor((100, 64), "int8"),
                 e: R.Tensor((64, 64), "bfloat16"), f: R.Tensor((64, 64), "bfloat16")):
            with R.dataflow():
                at = R.permute_dims(a, [1, 0])
                tf32 = R.matmul(at, x)  # tf32 needs a K-major A, padded or not
                vec = R.matmul(u, v)  # a 1-D operand
                ints = R.matmul(c, d, out_dtype="int32")  # no int8 GEMM on the CUTLASS route
                aligned = R.matmul(e, f)
                R.output(tf32, vec, ints, aligned)
            return tf32, vec, ints, aligned

    _check(Before, Before)


# ------------------------------------------------------------------------------------ the cost
def test_a_pad_fuses_into_its_elementwise_producer():
    """TVM's FuseOps makes the cast that produces dlogits write the padded tensor: no copy."""
    with tvm.target.Target("llvm"):
        fused = tvm.transform.Sequential([
            PadUnalignedMatmuls(), relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(), relax.transform.FuseTIR(),
        ])(LMHead)
    calls = []
    relax.analysis.post_order_visit(fused["main"].body, lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    pads = [c for c in calls if c.op == tvm.ir.Op.get("relax.call_tir") and "pad" in c.args[0].name_hint]
    shapes = sorted(tuple(int(d) for d in c.ty.shape.values) for c in pads)
    assert shapes == [(256, 1008), (1008, 64)]  # the two pads, each one kernel with its cast
    for c in pads:
        assert "cast" in c.args[0].name_hint or "astype" in c.args[0].name_hint, c.args[0].name_hint


# --------------------------------------------------------------------------- in the evt pipeline
def _report(entry, monkeypatch, tmp_path, disable: str = ""):
    """The bf16 training graph of `entry` and its partition report on the CUDA route (no GPU needed)."""
    import tvm_evt
    from tvm_evt.report import training_report
    from tvm_evt.training import hopper_target

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(pipeline.DISABLE_ENV, disable)
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    graph = tvm_evt.build_training_module(imported, None, "bf16")
    return graph, training_report(graph.mod, target=hopper_target())


def _gpt2(vocab: int = 1001):
    from tvm_evt import models

    return models.hf_gpt2_lm(batch=4, seq=16, layers=1, hidden=32, heads=2, vocab=vocab, dropout=0.0)


def test_a_gpt2_lm_head_of_an_unaligned_vocabulary_runs_every_matmul_on_cutlass(monkeypatch, tmp_path):
    _, report = _report(_gpt2(), monkeypatch, tmp_path)
    assert report["unfused_matmuls"] == []
    _, off = _report(_gpt2(), monkeypatch, tmp_path, disable="pad_matmuls")
    assert [(m["shape"], "1001 is not a multiple of 8" in m["reason"]) for m in off["unfused_matmuls"]] == \
        [([64, 1001], True)]


def test_an_mlp_of_unaligned_widths_runs_every_matmul_on_cutlass(monkeypatch, tmp_path):
    """147 inputs, 100 hidden units, 10 outputs: every forward and gradient GEMM has an unaligned
    K, N or M-major M (8 of them left to TVM unpadded)."""
    from tvm_evt import models

    def entry():
        return models.ZOO["mlp"](batch=256, in_features=147, hidden=100, out_features=10)

    _, report = _report(entry(), monkeypatch, tmp_path)
    assert report["unfused_matmuls"] == [] and len(report["partitions"]) == 8
    _, off = _report(entry(), monkeypatch, tmp_path, disable="pad_matmuls")
    assert len(off["unfused_matmuls"]) == 8 and all("not a multiple of 8" in m["reason"] for m in off["unfused_matmuls"])


@pytest.mark.slow
def test_nvcc_builds_a_padded_lm_head_partition(monkeypatch, tmp_path):
    from tvm_evt.codegen import relax_ext
    from tvm_evt.codegen.build import cache, kernel_entries, toolchain
    from tvm_evt.report import partitioned
    from tvm_evt.training import hopper_target

    if toolchain.find_nvcc() is None or shutil.which("ld") is None:
        pytest.skip("nvcc absent")
    graph, _ = _report(_gpt2(), monkeypatch, tmp_path)
    sources = relax_ext.kernel_sources(partitioned(graph.mod, target=hopper_target()))
    padded = {s: src for s, src in sources.items() if "1008" in src}  # the logits GEMM: N = 1008
    assert padded
    symbol = sorted(padded)[0]
    objects = cache.build_many({symbol: padded[symbol]})
    assert os.path.getsize(objects[symbol]) > 0 and len(kernel_entries(objects[symbol])) == 1


def test_the_cuda_relax_phases_lower_the_pads_and_slices(monkeypatch, tmp_path):
    """The whole CUDA Relax pipeline over a padded MLP step (RunCodegen with a codegen that builds
    nothing, as tests/test_absorb_partition_input_casts.py runs it): TVM's legalisation, fusion
    and DLight schedules take the pads and slices around the CUTLASS partitions."""
    import tvm_ffi
    from tvm_evt import models
    from tvm_evt.codegen import relax_ext

    graph, _ = _report(models.ZOO["mlp"](batch=256, in_features=147, hidden=100, out_features=10),
                       monkeypatch, tmp_path)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    phases = pipeline.phases(cuda)
    built = []
    tvm_ffi.register_global_func(relax_ext.GLOBAL_FUNC, lambda funcs, *_: built.extend(funcs) or [], override=True)
    monkeypatch.setattr(relax_ext, "prebuild", lambda mod, jobs=None: {})
    try:
        with cuda:
            out = tvm.transform.Sequential(phases)(graph.mod)
    finally:
        relax_ext.register()
    assert len({f.attrs["global_symbol"] for f in built}) >= 8  # every GEMM went to the codegen
    kernels = [gv.name_hint for gv, f in out.functions_items() if not isinstance(f, relax.Function)]
    assert any("pad" in k for k in kernels) and any("strided_slice" in k for k in kernels), kernels
