"""compile_training against torch autograd and torch.optim (CPU, llvm, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
import tvm

import tvm_evt
from tvm_evt import models, pipeline
from tvm_evt.errors import InputMismatchError, UnsupportedOpError

from _torch_ref import (assert_step_matches_torch, grad_err, matches_torch, no_dropout, rel_err,
                        torch_loss_and_grads)

LLVM = {"kind": "llvm"}
ZOO_NAMES = sorted(models.ZOO)


def _compile(entry, inputs, **kw):
    return tvm_evt.compile_training(
        copy.deepcopy(entry.model), inputs, loss_fn=entry.loss_fn, target=LLVM, **kw
    )


@pytest.mark.parametrize("name", ZOO_NAMES + ["resnet_basic-nhwc", "vit-nhwc", "vit-pad_keys"])
def test_zoo_loss_and_grads_match_torch(name, monkeypatch):
    name, _, switch = name.partition("-")  # a default rewrite (pipeline.OPTIONAL) switched off
    if switch:
        monkeypatch.setenv(pipeline.DISABLE_ENV, switch)
    entry = models.ZOO[name]()
    no_dropout(entry.model)
    step = _compile(entry, entry.example_inputs())
    assert_step_matches_torch(step, entry, entry.example_inputs())  # fresh inputs, not the ones traced


def _trajectory(entry, opt_factory, tvm_opt, steps=5, lr=None, inplace=False, clip=None):
    model = copy.deepcopy(entry.model)
    step = tvm_evt.compile_training(
        copy.deepcopy(model), entry.example_inputs(), loss_fn=entry.loss_fn,
        optimizer=tvm_opt, target=LLVM, inplace=inplace,
    )
    ref = copy.deepcopy(entry.training_module()).train()
    ref_model = ref.model if hasattr(ref, "loss_fn") else ref
    ref_model.load_state_dict(model.state_dict())
    opt = opt_factory(ref_model.parameters())
    vanishing = set()
    for i in range(steps):
        batch = entry.example_inputs()
        opt.zero_grad()
        ref_loss = ref(*batch)
        ref_loss.backward()
        if i == 0:
            # gradients that are zero in exact arithmetic (a key bias under softmax) are
            # rounding noise; Adam normalises noise into full-size steps of ±lr
            total = sum(float(p.grad.norm()) ** 2 for p in ref_model.parameters()) ** 0.5
            vanishing = {n for n, p in ref_model.named_parameters()
                         if float(p.grad.norm()) < 1e-6 * total}
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
        opt.step()
        loss = step(*batch)
        assert rel_err(loss, ref_loss.detach()) <= 1e-4
    params = step.parameters()
    for n, p in ref_model.named_parameters():
        if n in vanishing and lr is not None:
            assert float((params[n] - p.detach()).abs().max()) <= 2 * steps * lr, n
        else:
            assert rel_err(params[n], p.detach()) <= 1e-4, n


@pytest.mark.parametrize("name", ["mlp", "bert_layer"])
def test_sgd_trajectory(name):
    entry = models.ZOO[name]()
    no_dropout(entry.model)
    _trajectory(
        entry,
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
        tvm_evt.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-2),
    )


@pytest.mark.parametrize("name", ["mlp", "bert_layer"])
def test_adamw_trajectory(name):
    entry = models.ZOO[name]()
    no_dropout(entry.model)
    _trajectory(
        entry,
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05),
        tvm_evt.optim.AdamW(lr=1e-3, weight_decay=0.05),
        lr=1e-3,
    )


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("clip", [0.05, 1e3], ids=["clipping", "under_the_norm"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_max_grad_norm_clips_as_torch_does(opt, clip, inplace):
    """``max_grad_norm``: torch.nn.utils.clip_grad_norm_ before each update, in the step."""
    entry = models.ZOO["mlp"]()
    no_dropout(entry.model)
    if opt == "sgd":
        _trajectory(entry, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                    tvm_evt.optim.SGD(lr=0.05, momentum=0.9, max_grad_norm=clip), clip=clip, inplace=inplace)
    else:
        _trajectory(entry, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05),
                    tvm_evt.optim.AdamW(lr=1e-3, weight_decay=0.05, max_grad_norm=clip), lr=1e-3, clip=clip,
                    inplace=inplace)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_inplace_update_trajectory(opt):
    """inplace=True: the update writes over the step's parameters and slots, with torch's numbers."""
    entry = models.ZOO["mlp"]()
    no_dropout(entry.model)
    if opt == "sgd":
        _trajectory(entry, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
                    tvm_evt.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-2), inplace=True)
    else:
        _trajectory(entry, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05),
                    tvm_evt.optim.AdamW(lr=1e-3, weight_decay=0.05), lr=1e-3, inplace=True)


def test_inplace_update_keeps_its_tensors_and_leaves_the_callers_alone():
    entry = models.ZOO["mlp"]()
    model = copy.deepcopy(entry.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = tvm_evt.compile_training(model, entry.example_inputs(), loss_fn=entry.loss_fn,
                                    optimizer=tvm_evt.optim.AdamW(lr=1e-2), target=LLVM, inplace=True)
    held = list(step._params + step._slots)  # the tensors before the first step (kept alive here)
    old = [t.numpy().copy() for t in held]
    for _ in range(3):
        step(*entry.example_inputs())
    # the same tensors, written over (a functional step would have left them as they were)
    assert all(a.same_as(b) for a, b in zip(step._params + step._slots, held))
    assert all(float(abs(t.numpy() - o).max()) > 0 for t, o in zip(held, old))
    for n, p in model.named_parameters():  # the model it was given is not written over
        assert torch.equal(p.detach(), before[n]), n
    # loading parameters copies them into the step's tensors (a captured graph reads those)
    step.load_parameters(before)
    assert all(a.same_as(b) for a, b in zip(step._params, held))
    for n, v in step.parameters().items():
        assert torch.equal(v, before[n]), n


def test_the_step_is_built_alone_and_loss_and_grads_builds_main_adjoint_on_first_use():
    """compile_training builds train_step only (each pass would otherwise run on main_adjoint too);
    the gradients loss_and_grads then builds and returns are the ones the step applies."""
    entry = models.ZOO["mlp"]()
    lr = 0.5
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    optimizer=tvm_evt.optim.SGD(lr=lr), target=LLVM)
    assert not step.vm.module.implements_function("main_adjoint")
    inputs = entry.example_inputs()
    before = {n: v.clone() for n, v in step.parameters().items()}
    loss, grads = step.loss_and_grads(*inputs)
    assert step._adjoint_vm is not None and set(grads) == set(before)
    assert float(step(*inputs)) == pytest.approx(float(loss), rel=1e-6)
    after = step.parameters()
    for n, g in grads.items():
        assert float(g.abs().max()) > 0, n
        assert rel_err(after[n], before[n] - lr * g) <= 1e-5, n


@pytest.mark.parametrize("name", ["resnet_basic", "mlp"])
def test_inplace_step_writes_its_small_state_back(name):
    """inplace=True: batch norm's running statistics, the step counter and the dropout seed are
    copied over their old tensors (one write_back kernel); the step computes what the functional
    one does, dropout masks included (mlp keeps its dropout here)."""
    entry = models.ZOO[name]()
    batches = [entry.example_inputs() for _ in range(3)]
    steps = {inplace: _compile(entry, batches[0], optimizer=tvm_evt.optim.SGD(lr=0.01, momentum=0.9), inplace=inplace)
             for inplace in (False, True)}
    ours = steps[True]
    state = lambda st: [st._step, *st._buffers.values()] + ([st._rng] if st._rng is not None else [])
    held = state(ours)
    losses = {k: [float(st(*b)) for b in batches] for k, st in steps.items()}
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert all(a.same_as(b) for a, b in zip(state(ours), held))
    assert float(ours._step.numpy()) == 3.0
    want, got = steps[False].parameters(), ours.parameters()
    assert set(want) == set(got)
    for n in want:
        assert rel_err(got[n], want[n]) <= 1e-5, n
    inplace = tvm.ir.Op.get("relax.call_tir_inplace")
    calls = []
    tvm.relax.analysis.post_order_visit(ours.graph.mod["train_step"].body, lambda e: calls.append(
        e.args[0].name_hint) if isinstance(e, tvm.relax.Call) and e.op == inplace else None)
    assert sorted(calls) == ["optimizer_update", "write_back"]
    assert (ours._rng is not None) == (name == "mlp") and bool(ours._buffers) == (name == "resnet_basic")


def test_inplace_update_refuses_fp16_loss_scaling():
    entry = models.ZOO["mlp"]()
    with pytest.raises(ValueError, match="fp16"):
        _compile(entry, entry.example_inputs(), precision="fp16", inplace=True)


def test_torch_optimizer_instance_is_accepted():
    entry = models.ZOO["mlp"]()
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1, momentum=0.5, nesterov=True)
    step = _compile(entry, entry.example_inputs(), optimizer=opt)
    assert step.graph.layout.slots == ("momentum_buffer",)


def test_batchnorm_running_stats_follow_torch():
    entry = models.ZOO["resnet_basic"]()
    step = _compile(entry, entry.example_inputs(), optimizer=tvm_evt.optim.SGD(lr=0.0))
    ref = copy.deepcopy(entry.training_module()).train()
    for _ in range(2):
        batch = entry.example_inputs()
        step(*batch)
        ref(*batch)
    ours = step.parameters()
    ref_model = ref.model if hasattr(ref, "loss_fn") else ref
    stats = {n: b for n, b in ref_model.named_buffers() if "running" in n}
    assert stats
    for n, b in stats.items():
        assert rel_err(ours[n], b) <= 1e-4, n


@pytest.mark.parametrize("name, precision", [
    ("mlp", "bf16"), ("mlp", "fp16"), ("bert_layer", "bf16"),
    # LLVM takes minutes to generate x86 code for the layer's float16 kernels (the VM's load: 131 s
    # of the test's 300)
    pytest.param("bert_layer", "fp16", marks=pytest.mark.slow)])
def test_mixed_precision_agrees_with_fp32(name, precision):
    torch.manual_seed(0)  # bf16 noise sits near the bound: a fixed draw keeps the verdict stable
    entry = models.ZOO[name]()
    no_dropout(entry.model)
    inputs = entry.example_inputs()
    fp32 = _compile(entry, inputs)
    low = _compile(entry, inputs, precision=precision)
    loss32, grads32 = fp32.loss_and_grads(*inputs)
    loss, grads = low.loss_and_grads(*inputs)
    assert loss.dtype == torch.float32
    assert rel_err(loss, loss32) <= 2e-2
    names = sorted(grads32)
    assert all(grads[n].dtype == torch.float32 for n in names)  # fp32 master gradients
    flat = lambda gs: torch.cat([gs[n].flatten().double() for n in names])
    assert rel_err(flat(grads), flat(grads32)) <= 2e-2
    # per parameter, gradients far below the largest one (a query bias: a cancellation of
    # large terms) are judged against a tenth of the largest, bf16 having 8 mantissa bits
    largest = max(float(g.norm()) for g in grads32.values())
    for n in names:
        assert grad_err(grads[n], grads32[n], 100 * largest) <= 2e-2, n
    # a full step runs and updates fp32 master weights
    before = {n: v.clone() for n, v in low.parameters().items()}
    float(low(*inputs))
    assert any(not torch.equal(before[n], v) for n, v in low.parameters().items())


class _DropoutProbe(torch.nn.Module):
    def __init__(self, n, p):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))
        self.drop = torch.nn.Dropout(p)

    def forward(self, c):
        return (self.drop(self.w) * c).sum()


def test_dropout_keep_rate_and_same_mask_forward_backward():
    n, p = 1_000_000, 0.3
    c = torch.rand(n) + 0.5
    step = tvm_evt.compile_training(_DropoutProbe(n, p), (c,), target=LLVM, seed=1234)
    loss, grads = step.loss_and_grads(c)
    g = grads["w"]
    keep = g != 0
    assert abs(float(keep.double().mean()) - (1 - p)) <= 0.01 * (1 - p)
    # backward: grad = c * mask / (1 - p) exactly on kept elements
    assert rel_err(g[keep], c[keep] / (1 - p)) <= 1e-6
    # forward used the same mask: loss = Σ w·c·mask/(1-p) with w = 1
    assert rel_err(loss, (c.double() * keep).sum() / (1 - p)) <= 1e-4  # fp32 sum of 1e6 terms
    # the masks follow Philox's (seed, counter) convention; a training step draws a fresh mask:
    # train_step returns the next state (counter + 1) on the device
    from tvm_evt.relax_passes.training.philox import dropout_keep_numpy

    assert torch.equal(keep, torch.from_numpy(dropout_keep_numpy(n, (1234, 0), 0, p)))
    step(c)
    _, grads2 = step.loss_and_grads(c)
    assert torch.equal(grads2["w"] != 0, torch.from_numpy(dropout_keep_numpy(n, (1234, 1), 0, p)))
    assert step.graph.layout.advances_seed and not torch.equal(grads2["w"] != 0, keep)


class _Cumprod(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cumprod(self.inner(x), dim=-1).sum()


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Cumprod()

    def forward(self, x):
        return self.block(x)


def test_unsupported_op_names_op_and_module():
    with pytest.raises(UnsupportedOpError) as info:
        tvm_evt.compile_training(_Outer(), (torch.randn(2, 4),), target=LLVM)
    msg = str(info.value)
    assert "cumprod" in msg and "block" in msg


class _TargetWeighted(torch.nn.Module):
    """A loss weighted by a function of the targets that has no gradient rule (cumprod), on no
    path from a parameter: TVM's Gradient still differentiates it."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x, labels):
        return (self.head(x) * torch.cumprod(labels.float(), -1)).mean()


