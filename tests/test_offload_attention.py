"""OffloadAttention: fused attention calls become Codegen="evt_attention" functions that the
flash-attention codegen reads back (with dropout's keep bits saved by the forward call for the
backward call), and calls the kernels cannot take are decomposed into plain ops computing the
same values."""
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op as R

from tvm_evt.codegen.frontend.attention_call import attention_of_function
from tvm_evt.relax_passes.ops import attention_op
from tvm_evt.relax_passes.lower.offload_attention import CODEGEN, OffloadAttention

B, H, S, SK, D = 2, 2, 80, 96, 64
SITE = 7


def _training_module(dtype: str, dropout: float = 0.1, bias: bool = True, causal: bool = False) -> tvm.IRModule:
    """loss = sum(attention(q, k, v) * w) and its adjoint (through the op's gradient rule); float32
    parameters, the attention in `dtype` (as AutoMixedPrecision leaves it)."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((B, H, S, D), "float32"))
    k = relax.Var("k", relax.TensorType((B, H, SK, D), "float32"))
    v = relax.Var("v", relax.TensorType((B, H, SK, D), "float32"))
    seed = relax.Var("rng_seed", relax.TensorType((2,), "uint32"))
    w = relax.Var("w", relax.TensorType((B, H, S, D), "float32"))
    b = relax.const(np.where(np.arange(SK) < SK - 5, 0.0, -np.inf).astype("float32")) if bias else None
    with bb.function("main", [q, k, v, seed, w]):
        with bb.dataflow():
            qkv = [x if dtype == "float32" else bb.emit(R.astype(x, dtype)) for x in (q, k, v)]
            att = bb.emit(attention_op.attention(*qkv, seed, 0.125, causal, dropout, SITE, b))
            o = bb.emit(R.astype(bb.emit(relax.TupleGetItem(att, 0)), "float32"))
            loss = bb.emit_output(R.sum(R.multiply(o, w)))
        bb.emit_func_output(loss)
    mod = bb.get()
    return relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)


def _codegen_functions(mod: tvm.IRModule) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == CODEGEN}


def _ops(mod: tvm.IRModule, fn: str) -> list[str]:
    names = []
    relax.analysis.post_order_visit(
        mod[fn].body, lambda e: names.append(e.op.name) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


def test_bf16_attention_and_its_backward_share_saved_keep_bits():
    offload = OffloadAttention()
    mod = offload(_training_module("bfloat16"))
    relax.analysis.well_formed(mod)  # no free vars: the backward's seed is not a parameter
    assert offload.fallbacks == []
    funcs = _codegen_functions(mod)
    specs = {name: attention_of_function(f) for name, f in funcs.items()}
    assert sorted(specs) == ["main_adjoint_attention1", "main_adjoint_attention_backward2", "main_attention0"]
    fwd, back = specs["main_adjoint_attention1"], specs["main_adjoint_attention_backward2"]
    assert (fwd.backward, fwd.saved_mask, back.backward, back.saved_mask) == (False, True, True, True)
    assert fwd.outputs == ("out", "lse", "mask") and back.inputs == ("q", "k", "v", "o", "lse", "dout", "mask", "bias")
    assert (fwd.sq, fwd.sk, fwd.dropout, fwd.site, fwd.has_bias) == (S, SK, np.float32(0.1), SITE, True)
    # main has no backward to feed: its forward draws the mask and does not save it
    assert specs["main_attention0"].saved_mask is False
    # the adjoint passes the forward's third result to the backward call, and no attention op is left
    for fn in ("main", "main_adjoint"):
        assert not {attention_op.FORWARD, attention_op.BACKWARD} & set(_ops(mod, fn))
    bindings = {b.var: b.value for blk in mod["main_adjoint"].body.blocks for b in blk.bindings}
    fwd_call = next(v for v in bindings.values() if isinstance(v, relax.Call) and v.op.same_as(mod.get_global_var("main_adjoint_attention1")))
    back_call = next(v for v in bindings.values() if isinstance(v, relax.Call) and v.op.same_as(mod.get_global_var("main_adjoint_attention_backward2")))
    mask = bindings[back_call.args[6]]
    assert isinstance(mask, relax.TupleGetItem) and mask.index == 2
    assert any(var.same_as(mask.tuple_value) for var, v in bindings.items() if v.same_as(fwd_call))
    assert [int(d) for d in back_call.args[6].ty.shape] == fwd.mask_shape


def test_without_dropout_nothing_is_saved_and_equal_calls_share_a_function():
    mod = OffloadAttention()(_training_module("float16", dropout=0.0, bias=False, causal=True))
    specs = {name: attention_of_function(f) for name, f in _codegen_functions(mod).items()}
    # main's and main_adjoint's forward calls are equal: one function
    assert sorted(specs) == ["main_adjoint_attention_backward1", "main_attention0"]
    assert not any(s.saved_mask for s in specs.values())
    assert specs["main_attention0"].inputs == ("q", "k", "v") and specs["main_attention0"].causal


def test_float32_attention_is_decomposed_and_computes_the_same_values():
    before = _training_module("float32", dropout=0.25)
    offload = OffloadAttention()
    after = offload(before)
    assert not _codegen_functions(after)
    assert offload.fallbacks and all("dtype float32" in reason for reason in offload.fallbacks)
    for fn in ("main", "main_adjoint"):
        assert "relax.matmul" in _ops(after, fn)
        assert not {attention_op.FORWARD, attention_op.BACKWARD} & set(_ops(after, fn))
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32") for s in ((B, H, S, D), (B, H, SK, D), (B, H, SK, D))]
    args += [np.array([0x1234, 0x5678], "uint32"), rng.standard_normal((B, H, S, D)).astype("float32")]
    results = []
    for mod in (before, after):  # before: the ops' FLegalize
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])
        results.append([loss.numpy()] + [g.numpy() for g in grads])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _heads_module(rate: float, dtype: str = "bfloat16", identity_reshape: bool = False,
                  kv_heads: int = H) -> tvm.IRModule:
    """Attention on heads split from [B, S, H*D] activations, as a linear layer's output is:
    x [B, S, H, D] -> permute_dims -> attention -> permute_dims -> [B, S, H*D]; and its adjoint.
    `identity_reshape`: the attention's output reshaped to its own shape first (transformers' GPT-2
    does), so the adjoint's dO is ``reshape(permute_dims(...))`` to the same shape.  `kv_heads`: the
    keys' and values' heads (grouped-query attention below H)."""
    bb = relax.BlockBuilder()
    xs = [relax.Var(n, relax.TensorType((B, S, heads, D), "float32"))
          for n, heads in (("xq", H), ("xk", kv_heads), ("xv", kv_heads))]
    seed = relax.Var("rng_seed", relax.TensorType((2,), "uint32"))
    w = relax.Var("w", relax.TensorType((B, S, H * D), "float32"))
    with bb.function("main", [*xs, seed, w]):
        with bb.dataflow():
            q, k, v = (bb.emit(R.permute_dims(bb.emit(R.astype(x, dtype)), [0, 2, 1, 3])) for x in xs)
            att = bb.emit(attention_op.attention(q, k, v, seed, 0.125, True, rate, SITE))
            o = bb.emit(relax.TupleGetItem(att, 0))
            if identity_reshape:
                o = bb.emit(R.reshape(o, (B, H, S, D)))
            o = bb.emit(R.permute_dims(o, [0, 2, 1, 3]))
            o = bb.emit(R.astype(bb.emit(R.reshape(o, (B, S, H * D))), "float32"))
            loss = bb.emit_output(R.sum(R.multiply(o, w)))
        bb.emit_func_output(loss)
    mod = bb.get()
    return relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)


def _as_plain_relax(mod: tvm.IRModule) -> tvm.IRModule:
    """The kernel functions as ordinary Relax functions (the ops' decomposition), for llvm; not
    for saved keep bits, which only the kernels read (the backward op's seed is then a dummy)."""
    return tvm.IRModule({gv: f.without_attr("Codegen") if isinstance(f, relax.Function) and f.attrs
                         and "Codegen" in f.attrs else f for gv, f in mod.functions_items()}, attrs=mod.attrs)


@pytest.mark.parametrize("rate,identity_reshape,kv_heads", [(0.1, False, H), (0.0, False, H), (0.0, True, H),
                                                         (0.1, False, 1), (0.0, False, 1)],
                         ids=["dropout", "plain", "dO_reshaped", "grouped_dropout", "grouped"])
def test_heads_split_from_activations_are_read_sequence_major_without_transposes(rate, identity_reshape, kv_heads):
    before = _heads_module(rate, identity_reshape=identity_reshape, kv_heads=kv_heads)
    after = OffloadAttention()(before)
    relax.analysis.well_formed(after)
    specs = [attention_of_function(f) for f in _codegen_functions(after).values()]
    assert len(specs) == (3 if rate else 2) and all(s.layout == "bshd" for s in specs)
    assert all(s.kv_heads == kv_heads for s in specs)
    assert sum(s.saved_mask for s in specs) == (2 if rate else 0)  # main_adjoint's pair
    heads_swaps = []
    relax.analysis.post_order_visit(after["main_adjoint"].body, lambda e: heads_swaps.append(e) if isinstance(
        e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.permute_dims")) else None)
    assert heads_swaps == []  # q, k, v, O, dO, dQ, dK, dV: no transposes left around the kernels
    if rate:
        return
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((B, S, heads, D)).astype("float32") for heads in (H, kv_heads, kv_heads)]
    args += [np.array([0x1234, 0x5678], "uint32"), rng.standard_normal((B, S, H * D)).astype("float32")]
    results = []
    for mod in (before, _as_plain_relax(after)):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])
        results.append([loss.numpy()] + [g.numpy() for g in grads])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_cancel_transposes_looks_through_tuples_and_keeps_other_orders():
    from tvm_evt.relax_passes.training.cancel_transposes import CancelTransposes

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 4, 5), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(R.permute_dims(x, [0, 2, 1, 3]))
            t = bb.emit(relax.Tuple([y, x]))
            back = bb.emit(R.permute_dims(bb.emit(relax.TupleGetItem(t, 0)), [0, 2, 1, 3]))
            other = bb.emit(R.permute_dims(y, [0, 1, 3, 2]))  # not the inverse: kept
            out = bb.emit_output(relax.Tuple([back, other]))
        bb.emit_func_output(out)
    after = CancelTransposes()(bb.get())
    ret = after["main"].body.blocks[0].bindings[-1].value
    bound = {b.var: b.value for b in after["main"].body.blocks[0].bindings}
    assert bound[ret.fields[0]].same_as(after["main"].params[0]) or ret.fields[0].same_as(after["main"].params[0])
    assert [int(a) for a in bound[ret.fields[1]].attrs.axes] == [0, 1, 3, 2]


