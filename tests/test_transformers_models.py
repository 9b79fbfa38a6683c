"""Modules as transformers builds them (random weights, no downloads) train as torch computes them:
loss and every gradient against torch fp32 on the CPU route."""
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import tvm

import tvm_evt
from tvm_evt import models
from tvm_evt.models import FirstOutput, LibraryLoss

from _torch_ref import matches_torch

transformers = pytest.importorskip("transformers")


def _check(model, x, target):
    matches_torch(model, (x, target), F.mse_loss)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gpt2_block(attention):
    """GPT2Block with the library's default SDPA attention (its causal mask passed to SDPA), and
    with the explicit-math "eager" attention; dropout off so torch and tvm_evt draw no masks."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_head=4, n_layer=1, attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = attention
    _check(FirstOutput(GPT2Block(config)), torch.randn(2, 16, 64), torch.randn(2, 16, 64))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bert_layer(attention):
    """transformers' BertLayer as the bench builds it (``models.hf_bert_layer``), dropout off."""
    torch.manual_seed(0)
    entry = models.hf_bert_layer(batch=2, seq=16, hidden=64, heads=4, ffn=128, dropout=0.0, attention=attention)
    assert type(entry.model.layer).__module__ == "transformers.models.bert.modeling_bert"
    matches_torch(entry.model, entry.example_inputs(), entry.loss_fn)


class _LlamaLayer(torch.nn.Module):
    """transformers' LlamaDecoderLayer as LlamaModel calls it: rotary position embeddings of the
    positions 0..S-1 (LlamaRotaryEmbedding), no mask (SDPA is then causal)."""

    def __init__(self, config):
        from transformers.models.llama import modeling_llama

        super().__init__()
        self.rotary = modeling_llama.LlamaRotaryEmbedding(config)
        self.layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0)

    def forward(self, x):
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        out = self.layer(hidden_states=x, position_embeddings=self.rotary(x, positions))
        return out[0] if isinstance(out, tuple) else out


def _llama_layer(attention: str, hidden=64, heads=4, kv_heads=2, ffn=128):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=128)
    config._attn_implementation = attention
    return _LlamaLayer(config)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_llama_decoder_layer_with_grouped_query_attention(attention):
    """LlamaDecoderLayer: 4 query heads over 2 key/value heads (SDPA's enable_gqa, or the eager
    form's repeat_kv), rotary embeddings, RMSNorm, SiLU gate."""
    torch.manual_seed(0)
    _check(_llama_layer(attention), torch.randn(2, 16, 64), torch.randn(2, 16, 64))


def _check_lm(model, input_ids, labels):
    return matches_torch(model, (input_ids, labels))