def test_unsupported_op_on_the_targets_side_names_op_and_module():
    with pytest.raises(UnsupportedOpError, match=r"aten\.cumprod.*no gradient rule for relax\.cumprod"):
        tvm_evt.compile_training(_TargetWeighted(), (torch.randn(2, 4), torch.randint(0, 9, (2, 4))), target=LLVM)


class _Cropped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.crop = torch.nn.ZeroPad2d(-1)  # a negative padding crops

    def forward(self, x):
        return self.crop(self.conv(x)).mean()


def test_a_call_its_gradient_rule_refuses_names_op_module_and_reason():
    """A rule's own refusal (``GradientRuleError``) reached the user as TVM's error, naming no module."""
    with pytest.raises(UnsupportedOpError, match=r"aten\.constant_pad_nd.* module 'crop'.*negative pad widths"):
        tvm_evt.compile_training(_Cropped(), (torch.randn(2, 3, 8, 8),), target=LLVM)


def test_wrong_inputs_are_reported():
    entry = models.ZOO["mlp"]()
    inputs = entry.example_inputs()
    step = _compile(entry, inputs)
    bad = (inputs[0][:1],) + tuple(inputs[1:])
    with pytest.raises(InputMismatchError, match="expected shape"):
        step(*bad)
    with pytest.raises(InputMismatchError, match="dtype"):
        step(*((inputs[0].double(),) + tuple(inputs[1:])))
    with pytest.raises(InputMismatchError, match="takes"):
        step(*inputs, inputs[0])


