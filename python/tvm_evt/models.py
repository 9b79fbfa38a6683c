"""Model zoo: plain ``torch.nn`` modules that the training compiler is tested and benchmarked on.

Every model comes with a constructor in :data:`ZOO` that returns a :class:`ZooEntry`:

>>> entry = ZOO["bert_layer"]()                      # small default config
>>> loss = entry.training_module()(*entry.example_inputs())

The defaults are small (hidden 64, sequence 16, batch 2) so that a model compiles and runs on a
2-core CPU in seconds; every constructor also takes the real sizes, and :data:`PRESETS` names the
published configurations (BERT-Large layer, GPT-2 medium block, ViT-B/16, a ResNet-50 stage, ...).

Conventions shared by all entries:

* ``entry.example_inputs()`` returns a fresh tuple of random tensors: the model's inputs followed
  by ``entry.num_targets`` loss targets. ``entry.split(inputs)`` separates the two.
* ``entry.loss_fn(output, *targets)`` is the training loss, or ``loss_fn`` is ``None`` when the
  model takes its labels as inputs and already returns a scalar loss (BERT MLM, XML-CNN).
  Blocks without labels are trained against a random regression target with ``mse_loss``.
* ``entry.training_module()`` is the module to export for training: ``forward(*example_inputs())``
  returns the scalar loss.
* Dropout rates are constructor arguments so that tests can set them to 0 for exact comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRESETS",
    "ZOO",
    "BasicBlock",
    "BertEmbeddings",
    "BertForMaskedLM",
    "BertLayer",
    "FirstOutput",
    "Bottleneck",
    "GPT2Block",
    "LossWrapper",
    "MLP",
    "MultiHeadSelfAttention",
    "ViT",
    "ViTBlock",
    "XMLCNN",
    "ZooEntry",
    "bert_layer",
    "bert_mlm",
    "bert_tiny",
    "gpt2_block",
    "mlp",
    "resnet_basic",
    "resnet_bottleneck",
    "resnet_stage",
    "vit",
    "xml_cnn",
]


# --------------------------------------------------------------------------------------------
# Registry types
# --------------------------------------------------------------------------------------------


class LossWrapper(nn.Module):
    """``forward(*inputs, *targets) = loss_fn(model(*inputs), *targets)``."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], num_targets: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_targets = num_targets

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        split = len(inputs) - self.num_targets
        return self.loss_fn(self.model(*inputs[:split]), *inputs[split:])


