"""Every zoo model imports through ``from_exported_program`` + ``CONVERT_MAP`` in training mode and
computes what torch computes; dropout becomes ``relax.nn.dropout``; BatchNorm updates its running
statistics as torch does."""

import math
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from torch import nn
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from tvm_evt.converters import CONVERT_MAP, buffer_mutations
from tvm_evt.models import PRESETS, ZOO, ZooEntry

RTOL = 1e-4


class _OutputAndLoss(nn.Module):
    """``(model output, loss)`` for entries with a separate loss; the model itself otherwise."""

    def __init__(self, entry: ZooEntry):
        super().__init__()
        self.model = entry.model
        self.entry = entry

    def forward(self, *inputs):
        model_inputs, targets = self.entry.split(inputs)
        out = self.model(*model_inputs)
        return out, self.entry.loss_fn(out, *targets)


def _set_dropout(module: nn.Module, p: float) -> nn.Module:
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = p
    return module


def _import(module: nn.Module, inputs, **kwargs) -> tvm.IRModule:
    ep = torch.export.export(module.train(), tuple(inputs))
    return from_exported_program(
        ep,
        keep_params_as_input=True,
        unwrap_unit_return_tuple=True,
        custom_convert_map=CONVERT_MAP,
        **kwargs,
    )


def _run(mod: tvm.IRModule, inputs) -> list[np.ndarray]:
    params = list(mod["main"].attrs["params"]) if "params" in mod["main"].attrs else []
    ex = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(t.numpy()) for t in inputs], *params)
    if isinstance(out, tvm.runtime.Tensor):
        return [out.numpy()]
    return [o.numpy() for o in out]


def _check(module: nn.Module, inputs, **import_kwargs) -> None:
    """Import ``module`` in training mode, run it on ``inputs`` and compare with torch."""
    # a copy: the eager run updates BatchNorm buffers in place, and the importer binds
    # buffers as constants that share memory with them (DLPack)
    expected = copy.deepcopy(module).train()(*inputs)
    mod = _import(module, inputs, **import_kwargs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = _run(mod, inputs)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        want = want.detach().numpy()
        assert got.shape == want.shape
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        assert err <= RTOL, f"relative error {err:.2e}"


def _count_calls(mod: tvm.IRModule, op_name: str) -> int:
    op = tvm.ir.Op.get(op_name)
    found = []
    relax.analysis.post_order_visit(
        mod["main"].body,
        lambda e: found.append(e) if isinstance(e, relax.Call) and e.op == op else None,
    )
    return len(found)


# ---------------------------------------------------------------------------------------------
# The zoo
# ---------------------------------------------------------------------------------------------


# bert_tiny is bert_mlm's graph at a larger batch (checked below): compiling it twice buys nothing
@pytest.mark.parametrize("name", sorted(set(ZOO) - {"bert_tiny"}))
def test_zoo_model_matches_torch(name):
    torch.manual_seed(0)
    entry = ZOO[name]()
    _set_dropout(entry.model, 0.0)
    module = entry.model if entry.loss_fn is None else _OutputAndLoss(entry)
    _check(module, entry.example_inputs())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_entry_contract(name):
    entry = ZOO[name]()
    inputs = entry.example_inputs()
    again = entry.example_inputs()
    assert any(not torch.equal(a, b) for a, b in zip(inputs, again)), "inputs are not fresh"
    loss = entry.training_module().train()(*inputs)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert entry.description


def test_bert_tiny_is_the_default_mlm_at_a_larger_batch():
    model = ZOO["bert_tiny"]().model
    assert len(model.layers) == 2 and model.vocab == 1000
    assert ZOO["bert_mlm"](batch=8, seq=32).description == ZOO["bert_tiny"]().description


def test_bert_starts_near_the_uniform_loss():
    """BERT's N(0, 0.02) initialisation: the MLM loss of the untrained model is near ln(vocab)."""
    torch.manual_seed(0)
    entry = ZOO["bert_tiny"]()
    std = entry.model.embeddings.word.weight.std().item()
    assert 0.018 < std < 0.022
    losses = [float(entry.training_module().eval()(*entry.example_inputs())) for _ in range(3)]
    assert all(abs(loss - math.log(1000)) < 0.3 for loss in losses), losses


def test_presets_build_real_sizes():
    entry = PRESETS["bert_large_layer"]()
    assert entry.model.intermediate.out_features == 4096
    assert entry.model.attention.heads == 16
    vit_b16 = PRESETS["vit_b16_block"]()
    assert vit_b16.model.pos_embed.shape == (1, 197, 768)


# ---------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, sites",
    [("mlp", 2), ("bert_layer", 3), ("bert_layer_sdpa", 3), ("gpt2_block", 3), ("xml_cnn", 2)],
)
def test_dropout_becomes_relax_dropout(name, sites):
    torch.manual_seed(0)
    entry = ZOO[name]()
    _set_dropout(entry.model, 0.1)
    mod = _import(entry.training_module(), entry.example_inputs())
    assert _count_calls(mod, "relax.nn.dropout") == sites