def test_training_report_says_which_attention_runs_as_a_kernel():
    import tvm_evt
    from tvm_evt import models
    from tvm_evt.report import training_report

    entry = models.ZOO["bert_layer"](batch=2, seq=64, hidden=128, heads=2)  # head dim 64
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    bf16 = training_report(tvm_evt.build_training_module(imported, None, "bf16").mod)["attention"]
    assert [(a["op"], a["shape"], a["head_dim"], a["kernel"], a["causal"]) for a in bf16] == \
        [("forward", [2, 2, 64, 64], 64, True, False), ("backward", [2, 2, 64, 64], 64, True, False)]
    # fp32: no kernel computes it, so FuseAttention leaves it unfused
    assert training_report(tvm_evt.build_training_module(imported, None, "fp32").mod)["attention"] == []


def test_cuda_route_cross_builds_and_exports_the_flash_kernels(tmp_path, monkeypatch):
    """Without a GPU: the evt pipeline builds a bf16 step with attention for sm_90a (nvcc, a few
    seconds: no CUTLASS partitions here) and the exported library holds both kernels' entries."""
    import shutil
    import subprocess

    from tvm_evt import pipeline
    from tvm_evt.codegen.build import toolchain

    if toolchain.find_nvcc() is None or shutil.which("nm") is None:
        pytest.skip("nvcc absent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    mod = _training_module("bfloat16")
    mod = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint == "main_adjoint"})
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    executable = tvm.compile(mod, target=target, relax_pipeline=pipeline.PIPELINE_NAME)
    path = tmp_path / "step.so"
    executable.export_library(str(path))
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True,
                             check=True).stdout
    assert "__tvm_ffi_main_adjoint_attention0" in symbols
    assert "__tvm_ffi_main_adjoint_attention_backward1" in symbols