@dataclass
class ZooEntry:
    """A model, a factory of example inputs, and how its output becomes a loss."""

    model: nn.Module
    example_inputs: Callable[[], tuple[torch.Tensor, ...]]
    loss_fn: Callable[..., torch.Tensor] | None
    description: str
    num_targets: int = 0

    def split(
        self, inputs: Sequence[torch.Tensor]
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(model_inputs, loss_targets)`` of a tuple made by ``example_inputs()``."""
        cut = len(inputs) - self.num_targets
        return tuple(inputs[:cut]), tuple(inputs[cut:])

    def training_module(self) -> nn.Module:
        """The module whose ``forward(*example_inputs())`` returns the scalar training loss."""
        if self.loss_fn is None:
            return self.model
        return LossWrapper(self.model, self.loss_fn, self.num_targets)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """``Linear -> GELU -> Dropout`` repeated ``layers`` times, then an output ``Linear``."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 64,
        out_features: int = 16,
        layers: int = 2,
        dropout: float = 0.1,
    ):
        super().__init__()
        body: list[nn.Module] = []
        width = in_features
        for _ in range(layers):
            body += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        body.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with separate or fused QKV projections.

    ``use_sdpa=False`` writes attention out as ``matmul -> scale -> (mask) -> softmax -> dropout
    -> matmul``, the form the epilogue-fusion passes see; ``use_sdpa=True`` calls
    ``F.scaled_dot_product_attention`` with the same semantics.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        attn_dropout: float = 0.1,
        causal: bool = False,
        use_sdpa: bool = False,
        fused_qkv: bool = False,
    ):
        super().__init__()
        if hidden % heads != 0:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.hidden = hidden
        self.heads = heads
        self.head_dim = hidden // heads
        self.causal = causal
        self.use_sdpa = use_sdpa
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        else:
            self.query = nn.Linear(hidden, hidden)
            self.key = nn.Linear(hidden, hidden)
            self.value = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(attn_dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = t.shape
        return t.reshape(batch, seq, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if self.fused_qkv:
            q, k, v = self.qkv(x).split(self.hidden, dim=-1)
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if self.use_sdpa:
            p = self.attn_dropout.p if self.training else 0.0
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            if self.causal:
                mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = self.attn_dropout(torch.softmax(scores, dim=-1))
            ctx = torch.matmul(probs, v)
        return ctx.transpose(1, 2).reshape(batch, seq, self.hidden)


class BertLayer(nn.Module):
    """A post-LN BERT encoder layer: attention, add & LayerNorm, GELU FFN, add & LayerNorm."""

    def __init__(
        self,
        hidden: int = 64,
        heads: int = 4,
        ffn: int | None = None,
        dropout: float = 0.1,
        attn_dropout: float | None = None,
        use_sdpa: bool = False,
        eps: float = 1e-12,
    ):
        super().__init__()
        ffn = 4 * hidden if ffn is None else ffn
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        self.attention = MultiHeadSelfAttention(hidden, heads, attn_dropout, use_sdpa=use_sdpa)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_out_dropout = nn.Dropout(dropout)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, ffn)
        self.output = nn.Linear(ffn, hidden)
        self.out_dropout = nn.Dropout(dropout)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attn_out_dropout(self.attn_out(self.attention(x)))
        x = self.attn_norm(x + attn)
        ffn = self.out_dropout(self.output(F.gelu(self.intermediate(x))))
        return self.out_norm(x + ffn)


class BertEmbeddings(nn.Module):
    """Token + position + token-type embeddings, LayerNorm and dropout."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        max_positions: int,
        type_vocab: int = 2,
        dropout: float = 0.1,
        eps: float = 1e-12,
    ):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        token_types = torch.zeros_like(input_ids)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_types)
        return self.dropout(self.norm(x))


def init_bert_weights(module: nn.Module, std: float = 0.02) -> None:
    """BERT's initialisation: linear and embedding weights from N(0, std²), biases 0, layer norms
    the identity.  The MLM loss then starts near ln(vocab)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class BertForMaskedLM(nn.Module):
    """A full BERT: embeddings, ``layers`` encoder layers, and the MLM head.

    ``forward(input_ids, labels)`` returns the mean cross-entropy over the vocabulary of the
    positions whose label is not ``-100`` (the positions that were masked).
    """

    def __init__(
        self,
        vocab: int = 1000,
        hidden: int = 64,
        layers: int = 2,
        heads: int = 4,
        ffn: int | None = None,
        max_positions: int = 128,
        type_vocab: int = 2,
        dropout: float = 0.1,
        use_sdpa: bool = False,
        tie_weights: bool = True,
        eps: float = 1e-12,
    ):
        super().__init__()
        self.vocab = vocab
        self.embeddings = BertEmbeddings(vocab, hidden, max_positions, type_vocab, dropout, eps)
        self.layers = nn.ModuleList(
            BertLayer(hidden, heads, ffn, dropout, use_sdpa=use_sdpa, eps=eps)
            for _ in range(layers)
        )
        self.head_transform = nn.Linear(hidden, hidden)
        self.head_norm = nn.LayerNorm(hidden, eps=eps)
        self.decoder = nn.Linear(hidden, vocab)
        if tie_weights:
            self.decoder.weight = self.embeddings.word.weight
        self.apply(init_bert_weights)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x)
        x = self.head_norm(F.gelu(self.head_transform(x)))
        return self.decoder(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(input_ids).reshape(-1, self.vocab)
        return F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)


class GPT2Block(nn.Module):
    """A pre-LN GPT-2 block: causal attention with a fused QKV projection, tanh-GELU MLP."""

    def __init__(
        self,
        hidden: int = 64,
        heads: int = 4,
        dropout: float = 0.1,
        use_sdpa: bool = False,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = MultiHeadSelfAttention(
            hidden, heads, dropout, causal=True, use_sdpa=use_sdpa, fused_qkv=True
        )
        self.attn_proj = nn.Linear(hidden, hidden)
        self.resid_dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp_fc = nn.Linear(hidden, 4 * hidden)
        self.mlp_proj = nn.Linear(4 * hidden, hidden)
        self.mlp_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn_proj(self.attn(self.ln_1(x))))
        h = F.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp_dropout(self.mlp_proj(h))


