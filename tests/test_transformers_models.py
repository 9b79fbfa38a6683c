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


class _Loss(torch.nn.Module):
    """A transformers model fed (input_ids, labels): its own loss is the training loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def _check_lm(model, input_ids, labels):
    step = tvm_evt.compile_training(model, (input_ids, labels), target="llvm")
    loss, grads = step.loss_and_grads(input_ids, labels)
    model.zero_grad()
    ref = model(input_ids, labels)
    ref.backward()
    params = dict(model.named_parameters())
    assert abs(float(loss) - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    assert set(grads) == set(params)
    largest = max(p.grad.norm() for p in params.values())
    for name, p in params.items():
        err = float((grads[name] - p.grad).norm() / largest)
        assert err <= GRAD_TOL, f"{name}: {err:.2e}"
    return grads, params


def test_bert_for_masked_lm_leaves_the_padding_row_alone():
    """Whole BertForMaskedLM: its word embedding's padding_idx row gets no gradient from the
    positions that look it up (torch's rule), and every other gradient equals torch's."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = _Loss(BertForMaskedLM(config))
    input_ids = torch.randint(1, 100, (2, 16))
    input_ids[:, -4:] = 0  # padding
    labels = torch.full_like(input_ids, -100)
    labels[:, :6] = input_ids[:, :6]
    grads, params = _check_lm(model, input_ids, labels)
    word = "model.bert.embeddings.word_embeddings.weight"
    if word not in grads:  # tied to the decoder: the torch name is whichever export kept
        word = "model.cls.predictions.decoder.weight"
    lookup_only = grads[word][0] - params[word].grad[0]
    assert float(lookup_only.abs().max()) <= 1e-6


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lm(family):
    """Whole GPT2LMHeadModel (tied head, SDPA with its causal mask, a key/value cache begun as an
    empty tensor) and LlamaForCausalLM (rotary embeddings, RMSNorm, SiLU gate, 4 query heads over
    2 key/value heads, untied head)."""
    import transformers as T

    torch.manual_seed(0)
    if family == "gpt2":
        config = T.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                              attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        model = T.GPT2LMHeadModel(config)
    else:
        config = T.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = T.LlamaForCausalLM(config)
    input_ids = torch.randint(0, 100, (2, 16))
    _check_lm(_Loss(model), input_ids, input_ids.clone())


def test_embedding_padding_idx_and_scale_grad_by_freq():
    """nn.Embedding's padding_idx row keeps a zero gradient; scale_grad_by_freq is refused."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16, padding_idx=3)
    model = torch.nn.Sequential(emb, torch.nn.Linear(16, 8))
    ids = torch.randint(0, 10, (4, 12))
    ids[0, :4] = 3
    target = torch.randn(4, 12, 8)
    step = tvm_evt.compile_training(model, (ids, target), loss_fn=F.mse_loss, target="llvm")
    _loss, grads = step.loss_and_grads(ids, target)
    F.mse_loss(model(ids), target).backward()
    assert float(grads["0.weight"][3].abs().max()) == 0.0
    assert torch.allclose(grads["0.weight"], emb.weight.grad, atol=1e-6)

    freq = torch.nn.Sequential(torch.nn.Embedding(50, 16, scale_grad_by_freq=True), torch.nn.Linear(16, 8))
    with pytest.raises(tvm_evt.UnsupportedOpError, match="scale_grad_by_freq"):
        tvm_evt.compile_training(freq, (ids, target), loss_fn=F.mse_loss, target="llvm")
