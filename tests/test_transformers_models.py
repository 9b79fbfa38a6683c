"""Modules as transformers builds them (random weights, no downloads) train as torch computes them:
loss and every gradient against torch fp32 on the CPU route."""
import pytest
import torch
import torch.nn.functional as F

import tvm_evt

transformers = pytest.importorskip("transformers")

# the error of every gradient, relative to the largest gradient's norm
GRAD_TOL = 1e-4


class _FirstOutput(torch.nn.Module):
    """A transformers layer whose first output (the hidden states) is the model's output."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def _check(model, x, target):
    step = tvm_evt.compile_training(model, (x, target), loss_fn=F.mse_loss, target="llvm")
    loss, grads = step.loss_and_grads(x, target)
    model.zero_grad()
    ref = F.mse_loss(model(x), target)
    ref.backward()
    params = dict(model.named_parameters())
    assert abs(float(loss) - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    assert set(grads) == set(params)
    largest = max(p.grad.norm() for p in params.values())
    for name, p in params.items():
        err = float((grads[name] - p.grad).norm() / largest)
        assert err <= GRAD_TOL, f"{name}: {err:.2e}"


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gpt2_block(attention):
    """GPT2Block with the library's default SDPA attention (its causal mask passed to SDPA), and
    with the explicit-math "eager" attention; dropout off so torch and tvm_evt draw no masks."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_head=4, n_layer=1, attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = attention
    _check(_FirstOutput(GPT2Block(config)), torch.randn(2, 16, 64), torch.randn(2, 16, 64))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bert_layer(attention):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = attention
    _check(_FirstOutput(BertLayer(config)), torch.randn(2, 16, 64), torch.randn(2, 16, 64))
