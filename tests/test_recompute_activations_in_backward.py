"""RecomputeActivationsInBackward (``TVM_EVT_ENABLE=recompute_activations``): an MLP's gelu(x), kept
for the second layer's weight gradient, and gelu'(x) are computed again in the backward from x,
which the step keeps anyway; the partitioner leaves such copies out of every GEMM epilogue."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_evt
from test_factor_pointwise_adjoints import _saved_producers
from test_recompute_saved_pointwise import _run
from tvm_evt import models, pipeline
from tvm_evt.relax_passes._rewrite import COPY_SUFFIX, flat_bindings, op_name
from tvm_evt.relax_passes.partition.partition_evt import OpGraph, build_problem
from tvm_evt.relax_passes.partition.recompute_activations_in_backward import RecomputeActivationsInBackward
from _passes import assert_unchanged

N, D, H = 32, 16, 64


def _mlp_step(dtype: str = "bfloat16") -> tvm.IRModule:
    """x -> h = x w1 -> y = gelu(h) -> z = y w2, loss = sum(z); the backward as the gradient rules
    write it: dw2 = y^T dz, dh = (dz w2^T) * gelu'(h) with gelu'(h) spelled out from h, dw1 = x^T dh."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, D), dtype))
    w1 = relax.Var("w1", relax.TensorType((D, H), dtype))
    w2 = relax.Var("w2", relax.TensorType((H, D), dtype))
    c = lambda v: relax.const(v, dtype)  # noqa: E731
    with bb.function("main_adjoint", [x, w1, w2]):
        with bb.dataflow():
            emit = bb.emit
            h = emit(relax.op.matmul(x, w1))
            y = emit(relax.op.nn.gelu(h))
            z = emit(relax.op.matmul(y, w2))
            loss = bb.emit_output(relax.op.sum(z))
            dz = emit(relax.op.ones_like(z))
            dw2 = bb.emit_output(relax.op.matmul(relax.op.permute_dims(y), dz))
            dy = emit(relax.op.matmul(dz, relax.op.permute_dims(w2)))
            cdf = emit(relax.op.multiply(c(0.5), relax.op.add(c(1.0), relax.op.erf(relax.op.multiply(h, c(0.7071067811865476))))))
            pdf = emit(relax.op.multiply(h, relax.op.multiply(relax.op.exp(relax.op.multiply(relax.op.multiply(h, h), c(-0.5))), c(0.3989422804014327))))
            grad = emit(relax.op.add(cdf, pdf))
            dh = emit(relax.op.multiply(dy, grad))
            dw1 = bb.emit_output(relax.op.matmul(relax.op.permute_dims(x), dh))
        bb.emit_func_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([dw1, dw2])]))
    return relax.transform.Normalize()(bb.get())


def test_the_gelu_output_is_recomputed_from_the_kept_input():
    before = _mlp_step()
    assert _saved_producers(before["main_adjoint"], N * H) == ["relax.matmul", "relax.nn.gelu"]
    after = RecomputeActivationsInBackward()(before)
    assert _saved_producers(after["main_adjoint"], N * H) == ["relax.matmul"]  # h alone
    bindings = flat_bindings(after["main_adjoint"])[0]
    copies = [b for b in bindings if b.var.name.endswith(COPY_SUFFIX)]
    assert [op_name(b.value) for b in copies].count("relax.nn.gelu") == 1
    # gelu'(h), in the backward already, is named a copy too: the partitioner must not hoist it
    assert {op_name(b.value) for b in copies} >= {"relax.erf", "relax.exp", "relax.nn.gelu"}
    # a copy reads forward values and copies only: dy * gelu'(h), which reads dy, stays as it is
    loss = next(i for i, b in enumerate(bindings) if op_name(b.value) == "relax.sum")
    gradients = {b.var for b in bindings[loss + 1:] if not b.var.name.endswith(COPY_SUFFIX)}
    assert not any(v in gradients for b in copies for v in relax.analysis.free_vars(b.value))
    assert sum(op_name(b.value) == "relax.multiply" for b in bindings if b.var in gradients) == 1


def test_without_a_kept_source_nothing_changes():
    """gelu(h) whose input is not read by the backward: recomputing it would keep h instead."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, D), "float32"))
    w1 = relax.Var("w1", relax.TensorType((D, H), "float32"))
    with bb.function("main_adjoint", [x, w1]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, w1))
            y = bb.emit(relax.op.nn.gelu(h))
            loss = bb.emit_output(relax.op.sum(y))
            dw = bb.emit_output(relax.op.matmul(relax.op.permute_dims(y), relax.op.ones_like(y)))
        bb.emit_func_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([dw])]))
    before = bb.get()
    assert_unchanged(RecomputeActivationsInBackward(), before)


def test_the_copies_compute_the_same_numbers():
    """Before and after, built for the CPU in float16 (numpy has no bfloat16): equal bits."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float16") * 0.5 for s in ((N, D), (D, H), (H, D))]
    before = _mlp_step("float16")
    after = RecomputeActivationsInBackward()(before)
    assert _saved_producers(after["main_adjoint"], N * H) == ["relax.matmul"]
    for want, got in zip(_run(before, *args), _run(after, *args)):
        np.testing.assert_array_equal(want, got)