def test_relax_irmodule_is_accepted():
    from tvm.relax.frontend.torch import from_exported_program

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return (self.net(x) ** 2).mean()

    x = torch.randn(3, 8)
    ep = torch.export.export(Loss(), (x,))
    mod = from_exported_program(ep, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    step = tvm_evt.compile_training(mod, (x,), target=LLVM)
    loss, grads = step.loss_and_grads(x)
    ref = Loss()(x)
    ref.backward()
    assert rel_err(loss, ref.detach()) <= 1e-5
    ref_grads = [p.grad for p in model.parameters()]
    assert [rel_err(g, r) for g, r in zip(grads.values(), ref_grads)] < [1e-5] * len(ref_grads)


def test_setup_lists_every_package():
    """A plain `pip install .` installs only the packages setup.py names."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "setup.py").read_text())
    listed = next(
        ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
        for k in node.keywords if k.arg == "packages"
    )
    dirs = {"tvm_evt": root / "python/tvm_evt", "tvm_evt.relax_passes": root / "relax_passes",
            "tvm_evt.codegen": root / "codegen"}
    found = set()
    for pkg, base in dirs.items():
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((pkg, *rel)))
    assert found == set(listed)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_graphs_type_check_for_every_zoo_model(precision):
    """AMP must leave no mixed-dtype op behind (tuple operands, conv out_dtype, pooling
    gradients): every zoo training graph builds and survives the EVT graph passes."""
    from tvm_evt.relax_passes.graph.graph_passes import evt_graph_passes

    for name in ZOO_NAMES:
        entry = models.ZOO[name]()
        imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
        graph = tvm_evt.build_training_module(imported, None, precision)
        evt_graph_passes()(graph.mod)


@pytest.mark.parametrize("name", ["vit", "xml_cnn", "resnet_basic"])
def test_bf16_conv_and_concat_models_agree_with_fp32(name):
    entry = models.ZOO[name]()
    no_dropout(entry.model)
    inputs = entry.example_inputs()
    loss32, _ = _compile(entry, inputs).loss_and_grads(*inputs)
    loss, _ = _compile(entry, inputs, precision="bf16").loss_and_grads(*inputs)
    assert rel_err(loss, loss32) <= 2e-2


def test_dropout_mask_is_generated_in_the_tensors_shape():
    """The Philox kernel writes the mask shaped like x (row-major element index), matching the
    numpy reference of the convention; CUDA's FuseTIR rejected a reshape after it."""
    import numpy as np
    import tvm
    from tvm import relax

    from tvm_evt.relax_passes.training.lower_dropout import LowerDropout
    from tvm_evt.relax_passes.training.philox import dropout_keep_numpy

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 5, 7), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            d = bb.emit(relax.op.nn.dropout(x, 0.4))
            y = bb.emit_output(relax.TupleGetItem(d, 0))
        bb.emit_func_output(y)
    mod = LowerDropout()(bb.get())
    assert "reshape" not in mod.script()
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](
        tvm.runtime.tensor(np.ones((3, 5, 7), "float32")),
        tvm.runtime.tensor(np.array([11, 22], "uint32")),
    ).numpy()
    keep = dropout_keep_numpy(105, (11, 22), 0, 0.4).reshape(3, 5, 7)
    np.testing.assert_array_equal(out != 0, keep)


