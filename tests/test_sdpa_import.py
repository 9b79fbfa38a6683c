"""SDPA becomes one ``tvm_evt.attention`` call at import, with its arguments: masks computed from
constants are read as the causal triangle and/or a key mask; anything else is written out as plain
ops with the reason kept for ``report()["attention"]``; a dropout rate gets LowerDropout's seed
and site."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

import tvm_evt
from tvm_evt.relax_passes.ops import attention_op
from tvm_evt.relax_passes.training.lower_dropout import SEED_PARAM, LowerDropout

B, H, S = 2, 3, 5
SHAPE = [B, H, S, S]
CAUSAL = torch.ones(S, S, dtype=torch.bool).tril()
KEYS = torch.tensor([True, True, True, False, False])
NEG = torch.finfo(torch.float32).min


def _form(mask: torch.Tensor, shape):
    return attention_op.mask_form(mask.numpy(), shape)


def _float(visible: torch.Tensor) -> torch.Tensor:
    return torch.where(visible, 0.0, NEG)


def test_mask_forms_the_op_takes():
    assert _form(torch.ones(B, 1, S, S, dtype=torch.bool), SHAPE) == (False, None)
    assert _form(torch.zeros(1, 1, S, S), SHAPE) == (False, None)
    assert _form(CAUSAL, SHAPE) == (True, None)
    assert _form(_float(CAUSAL)[None, None].expand(B, 1, S, S), SHAPE) == (True, None)
    causal, bias = _form(KEYS, SHAPE)  # a key mask broadcast over queries
    assert not causal and bias.dtype == np.float32 and list(bias) == [0, 0, 0, -np.inf, -np.inf]
    causal, bias = _form(_float(CAUSAL & KEYS), SHAPE)
    assert causal and list(bias) == [0, 0, 0, -np.inf, -np.inf]
    ramp = torch.arange(S, dtype=torch.float32) * 0.5  # an additive per-key bias of any value
    causal, bias = _form(ramp, SHAPE)
    assert not causal and np.allclose(bias, ramp.numpy())


@pytest.mark.parametrize("mask,why", [
    (torch.stack([KEYS, ~KEYS | CAUSAL[0]])[:, None, None, :], "differs between batch rows"),
    (torch.ones(S, S, dtype=torch.bool).triu(), "neither a key mask nor the causal triangle"),
    (torch.ones(S, S, dtype=torch.bool).tril(-1), "a query sees no key"),
    (torch.arange(S * S, dtype=torch.float32).reshape(S, S), "neither a key mask nor the causal triangle"),
])
def test_mask_forms_the_op_does_not_take(mask, why):
    assert why in _form(mask, SHAPE)


class _Attention(torch.nn.Module):
    """Projections around one SDPA call whose mask is built in forward as `mask` says."""

    def __init__(self, mask: str, dropout: float = 0.0, heads: int = 2, dim: int = 16):
        super().__init__()
        self.mask, self.dropout, self.heads = mask, dropout, heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, pad):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        pos = torch.arange(s)
        mask = {"none": None,
                "causal_arange": (pos[None, :] <= pos[:, None])[None, None].expand(b, 1, s, s),
                "padding_input": (pad > 0)[:, None, None, :]}[self.mask]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout)
        return out.transpose(1, 2).reshape(b, s, d)


def _ops(func: relax.Function) -> list[str]:
    ops = []
    relax.analysis.post_order_visit(func.body, lambda e: ops.append(e.op.name)
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return ops


def _inputs():
    torch.manual_seed(0)
    pad = torch.ones(2, 8)
    pad[1, 5:] = 0
    return torch.randn(2, 8, 16), pad, torch.randn(2, 8, 16)


@pytest.mark.parametrize("mask", ["none", "causal_arange"])
def test_sdpa_with_a_constant_mask_is_one_attention_call(mask):
    model = _Attention(mask)
    imported = tvm_evt.from_torch(model, _inputs(), F.mse_loss)
    ops = _ops(imported.mod["main"])
    assert ops.count(attention_op.FORWARD) == 1 and "relax.nn.softmax" not in ops
    assert imported.attention_fallbacks == []
    call = next(c for c in _calls(imported.mod["main"]) if c.op.name == attention_op.FORWARD)
    assert attention_op.operands(call).attrs.causal == (mask == "causal_arange")
    # and the step computes what torch does (the op's reference decomposition on the CPU)
    step = tvm_evt.compile_training(model, _inputs(), loss_fn=F.mse_loss, target="llvm")
    x, pad, y = _inputs()
    loss, grads = step.loss_and_grads(x, pad, y)
    model.zero_grad()
    ref = F.mse_loss(model(x, pad), y)
    ref.backward()
    assert abs(float(loss) - ref.item()) <= 1e-5 * abs(ref.item())
    for name, p in model.named_parameters():
        assert float((grads[name] - p.grad).norm()) <= 1e-4 * float(p.grad.norm()), name


def _calls(func):
    calls = []
    relax.analysis.post_order_visit(func.body, lambda e: calls.append(e)
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return calls


def test_sdpa_with_a_mask_from_the_inputs_is_written_out_and_reported():
    model = _Attention("padding_input")
    step = tvm_evt.compile_training(model, _inputs(), loss_fn=F.mse_loss, target="llvm")
    assert step.imported.attention_fallbacks == [
        {"module": "model", "reason": "the mask is computed from the inputs (a per-batch padding mask, say)"}]
    rows = [a for a in step.report()["attention"] if a["op"] == "sdpa"]
    assert rows and not rows[0]["kernel"] and "computed from the inputs" in rows[0]["reason"]
    x, pad, y = _inputs()
    loss, _ = step.loss_and_grads(x, pad, y)
    assert abs(float(loss) - F.mse_loss(model(x, pad), y).item()) <= 1e-5


def test_lower_dropout_seeds_sdpa_dropout_after_the_sites_before_it():
    """An SDPA with dropout takes the function's rng_seed and the next site number, counted with
    the dropout ops in binding order (here: one nn.Dropout before it)."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.1)
            self.attn = _Attention("none", dropout=0.2)

        def forward(self, x, pad):
            return self.attn(self.drop(x), pad)

    imported = tvm_evt.from_torch(Model(), _inputs(), F.mse_loss)
    mod = LowerDropout()(imported.mod)
    func = mod["main"]
    call = next(c for c in _calls(func) if c.op.name == attention_op.FORWARD)
    ops = attention_op.operands(call)
    assert ops.seed.same_as(func.params[-1]) and func.params[-1].name == SEED_PARAM
    assert (ops.attrs.site, ops.attrs.dropout) == (1, pytest.approx(0.2))


def test_mask_form_reads_the_mask_not_its_broadcast_to_the_scores():
    """A [1, 1, S, S] causal mask over scores of a large batch (GPT-2 medium at batch 52 once asked
    numpy for 52 GB here): decided on the mask itself, as are masks differing by batch row."""
    from tvm_evt.relax_passes.ops import attention_op

    s = 1024
    causal = np.tril(np.ones((s, s), bool))[None, None]
    assert attention_op.mask_form(causal, [4096, 64, s, s])[0] is True
    rows = np.stack([causal[0], ~causal[0] | np.eye(s, dtype=bool)[None]])
    assert attention_op.mask_form(rows, [2, 64, s, s]) == "the mask differs between batch rows or heads"