class ViTBlock(nn.Module):
    """A pre-LN transformer block as in ViT: attention and a GELU MLP, each with a residual."""

    def __init__(self, hidden: int, heads: int, mlp: int, dropout: float, eps: float = 1e-6):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = MultiHeadSelfAttention(hidden, heads, dropout, fused_qkv=True)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp_fc = nn.Linear(hidden, mlp)
        self.mlp_proj = nn.Linear(mlp, hidden)
        self.mlp_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_dropout(self.attn_proj(self.attn(self.ln_1(x))))
        return x + self.mlp_dropout(self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)))))


class ViT(nn.Module):
    """Patch embedding (``Conv2d`` with ``stride == patch``), CLS token, position embedding,
    ``layers`` pre-LN blocks, final LayerNorm; returns the normalized token sequence."""

    def __init__(
        self,
        image: int = 32,
        patch: int = 8,
        channels: int = 3,
        hidden: int = 64,
        heads: int = 4,
        mlp: int | None = None,
        layers: int = 1,
        dropout: float = 0.1,
    ):
        super().__init__()
        if image % patch != 0:
            raise ValueError(f"image size {image} is not a multiple of the patch size {patch}")
        tokens = (image // patch) ** 2 + 1
        self.patch_embed = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, hidden) * 0.02)
        self.pos_dropout = nn.Dropout(dropout)
        mlp = 4 * hidden if mlp is None else mlp
        self.blocks = nn.ModuleList(ViTBlock(hidden, heads, mlp, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden, eps=1e-6)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = self.pos_dropout(torch.cat([cls, x], dim=1) + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
    )


class BasicBlock(nn.Module):
    """ResNet-18/34 basic block: ``3x3 conv-BN-ReLU, 3x3 conv-BN``, shortcut, ReLU."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv_bn(in_channels, channels, 3, stride)
        self.conv2 = _conv_bn(channels, channels, 3)
        self.shortcut = (
            _conv_bn(in_channels, channels, 1, stride)
            if stride != 1 or in_channels != channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(F.relu(self.conv1(x)))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """ResNet-50 bottleneck: ``1x1 -> 3x3 (stride) -> 1x1 (x4)`` with BN, shortcut, ReLU."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = _conv_bn(in_channels, width, 1)
        self.conv2 = _conv_bn(width, width, 3, stride)
        self.conv3 = _conv_bn(width, out_channels, 1)
        self.shortcut = (
            _conv_bn(in_channels, out_channels, 1, stride)
            if stride != 1 or in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.conv1(x))
        out = F.relu(self.conv2(out))
        out = self.conv3(out)
        return F.relu(out + self.shortcut(x))


class XMLCNN(nn.Module):
    """XML-CNN (Liu et al., SIGIR 2017) for extreme multi-label text classification.

    Word embedding, one ``Conv1d`` per kernel size, ReLU, dynamic max pooling (each feature map
    cut into ``pool_chunks`` pieces by ``adaptive_max_pool1d``), a bottleneck ``Linear`` with
    ReLU and dropout, and an output ``Linear`` over all labels. ``forward(tokens, labels)``
    returns ``BCEWithLogitsLoss`` against the multi-hot ``labels``.
    """

    def __init__(
        self,
        vocab: int = 500,
        embed: int = 32,
        seq: int = 32,
        kernel_sizes: Sequence[int] = (2, 4, 8),
        filters: int = 8,
        pool_chunks: int = 4,
        bottleneck: int = 32,
        labels: int = 100,
        dropout: float = 0.5,
    ):
        super().__init__()
        if min(kernel_sizes) < 1 or max(kernel_sizes) > seq:
            raise ValueError(f"kernel sizes {kernel_sizes} do not fit a sequence of {seq}")
        self.pool_chunks = pool_chunks
        self.embedding = nn.Embedding(vocab, embed)
        self.embed_dropout = nn.Dropout(dropout / 2)
        self.convs = nn.ModuleList(nn.Conv1d(embed, filters, k) for k in kernel_sizes)
        self.bottleneck = nn.Linear(len(kernel_sizes) * filters * pool_chunks, bottleneck)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(bottleneck, labels)
        self.loss = nn.BCEWithLogitsLoss()

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_dropout(self.embedding(tokens)).transpose(1, 2)  # (batch, embed, seq)
        pooled = [
            F.adaptive_max_pool1d(F.relu(conv(x)), self.pool_chunks).flatten(1)
            for conv in self.convs
        ]
        h = self.dropout(F.relu(self.bottleneck(torch.cat(pooled, dim=1))))
        return self.out(h)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.logits(tokens), labels)


