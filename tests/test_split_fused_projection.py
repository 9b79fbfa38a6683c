"""SplitFusedProjection: a linear layer split along its output features as one layer per piece."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_evt
from tvm_evt import models, pipeline
from tvm_evt.relax_passes.training.split_fused_projection import SplitFusedProjection

from _torch_ref import assert_step_matches_torch, no_dropout

B, S, K, N = 2, 3, 8, 12


def _params(conv1d: bool = False):
    """x [B*S, K], the weight w [N, K] (or [K, N] with `conv1d`, as transformers' Conv1D keeps
    it) and the bias b [N]."""
    return (relax.Var("x", relax.TensorType((B * S, K), "float32")),
            relax.Var("w", relax.TensorType((K, N) if conv1d else (N, K), "float32")),
            relax.Var("b", relax.TensorType((N,), "float32")))


def _before(sections=(4, 8), split_axis=-1, axes=(1, 0), conv1d=False):
    """x -> linear (w, b) -> [B, S, N] -> split; returns the pieces.  `axes` None: the transpose
    as permute_dims' default (axes reversed); `conv1d`: x @ w with w [K, N], no transpose."""
    bb = relax.BlockBuilder()
    x, w, b = _params(conv1d)
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            wt = w if conv1d else relax.op.permute_dims(w, None if axes is None else list(axes))
            mm = bb.emit(relax.op.matmul(x, wt, out_dtype="float32"))
            y = bb.emit(relax.op.reshape(bb.emit(relax.op.add(b, mm)), [B, S, N]))
            parts = bb.emit(relax.op.split(y, sections if isinstance(sections, int) else list(sections),
                                           axis=split_axis))
            count = sections if isinstance(sections, int) else len(sections) + 1
            out = bb.emit_output(relax.Tuple([relax.TupleGetItem(parts, i) for i in range(count)]))
        bb.emit_func_output(out)
    return bb.get()


def _expected(bounds=((0, 4), (4, 8), (8, 12)), conv1d=False):
    bb = relax.BlockBuilder()
    x, w, b = _params(conv1d)
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            pieces = []
            for begin, end in bounds:
                wi = bb.emit(relax.op.strided_slice(w, [1 if conv1d else 0], [begin], [end]))
                bi = bb.emit(relax.op.strided_slice(b, [0], [begin], [end]))
                wt = wi if conv1d else bb.emit(relax.op.permute_dims(wi, [1, 0]))
                mm = bb.emit(relax.op.matmul(x, wt, out_dtype="float32"))
                pieces.append(bb.emit(relax.op.reshape(bb.emit(relax.op.add(bi, mm)), [B, S, end - begin])))
            out = bb.emit_output(relax.Tuple(pieces))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
def test_split_linear_becomes_one_linear_per_piece(conv1d):
    """torch.nn.Linear's weight [N, K] is sliced by rows, transformers' Conv1D's [K, N] by
    columns; the pieces compute what the split did."""
    after = SplitFusedProjection()(_before(conv1d=conv1d))
    tvm.ir.assert_structural_equal(after, _expected(conv1d=conv1d))
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32") for s in ((B * S, K), (K, N) if conv1d else (N, K), (N,))]

    def run(mod):
        ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
        return [t.numpy() for t in relax.VirtualMachine(ex, tvm.cpu())["main"](*map(tvm.runtime.tensor, args))]

    for got, want in zip(run(after), run(_before(conv1d=conv1d))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_equal_sections_and_other_axes():
    tvm.ir.assert_structural_equal(SplitFusedProjection()(_before(sections=3)), _expected())
    tvm.ir.assert_structural_equal(SplitFusedProjection()(_before(axes=None)), _expected())
    before = _before(sections=3, split_axis=1)  # along the sequence: not the features
    tvm.ir.assert_structural_equal(SplitFusedProjection()(before), before)


def test_gpt2_block_with_the_split_projection_matches_torch(monkeypatch):
    monkeypatch.setenv(pipeline.ENABLE_ENV, "split_projection")
    entry = models.ZOO["gpt2_block"]()
    no_dropout(entry.model)
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    target={"kind": "llvm"})
    assert "relax.split" not in step.graph.mod["main_adjoint"].script()
    assert_step_matches_torch(step, entry, entry.example_inputs())


def test_transformers_gpt2_attention_projection_is_split():
    """GPT2LMHeadModel as transformers builds it (c_attn a Conv1D whose output is split into
    query, key and value): no split is left after the pass."""
    import transformers

    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids, labels=ids).loss

    mod = tvm_evt.from_torch(Loss(), (torch.randint(0, 64, (2, 8)),)).mod
    ops = lambda m: [e.op.name for e in _calls(m["main"])]
    assert "relax.split" in ops(mod)
    after = ops(SplitFusedProjection()(mod))
    assert "relax.split" not in after and after.count("relax.matmul") == ops(mod).count("relax.matmul") + 2


def _calls(func) -> list:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return found