def test_inputs_may_be_views_at_an_offset():
    """A slice of a larger tensor (storage offset, not 64-byte aligned) still runs: the step
    copies what DLPack cannot hand over as is."""
    entry = models.ZOO["mlp"]()
    no_dropout(entry.model)
    x, target = entry.example_inputs()
    step = _compile(entry, (x, target))
    big = torch.randn(x.numel() + 3)
    view = big[3:].view(x.shape)  # 12-byte offset
    loss, _ = step.loss_and_grads(view, target)
    ref_loss, _, _ = torch_loss_and_grads(entry, (view.clone(), target))
    assert rel_err(loss, ref_loss) <= 1e-5


@pytest.mark.parametrize("target", ["llvm", {"kind": "llvm"}])
def test_tvm_compile_with_the_registered_evt_pipeline(target):
    """`tvm.compile(..., relax_pipeline="evt")` on a tag and on a dict (as a Target: TVM 0.27's
    relax.build rejects bare dicts) gives the same loss as compile_training."""
    import tvm
    from tvm import relax

    entry = models.ZOO["mlp"]()
    no_dropout(entry.model)
    inputs = entry.example_inputs()
    imported = tvm_evt.from_torch(entry.model, inputs, entry.loss_fn)
    graph = tvm_evt.build_training_module(imported, None, "fp32")
    tgt = target if isinstance(target, str) else tvm.target.Target(target)
    ex = tvm.compile(graph.mod, target=tgt, relax_pipeline="evt")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(t.numpy()) for t in inputs]
    args += [tvm.runtime.tensor(v.detach().numpy()) for v in imported.param_values.values()]
    out = vm["main_adjoint"](*args)
    ref_loss, _, _ = torch_loss_and_grads(entry, inputs)
    assert rel_err(torch.from_numpy(out[0][0].numpy()), ref_loss) <= 1e-5