def test_a_copy_joins_no_gemm_epilogue():
    """gelu(h) is an epilogue candidate of the GEMM making h; its copy, bound for the backward, is not."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((N, D), "bfloat16"))
    b = relax.Var("b", relax.TensorType((D, H), "bfloat16"))
    with bb.function("f", [a, b]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(a, b))
            y = bb.emit(relax.op.nn.gelu(h), name_hint="y")
            y_copy = bb.emit(relax.op.nn.gelu(h), name_hint=f"y{COPY_SUFFIX}")
            out = bb.emit_output(relax.Tuple([y, y_copy]))
        bb.emit_func_output(out)
    graph = OpGraph(bb.get()["f"].body.blocks[0])
    (cluster,) = build_problem(graph).clusters
    names = {graph.nodes[i].var.name for i in cluster.candidates}
    assert names == {"y"}
    plain = OpGraph(_rename(bb.get()["f"]).body.blocks[0])
    assert graph.canonical_hash() != plain.canonical_hash()  # the partition cache tells them apart


def _rename(func: relax.Function) -> relax.Function:
    """`func` with its copy renamed as an ordinary binding."""
    text = func.script().replace(f"y{COPY_SUFFIX}", "y_other")
    return tvm.script.from_source(text)


def test_transformers_bert_trains_the_same_and_keeps_less(monkeypatch):
    """transformers' BertForMaskedLM (fp32, llvm), without and with the pass: the same loss and
    gradients as torch, and with it one [batch, seq, 4 * hidden] tensor less kept a layer."""
    pytest.importorskip("transformers")
    batch, seq, hidden, layers = 2, 16, 32, 2
    saved = {}
    for on in (False, True):
        monkeypatch.setenv(pipeline.ENABLE_ENV, "recompute_activations" if on else "")
        torch.manual_seed(0)
        entry = models.hf_bert_mlm(batch=batch, seq=seq, layers=layers, hidden=hidden, heads=2, vocab=64, dropout=0.0)
        inputs = entry.example_inputs()
        step = tvm_evt.compile_training(entry.training_module(), inputs, target="llvm")
        saved[on] = step.memory_report()["categories"]["saved_activations"]
        loss, grads = step.loss_and_grads(*inputs)
        module = entry.training_module()
        ref = module(*inputs)
        ref.backward()
        assert abs(float(loss) - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
        params = dict(module.named_parameters())
        largest = max(p.grad.norm() for p in params.values())
        for name, p in params.items():
            if name in grads:
                assert float((grads[name] - p.grad).norm() / largest) <= 1e-4, (on, name)
    assert saved[False] - saved[True] == layers * batch * seq * 4 * hidden * 4, saved  # fp32: 4 bytes


def test_on_the_cuda_route_the_mlp_keeps_one_tensor_a_layer(monkeypatch):
    """transformers' BertForMaskedLM in bf16 through the CUDA route's passes up to the
    rematerialisation (sm_90a, no kernel built): the first FFN GEMM's epilogue no longer stores
    gelu'(x) for the backward, so the step keeps one bf16 [batch, seq, 4 * hidden] tensor less a layer."""
    pytest.importorskip("transformers")
    from tvm_evt.relax_passes.partition.rematerialize import step_graph
    from tvm_evt.training import build_training_module, runtime_module

    batch, seq, hidden, layers = 2, 64, 64, 2
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    saved = {}
    for on in (False, True):
        monkeypatch.setenv(pipeline.ENABLE_ENV, "recompute_activations" if on else "")
        torch.manual_seed(0)
        entry = models.hf_bert_mlm(batch=batch, seq=seq, layers=layers, hidden=hidden, heads=2, vocab=128,
                                   dropout=0.1)
        graph = build_training_module(tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn),
                                      tvm_evt.optim.AdamW(lr=1e-4), "bf16")
        passes = pipeline.phases(target, use_cache=False)
        upto = [p.info.name for p in passes].index("Rematerialize") + 1
        with target:
            mod = tvm.transform.Sequential(passes[:upto])(runtime_module(graph.mod))
        saved[on] = step_graph(mod, mod["train_step"]).saved_bytes
    assert saved[False] - saved[True] == layers * batch * seq * 4 * hidden * 2, saved  # bf16: 2 bytes
