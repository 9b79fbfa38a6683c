"""TVM's own BYOC flow reaches our codegens after ``import tvm_evt``: the global functions are
registered, the evt patterns are in TVM's pattern registry, FuseOpsByPattern + RunCodegen build a
GEMM + bias + GELU kernel for sm_90a, and a match the epilogue cannot express stays with TVM."""
import shutil

import pytest
import tvm
import tvm_ffi
from tvm import relax

import tvm_evt
from test_prebuild_kernels import _codegen_functions
from tvm_evt.codegen import patterns

SM90 = {"kind": "cuda", "arch": "sm_90a"}


def _linear_gelu(k: int = 512, dtype: str = "float16") -> tvm.IRModule:
    """gelu(x @ w^T + b) over x [256, k], w [1024, k], as an imported linear layer reads."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((256, k), dtype))
    w = relax.Var("w", relax.TensorType((1024, k), dtype))
    b = relax.Var("b", relax.TensorType((1024,), dtype))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w, [1, 0]))))
            out = bb.emit_output(relax.op.nn.gelu(bb.emit(relax.op.add(y, b))))
        bb.emit_func_output(out)
    return bb.get()


def _unchecked(mod: tvm.IRModule) -> tvm.IRModule:
    """FuseOpsByPattern with the evt patterns but without their legality check."""
    table = [(name, pattern, annotations) for name, pattern, annotations, _check in patterns.pattern_table()]
    return relax.transform.FuseOpsByPattern(table, annotate_codegen=True)(mod)


@pytest.mark.parametrize("name", ["relax.ext.evt", "relax.ext.evt_attention", "relax.ext.evt_conv"])
def test_import_registers_the_codegens(name):
    assert tvm_ffi.get_global_func(name, allow_missing=True) is not None


def test_the_pattern_table_is_in_tvms_registry():
    names = [str(p.name) for p in relax.backend.get_patterns_with_prefix("evt")]
    assert "evt.matmul" in names and "evt.matmul_transposed_bias_gelu" in names
    assert len(names) == len(set(names)) == len(patterns.pattern_table())
    # highest priority first: the largest patterns before the bare matmul
    assert names.index("evt.matmul_transposed_bias_gelu_residual") < names.index("evt.matmul")
    patterns.register()  # a second registration adds nothing
    assert len(relax.backend.get_patterns_with_prefix("evt")) == len(names)


def test_partition_for_evt_groups_gemm_bias_gelu():
    mod = tvm_evt.partition_for_evt(_linear_gelu())
    found = _codegen_functions(mod)
    assert len(found) == 1
    (func,) = found.values()
    assert func.attrs["Codegen"] == "evt"
    inner = [b.value for b in func.body.blocks[0].bindings if isinstance(b.value, relax.Function)]
    assert inner and inner[0].attrs["Composite"] == "evt.matmul_transposed_bias_gelu"


def test_a_match_the_epilogue_cannot_express_stays_with_tvm():
    # K = 147 halves: rows of 294 bytes, not the 16-byte multiple TMA needs
    assert not _codegen_functions(tvm_evt.partition_for_evt(_linear_gelu(k=147)))


def test_partition_sources_for_sm90_without_nvcc():
    from tvm_evt.codegen import relax_ext

    mod = tvm_evt.partition_for_evt(_linear_gelu())
    sources = relax_ext.kernel_sources(mod)
    assert len(sources) == 1
    (src,) = sources.values()
    assert "cutlass" in src and "Sm90" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build the CUTLASS kernel")
def test_tvm_byoc_flow_builds_gemm_bias_gelu_for_sm90():
    """FuseOpsByPattern with the registry's evt patterns, then RunCodegen: TVM calls relax.ext.evt,
    which builds the kernel (not run: no GPU here)."""
    seq = tvm.transform.Sequential([
        relax.transform.FuseOpsByPattern(relax.backend.get_patterns_with_prefix("evt"), annotate_codegen=True),
        relax.transform.RunCodegen(),
    ])
    with tvm.target.Target(SM90):
        out = seq(_linear_gelu())
    assert len(out.attrs["external_mods"]) == 1
    assert not _codegen_functions(out)
    calls = []
    relax.analysis.post_order_visit(out["main"].body, lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    assert any(c.op == tvm.ir.Op.get("relax.call_dps_packed") for c in calls)


def test_the_codegen_names_what_it_cannot_build():
    """A partition made without the legality check (FuseOpsByPattern with no check) reaches
    relax.ext.evt, which raises CodegenError naming the reason, before any nvcc runs."""
    from tvm_evt.codegen.errors import CodegenError

    mod = _unchecked(_linear_gelu(k=147))
    assert _codegen_functions(mod)
    with tvm.target.Target(SM90), pytest.raises(CodegenError, match=r"relax\.ext\.evt: .*cannot be offloaded"):
        relax.transform.RunCodegen()(mod)


def test_operands_with_a_zero_stride_stay_with_tvm():
    """K = 1 (an outer product, as rotary embeddings compute their angles) makes the operands'
    K strides 0: CUTLASS's operand strides cannot hold a static 0 (nvcc failed on
    Stride<_1, _0, int64_t>), so legality refuses it before any source is emitted."""
    from tvm_evt.codegen.legality import legality

    (func,) = _codegen_functions(_unchecked(_linear_gelu(k=1, dtype="bfloat16"))).values()
    verdict = legality(func)
    assert not verdict.ok and "zero stride" in verdict.reason
    assert not _codegen_functions(tvm_evt.partition_for_evt(_linear_gelu(k=1, dtype="bfloat16")))