def test_mixed_precision_keeps_batch_statistics_and_the_loss_in_fp32():
    """Normalising by a batch statistic, the affine after it, the running-statistics update and
    the loss's (out - target)**2 compute in fp32 (as autocast's fused batch norm and fp32 losses
    do); the convolutions and the ReLU stay bf16."""
    import tvm
    from tvm import relax

    from tvm_evt.relax_passes.graph.decompose_batch_norm import DecomposeBatchNorm

    entry = models.ZOO["resnet_basic"]()
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    # FuseBatchNorm made each batch norm one tvm_evt.batch_norm call: look at its plain ops
    main = DecomposeBatchNorm()(tvm_evt.build_training_module(imported, None, "bf16").mod)["main"]
    dtypes: dict = {}
    for block in main.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op):
                dtypes.setdefault(b.value.op.name, set()).add(str(b.var.ty.dtype) if hasattr(b.var.ty, "dtype") else "")
    assert dtypes["relax.subtract"] == {"float32"}  # x - mean and out - target
    assert dtypes["relax.divide"] == {"float32"}  # / sqrt(var + eps)
    assert "bfloat16" not in dtypes["relax.multiply"]  # affine scale, running stats, (out - target)**2
    # the 3x3 convolutions are tvm_evt.conv2d ops (implicit_conv), in bf16
    assert dtypes["tvm_evt.conv2d"] == {"bfloat16"} and dtypes["relax.nn.relu"] == {"bfloat16"}