def test_bert_for_masked_lm_leaves_the_padding_row_alone():
    """Whole BertForMaskedLM: its word embedding's padding_idx row gets no gradient from the
    positions that look it up (torch's rule), and every other gradient equals torch's."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = LibraryLoss(BertForMaskedLM(config))
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
    _check_lm(LibraryLoss(model), input_ids, input_ids.clone())


def _library_lm(family: str):
    """A small causal or sequence-to-sequence LM of one more transformers family, dropout off."""
    import transformers as T

    small = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if family.startswith("falcon"):  # multi-query: one key/value head, split off as fused[..., [-2], :]
        return T.FalconForCausalLM(T.FalconConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0))
    if family == "gemma":  # one key/value head, tanh GELU gate, RMSNorm scaled by 1 + w, tied head
        return T.GemmaForCausalLM(T.GemmaConfig(num_key_value_heads=1, head_dim=16, **small))
    if family == "phi":  # parallel attention and MLP, partial rotary embeddings, layer norms
        return T.PhiForCausalLM(T.PhiConfig(**small))
    if family == "gpt_neox":  # fused QKV split per head, rotary on a quarter of each head
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(hidden_dropout=0.0, attention_dropout=0.0, **small))
    if family == "bart":  # encoder-decoder with cross-attention, labels shifted into decoder inputs
        return T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=100, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0))
    if family == "t5":  # relative position bias [1, H, q, k] broadcast under the key mask
        return T.T5ForConditionalGeneration(T.T5Config(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=1,
                                                       num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                       pad_token_id=0))
    if family == "deberta_v2":  # disentangled attention over log-bucketed relative positions (a true division)
        return T.DebertaV2ForMaskedLM(T.DebertaV2Config(
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True, position_buckets=8,
            pos_att_type=["p2c", "c2p"], **small))
    raise ValueError(family)


@pytest.mark.parametrize("family", ["falcon", "falcon_eager", "gemma", "phi", "gpt_neox", "bart", "t5", "deberta_v2"])
def test_lms_of_more_families(family):
    """More transformers families, whole, against torch fp32.  Falcon's multi-query attention takes
    its key and value as fused[..., [-2], :] and fused[..., [-1], :]: negative indices, which the
    stock importer read out of bounds (NaN loss, then a corrupted heap).  T5's position bias is
    broadcast over the batch by a ``where`` whose gradient TVM left at the output's shape.
    DeBERTa-v2 (no SDPA form in transformers) divides integer positions: true division."""
    torch.manual_seed(0)
    model = _library_lm(family)
    model.config._attn_implementation = "eager" if family.endswith("_eager") or family == "deberta_v2" else "sdpa"
    input_ids = torch.randint(1, 100, (2, 16))
    _check_lm(LibraryLoss(model), input_ids, input_ids.clone())


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


@pytest.mark.parametrize("family", ["swin", "convnext"])
def test_vision_models(family, recwarn):
    """transformers' Swin (patch-embedding convolution, windowed attention) and ConvNeXt (7x7
    depthwise convolutions, channels-last layer norms), whole, against torch fp32.  TVM's
    ConvertLayout fails on Swin's graph (std::bad_alloc): its convolutions stay NCHW, with a
    warning, where the failure once stopped the compile."""
    import transformers as T

    torch.manual_seed(0)
    if family == "swin":
        model = T.SwinForImageClassification(T.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=10,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0))
    else:
        model = T.ConvNextForImageClassification(T.ConvNextConfig(
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, image_size=32, drop_path_rate=0.0))
    matches_torch(_Logits(model).train(), (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))), F.cross_entropy)
    fell_back = [w for w in recwarn if "ConvertConvLayout" in str(w.message)]
    assert bool(fell_back) == (family == "swin"), [str(w.message) for w in fell_back]


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


class _SDPAForms(torch.nn.Module):
    """One projection read by SDPA in each form the libraries call it with."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, pad):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        keep = (pad > 0)[:, None, None, :]  # a padding mask over the keys, broadcast over heads and queries
        additive = torch.where(keep, 0.0, float("-inf"))
        outs = [
            F.scaled_dot_product_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
            F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=0.3),
            F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True),
            # a mask from the inputs: written out, k and v repeated over the query heads
            F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], attn_mask=keep, enable_gqa=True),
        ]
        return sum(outs).transpose(1, 2).reshape(b, s, d)


def test_sdpa_forms_match_torch():
    """SDPA with a causal flag, boolean and additive masks broadcast over heads and queries, a
    custom scale, and grouped-query heads (enable_gqa, also with a padding mask, written out): loss and
    gradients equal torch's."""
    torch.manual_seed(0)
    model = _SDPAForms()
    x, pad = torch.randn(2, 12, 32), torch.ones(2, 12)
    pad[1, -5:] = 0
    matches_torch(model, (x, pad, torch.randn(2, 12, 32)), F.mse_loss)


def _step_ops(graph) -> list[str]:
    """The op names ``train_step`` calls, in post order."""
    from tvm import relax

    ops = []
    relax.analysis.post_order_visit(
        graph.mod["train_step"].body,
        lambda e: ops.append(e.op.name) if isinstance(e, relax.Call) and hasattr(e.op, "name") else None)
    return ops


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_sdpa_layers_reach_the_attention_op(family):
    """In a bf16 step, SDPA as BertLayer and GPT2Block call it (GPT-2: causal) becomes one
    tvm_evt.attention call with its gradient, which the CUDA route hands to the flash kernels."""
    import transformers as T

    from tvm_evt.relax_passes.ops import attention_op

    if family == "bert":
        from transformers.models.bert.modeling_bert import BertLayer as Layer

        config = T.BertConfig(hidden_size=128, num_attention_heads=2, intermediate_size=256)
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block as Layer

        config = T.GPT2Config(n_embd=128, n_head=2)
    config._attn_implementation = "sdpa"
    layer = Layer(config)
    x, target = torch.randn(2, 32, 128), torch.randn(2, 32, 128)
    imported = tvm_evt.from_torch(FirstOutput(layer), (x, target), F.mse_loss)
    graph = tvm_evt.build_training_module(imported, None, "bf16")
    ops = _step_ops(graph)
    assert ops.count(attention_op.FORWARD) == 1 and ops.count(attention_op.BACKWARD) == 1
    assert "relax.nn.softmax" not in ops


@pytest.mark.parametrize("preset", ["hf_bert_large_mlm", "hf_gpt2_medium_lm", "hf_llama_4x4096"])
def test_bench_suite_builds_the_library_models(preset):
    """The bench's third-party presets build the library's own modules (here at two tiny layers)
    whose untrained loss is near ln(vocab)."""
    import math

    from tvm_evt import models

    small = {"layers": 1, "hidden": 64, "heads": 4, "vocab": 500, "batch": 2, "seq": 16}
    if preset == "hf_llama_4x4096":
        small.update(kv_heads=2, ffn=128)
    entry = models.PRESETS[preset](**small)
    assert type(entry.model.model).__module__.startswith("transformers.")
    with torch.no_grad():
        loss = float(entry.training_module().eval()(*entry.example_inputs()))
    assert abs(loss - math.log(500)) < 1.0