# --------------------------------------------------------------------------------------------
# Constructors (the registry's values)
# --------------------------------------------------------------------------------------------


def _regression(
    model: nn.Module, input_shape: Sequence[int], output_shape: Sequence[int], description: str
) -> ZooEntry:
    """An entry that feeds ``randn(input_shape)`` and regresses onto ``randn(output_shape)``."""
    return ZooEntry(
        model,
        lambda: (torch.randn(*input_shape), torch.randn(*output_shape)),
        F.mse_loss,
        description + "; inputs (x, regression target), MSE loss",
        num_targets=1,
    )


def _conv_out(size: int, stride: int) -> int:
    """Spatial size after a 3x3 convolution with padding 1 (or a 1x1 without) and ``stride``."""
    return (size - 1) // stride + 1


def mlp(
    batch: int = 2,
    in_features: int = 64,
    hidden: int = 64,
    out_features: int = 16,
    layers: int = 2,
    dropout: float = 0.1,
) -> ZooEntry:
    model = MLP(in_features, hidden, out_features, layers, dropout)
    return _regression(
        model,
        (batch, in_features),
        (batch, out_features),
        f"MLP {in_features}->{hidden}x{layers}->{out_features}, GELU, batch {batch}",
    )


def bert_layer(
    batch: int = 2,
    seq: int = 16,
    hidden: int = 64,
    heads: int = 4,
    ffn: int | None = None,
    dropout: float = 0.1,
    use_sdpa: bool = False,
) -> ZooEntry:
    model = BertLayer(hidden, heads, ffn, dropout, use_sdpa=use_sdpa)
    attention = "SDPA" if use_sdpa else "matmul/softmax"
    return _regression(
        model,
        (batch, seq, hidden),
        (batch, seq, hidden),
        f"BERT encoder layer ({attention}), hidden {hidden}, heads {heads}, "
        f"FFN {model.intermediate.out_features}, seq {seq}, batch {batch}",
    )


def _mlm_inputs(
    batch: int, seq: int, vocab: int, mask_prob: float
) -> Callable[[], tuple[torch.Tensor, ...]]:
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        input_ids = torch.randint(0, vocab, (batch, seq))
        labels = torch.full((batch, seq), -100, dtype=torch.int64)
        masked = torch.rand(batch, seq) < mask_prob
        masked[:, 0] = True  # at least one labelled position per row: the loss is never 0/0
        labels[masked] = input_ids[masked]
        return input_ids, labels

    return make


def bert_mlm(
    batch: int = 2,
    seq: int = 16,
    vocab: int = 1000,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    ffn: int | None = None,
    dropout: float = 0.1,
    use_sdpa: bool = False,
    tie_weights: bool = True,
    mask_prob: float = 0.15,
) -> ZooEntry:
    model = BertForMaskedLM(
        vocab,
        hidden,
        layers,
        heads,
        ffn,
        max_positions=max(seq, 128),
        dropout=dropout,
        use_sdpa=use_sdpa,
        tie_weights=tie_weights,
    )
    return ZooEntry(
        model,
        _mlm_inputs(batch, seq, vocab, mask_prob),
        None,
        f"BERT MLM, {layers} layers, hidden {hidden}, heads {heads}, vocab {vocab}, "
        f"seq {seq}, batch {batch}; inputs (input_ids, labels with -100 = unmasked)",
    )


def bert_tiny(vocab: int = 1000, layers: int = 2, batch: int = 8, seq: int = 32, **kwargs) -> ZooEntry:
    """The README demo: a 2-layer BERT MLM over a 1k vocabulary and synthetic tokens, at a batch
    whose loss visibly falls within 20 steps (the labels are the tokens themselves)."""
    return bert_mlm(vocab=vocab, layers=layers, batch=batch, seq=seq, **kwargs)