def test_zero_dropout_emits_no_dropout():
    entry = ZOO["bert_layer"]()
    _set_dropout(entry.model, 0.0)
    mod = _import(entry.training_module(), entry.example_inputs())
    assert _count_calls(mod, "relax.nn.dropout") == 0


class _DropoutFamily(nn.Module):
    """Dropout2d, AlphaDropout and SDPA with dropout and a custom scale."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.channel = nn.Dropout2d(p)
        self.alpha = nn.AlphaDropout(p)

    def forward(self, x, q):
        attn = F.scaled_dot_product_attention(q, q, q, dropout_p=self.p, scale=0.3)
        return self.channel(x), self.alpha(x), attn


@pytest.mark.parametrize("decompose", [True, False])
def test_dropout_family(decompose):
    inputs = (torch.randn(2, 3, 4, 4), torch.randn(2, 2, 5, 8))
    _check(_DropoutFamily(0.0), inputs, run_ep_decomposition=decompose)
    mod = _import(_DropoutFamily(0.25), inputs, run_ep_decomposition=decompose)
    # undecomposed, SDPA is one tvm_evt.attention call that draws its own dropout mask
    sdpa_whole = 0 if decompose else 1
    assert _count_calls(mod, "relax.nn.dropout") == 3 - sdpa_whole
    assert _count_calls(mod, "tvm_evt.attention") == sdpa_whole


def test_in_place_dropout_trains_through_its_drawn_mask():
    """``nn.Dropout(inplace=True)`` (torchvision's MobileNetV3 classifier) reaches the importer as
    ``x * bernoulli(1 - p) / (1 - p)``: the drawn mask is no input's function, so Gradient must
    stop at it (it once failed on the RNG kernel).  With the loss the sum of the dropout's output,
    each first-layer bias gradient counts the kept rows of its column, over 1 - p."""
    import numpy as np

    import tvm_evt

    torch.manual_seed(0)
    p, rows, cols = 0.25, 256, 64
    model = nn.Sequential(nn.Linear(32, cols), nn.Dropout(p, inplace=True))
    x, y = torch.randn(rows, 32), torch.zeros(rows)
    step = tvm_evt.compile_training(model, (x, y), loss_fn=lambda out, _y: out.sum(), target="llvm")
    _loss, grads = step.loss_and_grads(x, y)
    kept = grads["0.bias"].numpy() * (1 - p)
    np.testing.assert_allclose(kept, np.round(kept), atol=1e-3)  # whole rows kept, scaled by 1 / (1 - p)
    assert abs(kept.sum() / (rows * cols) - (1 - p)) < 0.03  # 16384 draws: 0.0034 standard deviation
    assert 0 < kept.min() and kept.max() < rows


class _NegativeIndex(nn.Module):
    """Advanced indexing from the end: Falcon's multi-query split (``fused[..., [-2], :]``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 6 * 8)

    def forward(self, x):
        fused = self.proj(x).view(*x.shape[:2], 6, 8)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1, 0], :]
        return (q * k).sum((-2, -1)).unsqueeze(-1) * v.flatten(2)  # [N, S, 16]