@pytest.mark.parametrize("kwargs", [{"label_smoothing": 0.1}, {"reduction": "sum"}, {"ignore_index": 2}],
                         ids=["label_smoothing", "sum", "ignore_index"])
def test_cross_entropy_attributes_are_honoured(kwargs):
    """cross_entropy's label smoothing (with ignored targets: its mask needs bitwise_not, which
    had no gradient rule), reduction and ignore_index give torch's loss and gradients."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 10)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = linear

        def forward(self, x, y):
            return F.cross_entropy(self.linear(x), y, **kwargs)

    x, y = torch.randn(12, 16), torch.randint(0, 10, (12,))
    y[:3] = kwargs.get("ignore_index", -100)
    step = tvm_evt.compile_training(Loss(), (x, y), target="llvm")
    loss, grads = step.loss_and_grads(x, y)
    ref = Loss()(x, y)
    ref.backward()
    assert abs(float(loss) - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    for name, p in linear.named_parameters():
        assert torch.allclose(grads[f"linear.{name}"], p.grad, atol=1e-6), name


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_whole_models_reach_the_attention_op(family, attention):
    """Whole library LMs, whose attention masks are tensors built from ``arange`` (SDPA's
    ``attn_mask``; added to the scores by the eager form): in a bf16 step every layer's attention
    is one tvm_evt.attention call with its gradient, no softmax left over."""
    from tvm_evt import models
    from tvm_evt.relax_passes.ops import attention_op

    build = {"bert": models.hf_bert_mlm, "gpt2": models.hf_gpt2_lm, "llama": models.hf_llama_lm}[family]
    torch.manual_seed(0)
    entry = build(batch=2, seq=16, layers=2, hidden=128, heads=4, vocab=101, attention=attention,  # head dim 32
                  **({} if family == "llama" else {"dropout": 0.0}))
    imported = tvm_evt.from_torch(entry.training_module(), entry.example_inputs())
    graph = tvm_evt.build_training_module(imported, None, "bf16")
    ops = _step_ops(graph)
    assert ops.count(attention_op.FORWARD) == 2 and ops.count(attention_op.BACKWARD) == 2
    assert "relax.nn.softmax" not in ops


def test_data_parallel_segments_stay_well_formed_through_the_cuda_route():
    """BertForMaskedLM's data-parallel step (its adjoint cut into one segment per gradient
    bucket): every value crossing a cut is a segment output, and no pass of the CUDA route up to
    legalisation leaves a dataflow var read outside its block (NarrowBeforeLayout did, with a cast
    of an embedding's output: the VM build then failed on an undefined var on every rank).  The
    CPU route's build of the same module succeeds."""
    from transformers import BertConfig, BertForMaskedLM

    from tvm_evt import distributed, optim, pipeline
    from tvm_evt.frontend import from_torch
    from tvm_evt.relax_passes._rewrite import escaping_vars
    from tvm_evt.training import as_target, build_adjoint_module, hopper_target

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    input_ids = torch.randint(1, 100, (2, 16))
    imported = from_torch(LibraryLoss(BertForMaskedLM(config)), (input_ids, input_ids.clone()), None)
    adjoint, _, has_seed = build_adjoint_module(imported, "bf16")
    graph = distributed.build_data_parallel_module(adjoint, imported, optim.AdamW(lr=1e-4), "bf16", 2,
                                                   has_seed=has_seed, bucket_mb=0.005, overlap=True)
    assert len(graph.plan.segments) > 4
    mod, target = graph.mod, hopper_target()
    with target, pipeline.pass_context():
        for p in pipeline.phases(target):
            name = p.info.name
            if name == "LegalizeOps":
                break
            if name in ("PrebuildKernels", "RunCodegen"):  # nvcc: the GPU tier's
                continue
            mod = p(mod)
            bad = {gv.name_hint: sorted(str(v) for v in escaping_vars(f))
                   for gv, f in mod.functions_items() if isinstance(f, tvm.relax.Function) and escaping_vars(f)}
            assert not bad, f"after {name}: {bad}"
    tvm.compile(graph.mod, target=as_target("llvm"), relax_pipeline=pipeline.PIPELINE_NAME)


def test_bert_layer_builds_the_zoo_layers_kernels():
    """#39's "a transformers BertLayer within 5 % of the zoo BERT layer's step time": with SDPA and
    dropout, its bf16 CUDA step (sm_90a, no nvcc) runs the kernels the zoo's layer of the same
    sizes runs, call for call and byte for byte (modelled traffic, ``tuning.kernel_traffic``)."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    from tvm_evt import models, optim, tuning
    from tvm_evt.frontend import from_torch
    from tvm_evt.training import build_training_module, runtime_module

    hidden, heads, ffn, batch, seq = 128, 2, 512, 2, 64
    config = BertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn)
    config._attn_implementation = "sdpa"
    zoo = models.bert_layer(batch=batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn, use_sdpa=True).model
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})

    def kernels(module):
        x, t = torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden)
        graph = build_training_module(from_torch(module, [x, t], F.mse_loss), optim.AdamW(lr=1e-4), "bf16",
                                      inplace=True)
        rows = tuning.kernel_traffic(runtime_module(graph.mod), target)
        return sorted((r["kind"], r["calls"], r["bytes"]) for r in rows)

    ours = kernels(FirstOutput(BertLayer(config)))
    assert [k for k, _, _ in ours].count("flash") == 2  # SDPA's forward and backward kernels
    assert ours == kernels(zoo)


def _llama_layer_before_builds(tmp_path, monkeypatch):
    """A LlamaDecoderLayer's bf16 step for sm_90a through the CUDA pipeline up to the kernel build."""
    from tvm_evt import optim, pipeline
    from tvm_evt.frontend import from_torch
    from tvm_evt.training import build_training_module, hopper_target

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.manual_seed(0)
    x, t = torch.randn(2, 64, 256), torch.randn(2, 64, 256)
    graph = build_training_module(from_torch(_llama_layer("sdpa", hidden=256, ffn=512), [x, t], F.mse_loss),
                                  optim.AdamW(lr=1e-4), "bf16", inplace=True)
    mod, target = graph.mod, hopper_target()
    with target, pipeline.pass_context():
        for p in pipeline.phases(target):
            if p.info.name == "PrebuildKernels":
                break
            mod = p(mod)
    return mod


def test_llama_decoder_layers_kernels_pass_legality(tmp_path, monkeypatch):
    """#39: a LlamaDecoderLayer with grouped-query attention once reached nvcc with a partition
    whose operand had a zero stride (rotary embeddings' K = 1 outer product), which nvcc rejected.
    Every evt partition of its bf16 step for sm_90a passes ``codegen.legality`` and has a kernel
    source, and attention runs as the grouped kernels (4 query heads over 2)."""
    from tvm_evt.codegen import relax_ext
    from tvm_evt.codegen.legality import legality

    mod = _llama_layer_before_builds(tmp_path, monkeypatch)
    partitions = {gv.name_hint: f for gv, f in mod.functions_items()
                  if isinstance(f, tvm.relax.Function) and f.attrs and f.attrs.get("Codegen") == "evt"}
    assert len(partitions) >= 7  # q, k, v, o, gate, up, down projections at least
    refused = {name: legality(f).reason for name, f in partitions.items() if not legality(f).ok}
    assert not refused
    sources = relax_ext.kernel_sources(mod)
    assert set(partitions) <= set(sources)
    attention = [s for s in sources.values() if " H=4 Hkv=2 " in s.splitlines()[1]]
    assert len(attention) == 2  # the forward and the backward, over 2 key/value heads


@pytest.mark.slow
def test_llama_decoder_layers_kernels_build_for_sm90a(tmp_path, monkeypatch):
    """#39, continued: nvcc builds every kernel of that step into an empty cache (ten minutes on
    two cores)."""
    from tvm_evt.codegen import relax_ext
    from tvm_evt.codegen.build import toolchain

    if toolchain.find_nvcc() is None:
        pytest.skip("needs nvcc to build the kernels")
    mod = _llama_layer_before_builds(tmp_path, monkeypatch)
    sources = relax_ext.kernel_sources(mod)
    built = relax_ext.prebuild(mod)
    failed = {name: str(r).splitlines()[0] for name, r in built.items() if not isinstance(r, Path)}
    assert not failed and set(built) == set(sources)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("family", ["deberta_v2", "t5", "gemma"])
def test_bf16_steps_tvm_kernels_compile_with_nvcc(family):
    """The bf16 step partitioned for sm_90a: its TVM kernels as the CUDA route schedules them
    compile with nvcc.  DeBERTa-v2's relative-position gradient is TVM's CUDA ``scatter_elements``,
    which launches its own threads; wrapped in a one-thread launch it did not build."""
    from _te_kernels import assert_nvcc_builds, cuda_route_source
    from tvm_evt.training import build_training_module

    torch.manual_seed(0)
    model = _library_lm(family)
    model.config._attn_implementation = "eager" if family == "deberta_v2" else "sdpa"
    input_ids = torch.randint(1, 100, (2, 16))
    graph = build_training_module(tvm_evt.from_torch(LibraryLoss(model), (input_ids, input_ids.clone()), None), None, "bf16")
    assert_nvcc_builds(cuda_route_source(graph.mod))