def gpt2_block(
    batch: int = 2,
    seq: int = 16,
    hidden: int = 64,
    heads: int = 4,
    dropout: float = 0.1,
    use_sdpa: bool = False,
) -> ZooEntry:
    model = GPT2Block(hidden, heads, dropout, use_sdpa=use_sdpa)
    return _regression(
        model,
        (batch, seq, hidden),
        (batch, seq, hidden),
        f"GPT-2 block (pre-LN, causal, gelu_tanh), hidden {hidden}, heads {heads}, "
        f"seq {seq}, batch {batch}",
    )


def vit(
    batch: int = 2,
    image: int = 32,
    patch: int = 8,
    channels: int = 3,
    hidden: int = 64,
    heads: int = 4,
    mlp: int | None = None,
    layers: int = 1,
    dropout: float = 0.1,
) -> ZooEntry:
    model = ViT(image, patch, channels, hidden, heads, mlp, layers, dropout)
    tokens = (image // patch) ** 2 + 1
    return _regression(
        model,
        (batch, channels, image, image),
        (batch, tokens, hidden),
        f"ViT, {layers} block(s), {image}x{image} patches {patch}, hidden {hidden}, "
        f"heads {heads}, batch {batch}",
    )


def resnet_basic(
    batch: int = 2, in_channels: int = 16, channels: int = 16, size: int = 8, stride: int = 1
) -> ZooEntry:
    model = BasicBlock(in_channels, channels, stride)
    out = _conv_out(size, stride)
    return _regression(
        model,
        (batch, in_channels, size, size),
        (batch, channels, out, out),
        f"ResNet basic block {in_channels}->{channels}, stride {stride}, "
        f"{size}x{size}, batch {batch}, BatchNorm in train mode",
    )


def resnet_bottleneck(
    batch: int = 2, in_channels: int = 32, width: int = 8, size: int = 8, stride: int = 1
) -> ZooEntry:
    model = Bottleneck(in_channels, width, stride)
    out = _conv_out(size, stride)
    return _regression(
        model,
        (batch, in_channels, size, size),
        (batch, width * 4, out, out),
        f"ResNet bottleneck {in_channels}->{width}->{width * 4}, stride {stride}, "
        f"{size}x{size}, batch {batch}, BatchNorm in train mode",
    )


def resnet_stage(
    batch: int = 2,
    in_channels: int = 16,
    width: int = 8,
    blocks: int = 2,
    size: int = 8,
    stride: int = 1,
) -> ZooEntry:
    """A stage of bottlenecks; ``resnet_stage(in_channels=256, width=128, blocks=4, size=56,
    stride=2)`` is ResNet-50's conv3_x."""
    layers = [Bottleneck(in_channels, width, stride)]
    layers += [Bottleneck(width * 4, width) for _ in range(blocks - 1)]
    model = nn.Sequential(*layers)
    out = _conv_out(size, stride)
    return _regression(
        model,
        (batch, in_channels, size, size),
        (batch, width * 4, out, out),
        f"ResNet bottleneck stage, {blocks} blocks, {in_channels}->{width * 4}, "
        f"stride {stride}, {size}x{size}, batch {batch}",
    )


def xml_cnn(
    batch: int = 2,
    seq: int = 32,
    vocab: int = 500,
    embed: int = 32,
    kernel_sizes: Sequence[int] = (2, 4, 8),
    filters: int = 8,
    pool_chunks: int = 4,
    bottleneck: int = 32,
    labels: int = 100,
    dropout: float = 0.5,
) -> ZooEntry:
    model = XMLCNN(
        vocab, embed, seq, kernel_sizes, filters, pool_chunks, bottleneck, labels, dropout
    )

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (batch, seq))
        targets = (torch.rand(batch, labels) < 0.05).float()
        return tokens, targets

    return ZooEntry(
        model,
        make,
        None,
        f"XML-CNN, kernels {tuple(kernel_sizes)} x {filters} filters, dynamic max pooling "
        f"into {pool_chunks}, bottleneck {bottleneck}, {labels} labels, seq {seq}, "
        f"batch {batch}; inputs (tokens, multi-hot labels), BCEWithLogitsLoss",
    )