def test_negative_indices_count_from_the_end():
    """The stock importer's ``take`` read ``x[..., [-2], :]`` out of bounds: a wrong loss, then a
    corrupted heap."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    _assert_trains_as_torch(_NegativeIndex(), x, torch.randn(2, 5, 16), nn.MSELoss())


class _ClampedPositions(nn.Module):
    """Relative positions clamped on one side and on both (integer clamps), looked up in a table."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(16, 8)

    def forward(self, x):
        pos = torch.arange(x.shape[1])[:, None] - torch.arange(x.shape[1])[None, :]
        ids = pos.abs().clamp(max=7) + (pos.clamp(min=-3) + 3).clamp_max(8) + pos.clamp_min(0).clamp(0, 0)
        return x @ self.table(ids).sum(-1)


def test_integer_clamps_with_one_bound_train():
    """An integer clamp with one bound was a clip with an infinite other bound: "Cannot convert
    infinity to BigInt" when it was legalized."""
    torch.manual_seed(0)
    x = torch.randn(3, 6)
    _assert_trains_as_torch(_ClampedPositions(), x, torch.randn(3, 6), nn.MSELoss())


class _IntegerQuotients(nn.Module):
    """True divisions of integer positions: by an int, by an integer tensor, by a float."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        pos = torch.arange(6)
        return x * self.w * (pos / 4 + pos / torch.full_like(pos, 3) + pos / 2.5) + x / 2


def test_true_division_of_integers_gives_floats():
    """``pos / 4`` of an integer tensor was divided as integers (a loss of 4.2 where torch's is
    11.0, no error)."""
    torch.manual_seed(0)
    _assert_trains_as_torch(_IntegerQuotients(), torch.randn(3, 6), torch.randn(3, 6), nn.MSELoss())


@pytest.mark.parametrize("activation", [nn.SELU(), nn.ELU(0.5), nn.CELU(2.0)], ids=["selu", "elu", "celu"])
def test_elu_family_trains_as_torch(activation):
    """SELU decomposes to ``elu(x, alpha, scale=1.0507)``; the stock converter dropped ``scale``
    and ``input_scale``: a loss 3e-3 off and gradients 2e-2 off, no error."""
    torch.manual_seed(0)
    x = torch.randn(4, 8) * 2
    _assert_trains_as_torch(nn.Sequential(nn.Linear(8, 8), activation, nn.Linear(8, 8)), x, torch.randn(4, 8),
                            nn.MSELoss())


class _MaskLogic(nn.Module):
    """``torch.logaddexp`` (its decomposition multiplies two bool masks) and a sum of two masks."""

    def forward(self, x):
        either = (x > 1) + (x < -1)
        return torch.logaddexp(x, 0.5 * x) * either


def test_arithmetic_of_bool_masks_is_logic():
    """The product of two bool tensors reached LLVM as a bool multiply: an internal error naming
    no op or module."""
    torch.manual_seed(0)
    _assert_trains_as_torch(nn.Sequential(nn.Linear(8, 8), _MaskLogic()), torch.randn(4, 8) * 2, torch.randn(4, 8),
                            nn.MSELoss())


class _LastStep(nn.Module):
    """A recurrent layer's last step as classifiers read it, ``out[:, -1]`` (``select.int`` with a
    negative index), and an LSTM's own unrolled steps."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1]) + x[:, -2, :3]


def test_select_counts_a_negative_index_from_the_end():
    """The stock converter passed -1 to TVM's unchecked ``take``: the LSTM classifier's loss was
    9.9e6 where torch's is 1.98, then the heap was corrupted."""
    torch.manual_seed(0)
    _assert_trains_as_torch(_LastStep(), torch.randn(2, 5, 4), torch.randn(2, 3), nn.MSELoss())


class _SharedIndex(nn.Module):
    def forward(self, x):
        i = torch.tensor([-1, 0])
        return x[i, i]


def test_one_index_tensor_for_axes_of_different_extents_is_refused():
    from tvm_evt.errors import UnsupportedOpError

    with pytest.raises(UnsupportedOpError, match="aten.index.Tensor.*extents 5 and 7"):
        _import(_SharedIndex(), (torch.randn(5, 7),))