def test_mixed_precision_computes_binary_cross_entropy_in_fp32():
    """BCE with logits imports as (1 - y) z - (min(0, z) - log(1 + exp(-|z|))): all of it, the
    min and |z| included, computes in fp32 as autocast's fp32 loss does, so the adjoints of its
    nearly cancelling terms do not add up in bf16 (XML-CNN's output bias gradient was 2.5 % off)."""
    import tvm
    from tvm import relax

    entry = models.ZOO["xml_cnn"](batch=4, seq=32, vocab=100, embed=16, filters=8, pool_chunks=2,
                                  bottleneck=16, labels=32)
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    main = tvm_evt.build_training_module(imported, None, "bf16").mod["main"]
    dtypes: dict = {}
    for block in main.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op):
                dtypes.setdefault(b.value.op.name, set()).add(str(b.var.ty.dtype) if hasattr(b.var.ty, "dtype") else "")
    for op in ("relax.minimum", "relax.abs", "relax.negative", "relax.exp", "relax.log"):
        assert dtypes[op] == {"float32"}, (op, dtypes[op])
    assert dtypes["relax.matmul"] == {"bfloat16"}


def _channels_last(tensors):
    return [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in tensors]


@pytest.mark.parametrize("nhwc", [True, False])
def test_channels_last_inputs_are_taken_in_place(nhwc, monkeypatch):
    """Channels-last example inputs (how torch runs a ResNet: image and target) become NHWC
    parameters of the step, which meet the NHWC convolutions without a transpose (with the
    convolutions left NCHW, one transpose each); loss and gradients match torch, and
    NCHW-contiguous inputs are still accepted (copied)."""
    from tvm import relax

    if not nhwc:
        monkeypatch.setenv(pipeline.DISABLE_ENV, "nhwc")
    entry = models.ZOO["resnet_basic"]()
    no_dropout(entry.model)
    step = _compile(entry, _channels_last(entry.example_inputs()))
    train = step.graph.mod["train_step"]
    (n, c, h, w), _ = step.imported.input_specs[0]
    assert [tuple(int(d) for d in p.ty.shape) for p in train.params[:2]] == [(n, h, w, c)] * 2
    inputs = set(train.params[:2])
    permuted = []
    relax.analysis.post_order_visit(train, lambda e: permuted.append(e) if isinstance(e, relax.Call)
                                    and e.op.name == "relax.permute_dims" and e.args[0] in inputs else None)
    assert len(permuted) == (0 if nhwc else 2), permuted

    batch = entry.example_inputs()
    assert_step_matches_torch(step, entry, _channels_last(batch), torch_inputs=batch)
    assert_step_matches_torch(step, entry, batch)


def test_train_command_takes_an_inplace_step(capsys):
    from tvm_evt import cli

    assert cli.main(["train", "--model", "mlp", "--steps", "2", "--target", "llvm", "--inplace"]) == 0
    out = capsys.readouterr().out
    assert "step    2  loss" in out and "time per step" in out


def test_train_command_prints_eager_loss_beside_its_own(capfd, monkeypatch):
    """The quick start's first steps print PyTorch eager's loss on the same weights and batch
    (without dropout the two agree), and none of TVM's known-harmless warnings."""
    import functools

    from tvm_evt import cli

    monkeypatch.setitem(models.ZOO, "mlp", functools.partial(models.mlp, dropout=0.0))
    assert cli.main(["train", "--model", "mlp", "--steps", "3", "--target", "llvm", "--compare", "2"]) == 0
    out, err = capfd.readouterr()
    steps = [line.split() for line in out.splitlines() if line.startswith("step")]
    assert len(steps) == 3 and "eager" not in steps[2]
    for words in steps[:2]:
        ours, eager = float(words[words.index("loss") + 1]), float(words[words.index("eager") + 1])
        assert abs(ours - eager) <= 1e-3 * max(1.0, abs(eager)), words
    assert "Fast mode segfaults" not in err and "pragma_scope" not in err