ZOO: dict[str, Callable[..., ZooEntry]] = {
    "mlp": mlp,
    "bert_layer": bert_layer,
    "bert_layer_sdpa": partial(bert_layer, use_sdpa=True),
    "bert_mlm": bert_mlm,
    "bert_tiny": bert_tiny,
    "gpt2_block": gpt2_block,
    "gpt2_block_sdpa": partial(gpt2_block, use_sdpa=True),
    "vit": vit,
    "resnet_basic": resnet_basic,
    "resnet_bottleneck": resnet_bottleneck,
    "resnet_stage": resnet_stage,
    "xml_cnn": xml_cnn,
}
"""Small default configurations: each value builds a :class:`ZooEntry` that runs in seconds."""

# --------------------------------------------------------------------------------------------
# Models as the libraries build them (random weights, no downloads): the bench's third-party suite
# --------------------------------------------------------------------------------------------


class LibraryLoss(nn.Module):
    """A transformers model fed ``(input_ids, labels)``, whose own loss is the training loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


class FirstOutput(nn.Module):
    """A library layer whose first output (the hidden states) is the model's output (transformers'
    layers return tuples)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def hf_bert_layer(batch: int = 2, seq: int = 16, hidden: int = 64, heads: int = 4, ffn: int | None = None,
                  dropout: float = 0.1, attention: str = "sdpa") -> ZooEntry:
    """transformers' ``BertLayer`` (post-LN, GELU FFN, dropout), regressed as the zoo's ``bert_layer``
    is: the same work written by the library."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer as LibraryBertLayer

    ffn = 4 * hidden if ffn is None else ffn
    config = BertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    config._attn_implementation = attention
    return _regression(FirstOutput(LibraryBertLayer(config)), (batch, seq, hidden), (batch, seq, hidden),
                       f"transformers BertLayer ({attention} attention), hidden {hidden}, heads {heads}, FFN {ffn}, "
                       f"seq {seq}, batch {batch}")


def _causal_lm_inputs(batch: int, seq: int, vocab: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq))
        return ids, ids.clone()  # the model shifts the labels itself

    return make


def hf_bert_mlm(batch: int = 2, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
                vocab: int = 1000, dropout: float = 0.1, attention: str = "sdpa") -> ZooEntry:
    """transformers' ``BertForMaskedLM`` (BERT-Large: 24 layers, hidden 1024, 16 heads, vocab 30522)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * hidden, max_position_embeddings=max(512, seq),
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    config._attn_implementation = attention
    return ZooEntry(LibraryLoss(BertForMaskedLM(config)), _mlm_inputs(batch, seq, vocab, 0.15), None,
                    f"transformers BertForMaskedLM, {layers} layers, hidden {hidden}, heads {heads}, vocab {vocab}, "
                    f"seq {seq}, batch {batch}, {attention} attention; inputs (input_ids, labels)")


def hf_gpt2_lm(batch: int = 2, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
               vocab: int = 1000, dropout: float = 0.1, attention: str = "sdpa") -> ZooEntry:
    """transformers' ``GPT2LMHeadModel`` (gpt2-medium: 24 layers, hidden 1024, 16 heads, vocab 50257)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max(1024, seq),
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    config._attn_implementation = attention
    return ZooEntry(LibraryLoss(GPT2LMHeadModel(config)), _causal_lm_inputs(batch, seq, vocab), None,
                    f"transformers GPT2LMHeadModel, {layers} layers, hidden {hidden}, heads {heads}, vocab {vocab}, "
                    f"seq {seq}, batch {batch}, {attention} attention; inputs (input_ids, labels)")


def hf_llama_lm(batch: int = 2, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, ffn: int = 128, vocab: int = 1000, attention: str = "sdpa") -> ZooEntry:
    """transformers' ``LlamaForCausalLM`` (rotary embeddings, RMSNorm, SiLU gate, grouped-query heads,
    untied head; Llama-2-7B's layer: hidden 4096, 32 / 8 heads, ffn 11008, vocab 32000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max(2048, seq))
    config._attn_implementation = attention
    return ZooEntry(LibraryLoss(LlamaForCausalLM(config)), _causal_lm_inputs(batch, seq, vocab), None,
                    f"transformers LlamaForCausalLM, {layers} layers, hidden {hidden}, heads {heads}/{kv_heads}, "
                    f"ffn {ffn}, vocab {vocab}, seq {seq}, batch {batch}, {attention} attention")