# ---------------------------------------------------------------------------------------------
# BatchNorm running statistics, adaptive max pooling
# ---------------------------------------------------------------------------------------------


class _BatchNormStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4, momentum=0.3)
        with torch.no_grad():
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        y = self.bn(x)
        return y, self.bn.running_mean * 1, self.bn.running_var * 1


@pytest.mark.parametrize("decompose", [True, False])
def test_batch_norm_updates_running_stats(decompose):
    torch.manual_seed(0)
    module = _BatchNormStats()
    x = torch.randn(3, 4, 5, 5) * 2 + 1
    ep = torch.export.export(module.train(), (x,))
    mutated = buffer_mutations(ep.run_decompositions())
    assert mutated == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    _check(_BatchNormStats(), (x,), run_ep_decomposition=decompose)


class _AdaptiveMaxPool(nn.Module):
    def forward(self, x):
        return F.adaptive_max_pool1d(x.flatten(2), 6), F.adaptive_max_pool2d(x, (3, 2))


@pytest.mark.parametrize("decompose", [True, False])
def test_adaptive_max_pool_uneven_windows(decompose):
    _check(_AdaptiveMaxPool(), (torch.randn(2, 3, 5, 7),), run_ep_decomposition=decompose)


def test_parameter_vars_are_c_identifiers_and_keep_torch_names():
    """``nn.Sequential`` names parameters ``0.weight``: their Relax vars become kernel argument names
    in generated CUDA, so they must be identifiers; users still see the torch names."""
    import re

    from tvm_evt.frontend import from_torch

    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    imported = from_torch(model, [torch.randn(4, 8), torch.randn(4, 1)], loss_fn=nn.MSELoss())
    assert imported.param_names[:2] == ["0.weight", "0.bias"]
    assert "1.running_mean" in imported.buffer_names
    names = [p.name for p in imported.mod["main"].params]
    assert all(re.fullmatch(r"[A-Za-z_]\w*", n) for n in names), names
    assert "p_0_weight" in names


def _assert_trains_as_torch(model, x, y, loss_fn):
    """`compile_training`'s loss and gradients (llvm) equal torch's on a copy of `model`; the step."""
    import tvm_evt

    step = tvm_evt.compile_training(copy.deepcopy(model), (x, y), loss_fn=loss_fn, target="llvm")
    loss, grads = step.loss_and_grads(x, y)
    reference = copy.deepcopy(model)
    ref = loss_fn(reference(x), y)
    ref.backward()
    assert abs(float(loss) - ref.item()) <= RTOL * max(1.0, ref.item())
    largest = max(float(p.grad.norm()) for p in reference.parameters() if p.grad is not None)
    for n, p in reference.named_parameters():
        if p.grad is not None:
            assert float((grads[n] - p.grad).norm()) / largest <= RTOL, n
    return step