def test_quiet_known_warnings_passes_other_lines_through(capfd, monkeypatch):
    import os

    from tvm_evt.logs import KNOWN_HARMLESS, quiet_known_warnings

    monkeypatch.delenv("TVM_EVT_VERBOSE", raising=False)
    with quiet_known_warnings():
        os.write(2, f"[00:00:00] x.h:1: Warning: {KNOWN_HARMLESS[0].text}. Make sure\n".encode())
        os.write(2, b"[00:00:00] y.cc:2: Warning: something that matters\n")
    assert capfd.readouterr().err == "[00:00:00] y.cc:2: Warning: something that matters\n"
    monkeypatch.setenv("TVM_EVT_VERBOSE", "1")
    with quiet_known_warnings():
        os.write(2, f"{KNOWN_HARMLESS[1].text}\n".encode())
    assert KNOWN_HARMLESS[1].text in capfd.readouterr().err


def test_max_grad_norm_is_refused_with_data_parallel():
    """The data-parallel step updates each bucket as its all-reduce ends, before the norm over
    every gradient exists: refused rather than clipped per bucket."""
    entry = models.ZOO["mlp"]()
    with pytest.raises(ValueError, match="max_grad_norm"):
        tvm_evt.compile_training(entry.model, entry.example_inputs(), loss_fn=entry.loss_fn, target=LLVM,
                                 optimizer=tvm_evt.optim.AdamW(max_grad_norm=1.0), data_parallel=True)


class _HeadlessAttention(torch.nn.Module):
    """Attention written by hand over [batch, tokens, features], no heads: ``q @ k^T`` of two linear
    layers (or the chunks of a fused one).  The backward's ``dQ = dS @ k`` transposes the forward's
    transposed ``k`` again; after common subexpressions joined them, the partitioner read the inner
    transpose the forward's GEMM had absorbed (an undefined variable at VM codegen)."""

    def __init__(self, h: int = 32, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.qkv = torch.nn.Linear(h, 3 * h) if fused else None
        self.q, self.k = (None, None) if fused else (torch.nn.Linear(h, h), torch.nn.Linear(h, h))

    def forward(self, x):
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), x
        return torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v


@pytest.mark.parametrize("fused", [False, True], ids=["two_linears", "fused_qkv"])
def test_headless_attention_trains_as_torch(fused):
    torch.manual_seed(0)
    module, x, t = _HeadlessAttention(fused=fused), torch.randn(4, 32, 32), torch.randn(4, 32, 32)
    matches_torch(module, (x, t), torch.nn.functional.mse_loss)


def test_a_float16_model_trains_as_torch_computes_it_in_float32():
    """A model in ``.half()``: its linear layers (``addmm`` of fp16 operands, which the stock
    importer could not convert) train, loss and gradients as torch's float32 ones of the same weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).half()
    x, y = torch.randn(8, 16).half(), torch.randint(0, 10, (8,))
    step = tvm_evt.compile_training(copy.deepcopy(model), (x, y), loss_fn=torch.nn.functional.cross_entropy,
                                    target=LLVM)
    loss, grads = step.loss_and_grads(x, y)
    ref = copy.deepcopy(model).float()
    want = torch.nn.functional.cross_entropy(ref(x.float()), y)
    want.backward()
    assert abs(float(loss) - float(want.detach())) < 1e-2 * abs(float(want.detach()))
    largest = max(float(p.grad.norm()) for p in ref.parameters())
    for name, p in ref.named_parameters():
        assert float((torch.as_tensor(grads[name]).float() - p.grad).norm()) < 1e-2 * largest, name


def test_bfloat16_parameters_are_refused_naming_them():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)).bfloat16()
    x, y = torch.randn(8, 16).bfloat16(), torch.randint(0, 10, (8,))
    with pytest.raises(TypeError, match=r"'0\.weight', '0\.bias', '2\.weight' and 1 more are bfloat16.*precision='bf16'"):
        tvm_evt.compile_training(model, (x, y), loss_fn=torch.nn.functional.cross_entropy, target=LLVM)