def test_attention_of_function_checks_the_sequence_major_parameters():
    """A "bshd" function must transpose each of its q, k, v parameters into the call, in order; a
    function that claims the layout otherwise, or an unknown layout, is refused."""
    import dataclasses

    from tvm_evt.codegen.errors import Unsupported
    from tvm_evt.codegen.frontend.attention_call import LAYOUT_ATTR

    good = next(f for f in _codegen_functions(OffloadAttention()(_heads_module(0.0))).values()
                if attention_of_function(f).backward is False)
    assert attention_of_function(good).layout == "bshd"
    with pytest.raises(Unsupported, match="layout 'sbhd'"):
        attention_of_function(good.with_attr(LAYOUT_ATTR, "sbhd"))
    # the same call with q and k swapped (all [B, S, H, D] here), still claiming "bshd"
    bb = relax.BlockBuilder()
    params = [relax.Var(name, p.ty) for name, p in zip("qkv", good.params)]
    with bb.function("attention", params):
        q, k, v = (bb.emit(R.permute_dims(x, [0, 2, 1, 3])) for x in (params[1], params[0], params[2]))
        bb.emit_func_output(bb.emit(attention_op.attention(q, k, v, attention_op.no_seed(), 0.125, True, 0.0, SITE)))
    bad = bb.get()["attention"].with_attrs({LAYOUT_ATTR: "bshd", "global_symbol": "bad"})
    with pytest.raises(Unsupported, match="q must be permute_dims"):
        attention_of_function(bad)
    assert dataclasses.replace(attention_of_function(good), layout="bhsd").shape(S) == [B, H, S, D]


def test_attention_of_function_bounds_the_launch_not_batch_times_heads():
    """The kernels launch a 1-D grid of a CTA per 64 rows of each head: 70000 heads of 64 rows (past
    the 65535 of a 2-D grid's y extent, their old bound) are taken, 2^32 CTAs are refused."""
    from tvm_evt.codegen.errors import Unsupported

    def function(batch, heads, seq):
        params = [relax.Var(name, relax.TensorType((batch, heads, seq, 64), "bfloat16")) for name in "qkv"]
        bb = relax.BlockBuilder()
        with bb.function("attention", params):
            bb.emit_func_output(bb.emit(attention_op.attention(*params, attention_op.no_seed(), 0.125, False, 0.0,
                                                               SITE)))
        return bb.get()["attention"].with_attrs({"global_symbol": "attention"})

    assert attention_of_function(function(70000, 1, 64)).heads == 1
    with pytest.raises(Unsupported, match=r"65536 heads of 65536 tiles exceed a launch's 2\^31 - 1 CTAs"):
        attention_of_function(function(1024, 64, 64 * 65536))