def test_amax_amin_and_logsumexp_train_as_torch():
    """``amax``/``amin`` (which the stock importer lacks; ``logsumexp`` decomposes into ``amax``):
    the loss and gradients of torch, the gradient split over ties as ``torch.amax`` splits it."""
    class Extrema(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            tied = torch.stack([h, h.detach()])  # every element tied with a copy that takes no gradient
            return torch.logsumexp(h, 1, keepdim=True) + h.amax(dim=(0, 1)) - tied.amin(0).sum(-1, keepdim=True)

    torch.manual_seed(0)
    _assert_trains_as_torch(Extrema(), torch.randn(6, 8), torch.randn(6, 1), F.mse_loss)


class _Detached(nn.Module):
    """Gradients torch does not take: through ``x.detach()`` and out of a ``torch.no_grad()`` block
    (a target built from the model's own output, as self-distillation and EMA teachers do)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            target = torch.softmax(self.head(h) * 2, -1)
        return (h * h.detach()).mean(-1, keepdim=True) + (torch.log_softmax(self.head(h), -1) * target).sum(-1, keepdim=True)


def test_detach_and_no_grad_blocks_take_no_gradient():
    torch.manual_seed(0)
    _assert_trains_as_torch(_Detached(), torch.randn(6, 8), torch.randn(6, 1), F.mse_loss)


class _StraightThrough(torch.autograd.Function):
    """Rounding with the identity as its gradient (quantisation-aware training's estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Quantised(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x):
        return _StraightThrough.apply(self.fc(x)) + self.head(x)


class _QuantisedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _Quantised()

    def forward(self, x):
        return self.body(x)


_REGISTER_HOOK = torch.Tensor.register_hook


class _GradientHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.requires_grad:
            h.register_hook(lambda g: 3 * g)
        return self.out(h)


def _backward_hooked():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model[2].register_full_backward_hook(lambda module, grad_in, grad_out: (0 * grad_in[0],))
    return model


@pytest.mark.parametrize("make,what,module", [
    (_GradientHook, "Tensor.register_hook", ""),
    (_backward_hooked, "register_full_backward_hook", "2"),
], ids=["tensor_hook", "module_backward_hook"])
def test_gradient_hooks_are_refused_by_name(make, what, module):
    """A tensor's gradient hook and a module's backward hook change the gradient in code
    torch.export does not record: refused, naming the hook and the module."""
    import tvm_evt
    from tvm_evt.errors import UnsupportedOpError

    with pytest.raises(UnsupportedOpError, match=what) as err:
        tvm_evt.compile_training(make(), (torch.randn(4, 8), torch.randn(4, 8)), loss_fn=F.mse_loss, target="llvm")
    assert err.value.module_path == module
    assert torch.Tensor.register_hook is _REGISTER_HOOK  # the recording wrapper is gone


def test_frozen_parameters_take_no_gradient_and_no_update():
    """requires_grad=False (a frozen embedding or backbone, as fine-tuning has it): torch neither
    differentiates nor updates it, and neither does the step; the trainable rest matches torch."""
    import tvm_evt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model[0].weight.requires_grad_(False)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    step = tvm_evt.compile_training(copy.deepcopy(model), (x, y), loss_fn=F.mse_loss, target="llvm")
    loss, grads = step.loss_and_grads(x, y)
    F.mse_loss(model(x), y).backward()
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert float((grads[n] - p.grad).norm()) <= RTOL * float(p.grad.norm()), n
    frozen, trained = step.parameters()["0.weight"].clone(), step.parameters()["2.weight"].clone()
    step(x, y)
    assert torch.equal(step.parameters()["0.weight"], frozen)
    assert not torch.equal(step.parameters()["2.weight"], trained)


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_custom_autograd_function_is_refused_by_name(wrapped):
    """torch.export keeps a custom Function's forward and drops its backward: differentiating the
    forward would give another gradient than the model's (here zero for the rounding, not the
    identity), so it is refused, naming the Function and the module that applies it."""
    import tvm_evt
    from tvm_evt.errors import UnsupportedOpError

    model = _QuantisedHead() if wrapped else _Quantised()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(UnsupportedOpError, match="_StraightThrough") as err:
        tvm_evt.compile_training(model, (x, y), loss_fn=F.mse_loss, target="llvm")
    assert err.value.module_path == ("body" if wrapped else "")
    # the hooks that found it are gone: the model runs as before
    assert model(x).shape == (4, 8) and not torch.nn.modules.module._global_forward_hooks


def test_modules_run_in_their_own_mode():
    """A batch norm frozen with ``eval()`` inside a training model normalises with its running
    statistics and leaves them alone, a dropout in eval mode drops nothing, as torch runs them;
    the rest trains (the step used to set every module to training mode)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(8, 8, 3),
                          nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2.0)
    model[1].eval()
    model[3].eval()
    step = _assert_trains_as_torch(model, torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)), F.cross_entropy)
    assert model[1].training is False and model[5].training is True  # the caller's model is untouched
    frozen_mean = step.parameters()["1.running_mean"].clone()
    step(torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    assert torch.equal(step.parameters()["1.running_mean"], frozen_mean)  # eval: statistics not updated