def timm_model(name: str = "vit_base_patch16_224", batch: int = 2, image: int = 224, classes: int = 1000,
               **kwargs) -> ZooEntry:
    """A timm model by name (``timm.create_model(name, pretrained=False, **kwargs)``: e.g. ``img_size``,
    ``depth`` for a small ViT), trained with cross-entropy on random images and labels."""
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=classes, **kwargs)

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, image, image), torch.randint(0, classes, (batch,))

    return ZooEntry(model, make, F.cross_entropy, f"timm {name}, {classes} classes, {image}x{image}, batch {batch}",
                    num_targets=1)


def torchvision_model(name: str = "resnet50", batch: int = 2, image: int = 224, classes: int = 1000,
                      **kwargs) -> ZooEntry:
    """A torchvision classification model by name (``torchvision.models.get_model(name, weights=None,
    num_classes=classes, **kwargs)``), trained with cross-entropy on random images and labels."""
    import torchvision

    model = torchvision.models.get_model(name, weights=None, num_classes=classes, **kwargs)

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, image, image), torch.randint(0, classes, (batch,))

    return ZooEntry(model, make, F.cross_entropy,
                    f"torchvision {name}, {classes} classes, {image}x{image}, batch {batch}", num_targets=1)


PRESETS: dict[str, Callable[..., ZooEntry]] = {
    "bert_base_layer": partial(bert_layer, batch=32, seq=128, hidden=768, heads=12, ffn=3072),
    "bert_large_layer": partial(bert_layer, batch=32, seq=128, hidden=1024, heads=16, ffn=4096),
    "bert_base_mlm": partial(
        bert_mlm, batch=32, seq=128, vocab=30522, hidden=768, layers=12, heads=12, ffn=3072
    ),
    "gpt2_medium_block": partial(gpt2_block, batch=8, seq=1024, hidden=1024, heads=16),
    "vit_b16": partial(
        vit, batch=32, image=224, patch=16, hidden=768, heads=12, mlp=3072, layers=12
    ),
    "vit_b16_block": partial(
        vit, batch=32, image=224, patch=16, hidden=768, heads=12, mlp=3072, layers=1
    ),
    "resnet18_basic": partial(resnet_basic, batch=32, in_channels=64, channels=64, size=56),
    "resnet50_bottleneck": partial(resnet_bottleneck, batch=32, in_channels=256, width=64, size=56),
    "resnet50_conv3": partial(
        resnet_stage, batch=32, in_channels=256, width=128, blocks=4, size=56, stride=2
    ),
    "xml_cnn_eurlex": partial(
        xml_cnn,
        batch=32,
        seq=500,
        vocab=30000,
        embed=300,
        filters=32,
        pool_chunks=8,
        bottleneck=512,
        labels=3956,
    ),
}
"""Published sizes (BERT-Base/Large, GPT-2 medium, ViT-B/16, ResNet-18/50, XML-CNN on EUR-Lex)."""

PRESETS.update({  # the same sizes as the libraries build them (the bench's third-party suite)
    "hf_bert_large_layer": partial(hf_bert_layer, hidden=1024, heads=16, ffn=4096),
    "hf_bert_large_mlm": partial(hf_bert_mlm, layers=24, hidden=1024, heads=16, vocab=30522),
    "hf_gpt2_medium_lm": partial(hf_gpt2_lm, layers=24, hidden=1024, heads=16, vocab=50257),
    "hf_llama_4x4096": partial(hf_llama_lm, layers=4, hidden=4096, heads=32, kv_heads=8, ffn=11008, vocab=32000),
    "timm_vit_b16": partial(timm_model, "vit_base_patch16_224"),
    "tv_resnet18": partial(torchvision_model, "resnet18"),
    "tv_resnet50": partial(torchvision_model, "resnet50"),
    "tv_mobilenet_v2": partial(torchvision_model, "mobilenet_v2"),
    "timm_efficientnet_b0": partial(timm_model, "efficientnet_b0"),
})
