"""optimizer_update: every parameter's update in one PrimFunc (portable form on llvm, one-kernel
form on CUDA), against torch.optim on the same tensors; AppendOptimizer emits one call of it, or,
for a deep model, one a repeat of its layers (``kernel_groups``) that computes the same bits."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.training import optimizer_update, optimizers
from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU

torch = pytest.importorskip("torch")

SHAPES = [(3, 700), (5,), (2, 3, 4)]  # 2100 elements: three blocks of the GPU form
CASES = {
    "adamw": (optimizers.AdamW(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
    "sgd_nesterov": (optimizers.SGD(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    "sgd_dampening": (optimizers.SGD(lr=0.1, momentum=0.9, dampening=0.5),
                      lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5)),
    "sgd": (optimizers.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
}
STEPS = 3


def _torch_trajectory(make, params, grads):
    ps = [torch.nn.Parameter(torch.tensor(p)) for p in params]
    opt = make(ps)
    for step in range(STEPS):
        for p, g in zip(ps, grads[step]):
            p.grad = torch.tensor(g)
        opt.step()
    return [p.detach().numpy() for p in ps]


def _ours(optimizer, params, grads, run):
    slots = optimizer.slots()
    state = {s: [np.zeros_like(p) for p in params] for s in slots}
    for step in range(STEPS):
        outs = run(params + grads[step] + [t for s in slots for t in state[s]] + [np.float32(step + 1)])
        n = len(params)
        params = outs[:n]
        state = {s: outs[n * (1 + k): n * (2 + k)] for k, s in enumerate(slots)}
    return params


def _inputs():
    rng = np.random.default_rng(0)
    params = [rng.normal(size=s).astype("float32") for s in SHAPES]
    grads = [[rng.normal(size=s).astype("float32") for s in SHAPES] for _ in range(STEPS)]
    return params, grads


def _runner(func, target, device, optimizer):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    out_shapes = SHAPES * (1 + len(optimizer.slots()))

    def run(arrays):
        outs = [tvm.runtime.empty(s, "float32", device) for s in out_shapes]
        lib["main"](*[tvm.runtime.tensor(np.asarray(a, dtype="float32"), device) for a in arrays], *outs)
        return [o.numpy() for o in outs]

    return run


@pytest.mark.parametrize("name", sorted(CASES))
def test_portable_form_tracks_torch(name):
    optimizer, make = CASES[name]
    params, grads = _inputs()
    func = optimizer_update.update_primfunc(optimizer, [(s, "float32") for s in SHAPES])
    got = _ours(optimizer, params, grads, _runner(func, tvm.target.Target({"kind": "llvm"}), tvm.cpu(), optimizer))
    for g, w in zip(got, _torch_trajectory(make, params, grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_gpu_form_is_one_kernel_over_every_parameter():
    optimizer = CASES["adamw"][0]
    func = optimizer_update.update_primfunc(optimizer, [(s, "float32") for s in SHAPES])
    mod = tvm.IRModule({"optimizer_update": func.with_attr("global_symbol", "optimizer_update")})
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        gpu = ScheduleTIRForGPU()(mod)["optimizer_update"]
    assert int(gpu.attrs["tirx.is_scheduled"]) == 1 and str(gpu.attrs["global_symbol"]) == "optimizer_update"
    blocks = sum((int(np.prod(s)) + optimizer_update.ELEMS_PER_BLOCK - 1) // optimizer_update.ELEMS_PER_BLOCK
                 for s in SHAPES)
    text = gpu.script()
    assert text.count('thread="blockIdx.x"') == 1 and text.count('thread="threadIdx.x"') == 1
    assert f'T.thread_binding({blocks}, thread="blockIdx.x")' in text
    assert f'T.thread_binding({optimizer_update.THREADS}, thread="threadIdx.x")' in text
    assert len(gpu.params) == len(func.params)


def _inplace_runner(func, target, device, optimizer):
    """Run an in-place update: the new parameters and slots are read back from its inputs."""
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    n, k = len(SHAPES), len(optimizer.slots())

    def run(arrays):
        args = [tvm.runtime.tensor(np.asarray(a, dtype="float32"), device) for a in arrays]
        lib["main"](*args)
        return [a.numpy() for a in args[:n] + args[2 * n: 2 * n + n * k]]

    return run


@pytest.mark.parametrize("name", sorted(CASES))
def test_inplace_portable_form_tracks_torch(name):
    """Written over its inputs, the update still reads each element's old values before storing
    the new ones (SGD's momentum reads the parameter, AdamW's update the new moments)."""
    optimizer, make = CASES[name]
    params, grads = _inputs()
    func = optimizer_update.loop_primfunc(optimizer, [(s, "float32") for s in SHAPES], gpu=False, inplace=True)
    assert len(func.params) == 2 * len(SHAPES) + len(SHAPES) * len(optimizer.slots()) + 1  # no outputs
    got = _ours(optimizer, params, grads, _inplace_runner(func, tvm.target.Target({"kind": "llvm"}), tvm.cpu(), optimizer))
    for g, w in zip(got, _torch_trajectory(make, params, grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_inplace_gpu_form_keeps_the_inplace_signature():
    optimizer = CASES["adamw"][0]
    func = optimizer_update.loop_primfunc(optimizer, [(s, "float32") for s in SHAPES], gpu=False, inplace=True)
    mod = tvm.IRModule({"optimizer_update": func.with_attr("global_symbol", "optimizer_update")})
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        gpu = ScheduleTIRForGPU()(mod)["optimizer_update"]
    assert int(gpu.attrs["tirx.is_scheduled"]) == 1 and len(gpu.params) == len(func.params)
    assert gpu.script().count('thread="blockIdx.x"') == 1
    tvm.tirx.build(tvm.IRModule({"optimizer_update": gpu}), target=target)  # nvrtc/nvcc: no GPU needed


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_form_tracks_torch(name, inplace):
    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA device")
    optimizer, make = CASES[name]
    params, grads = _inputs()
    func = optimizer_update.loop_primfunc(optimizer, [(s, "float32") for s in SHAPES], gpu=True, inplace=inplace)
    runner = _inplace_runner if inplace else _runner
    got = _ours(optimizer, params, grads,
                runner(func, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}), tvm.cuda(0), optimizer))
    for g, w in zip(got, _torch_trajectory(make, params, grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _train_step():
    """A linear layer's loss, its gradient and an AdamW step (AppendOptimizer)."""
    from tvm_evt.relax_passes.training.append_optimizer import AppendOptimizer

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    ws = [relax.Var("w", relax.TensorType((8, 8), "float32")), relax.Var("b", relax.TensorType((8,), "float32"))]
    with bb.function("main", [x, *ws], attrs={"num_input": 1}):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(x, relax.op.permute_dims(ws[0])), ws[1]))  # dW: a transpose
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, y)))
        bb.emit_func_output(relax.Tuple([loss]))
    mod = relax.transform.Gradient("main", require_grads=ws)(bb.get())
    return AppendOptimizer(optimizers.AdamW(), num_params=2)(mod)


def test_append_optimizer_emits_one_update_call():
    mod = _train_step()
    calls = []
    relax.analysis.post_order_visit(
        mod["train_step"].body,
        lambda e: calls.append(e.args[0].name_hint) if isinstance(e, relax.Call) and e.op == tvm.ir.Op.get(
            "relax.call_tir") else None)
    assert calls == ["optimizer_update"]
    func = mod["optimizer_update"]
    assert optimizer_update.OPTIMIZER_ATTR in func.attrs
    # opaque to FuseOps (BERT's transposed weight gradients were fused into it, dropping its attributes)
    annotated = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(mod))
    assert int(annotated["optimizer_update"].attrs["op_pattern"]) == optimizer_update.OPAQUE


# one layer: weight, bias, norm weight, norm bias, then a wider one (12 parameters, as kernel_groups sees them)
LAYER = [((64, 64),), ((64,),)] * 4 + [((256, 64),), ((256,),), ((64, 256),), ((64,),)]


@pytest.mark.parametrize("layers,want", [
    (5, [(0, 2 + 5 * 12 + 1)]),  # 63 parameters: one kernel, as ever
    # 24 layers between an embedding and a head: a kernel a layer, one before and one after
    (24, [(0, 2)] + [(2 + 12 * k, 14 + 12 * k) for k in range(24)] + [(290, 291)]),
])
def test_kernel_groups_are_the_layers_of_a_deep_model(layers, want):
    keys = [((1000, 64),), ((512, 64),)] + LAYER * layers + [((1000,),)]
    assert optimizer_update.kernel_groups(keys) == want


def test_kernel_groups_of_parameters_that_never_repeat_are_bounded():
    keys = [((k + 1,),) for k in range(150)]
    groups = optimizer_update.kernel_groups(keys)
    assert groups == [(0, 50), (50, 100), (100, 150)]


def test_kernel_groups_take_repeats_of_at_least_a_few_parameters():
    """Equal parameters in a row repeat with any period: not one kernel each, but the shortest
    period of at least MIN_REPEAT_PARAMS that covers them all."""
    groups = optimizer_update.kernel_groups([((8, 8),)] * 100)
    assert groups == [(10 * k, 10 * k + 10) for k in range(10)]


class _Deep(torch.nn.Module):
    """Layers of Linear + LayerNorm: 4 parameters a layer."""

    def __init__(self, layers: int, width: int = 8):
        super().__init__()
        self.layers = torch.nn.Sequential(*[m for _ in range(layers)
                                            for m in (torch.nn.Linear(width, width), torch.nn.LayerNorm(width))])

    def forward(self, x):
        return self.layers(x).square().mean()


@pytest.mark.parametrize("inplace", [False, True])
def test_a_deep_models_update_kernels_compute_what_one_kernel_does(inplace, monkeypatch):
    """40 parameters, at most 32 a kernel: one update kernel per two layers (the shortest repeat of
    at least MIN_REPEAT_PARAMS), all the same PrimFunc; three AdamW steps leave the parameters bit
    for bit where the one kernel over all of them leaves them."""
    import copy

    import tvm_evt
    from tvm_evt import optim

    torch.manual_seed(0)
    model = _Deep(10)
    x = torch.randn(4, 8)
    monkeypatch.setattr(optimizer_update, "MAX_KERNEL_PARAMS", 32)

    def trained():
        step = tvm_evt.compile_training(copy.deepcopy(model), [x], optimizer=optim.AdamW(lr=1e-2, weight_decay=0.1),
                                        target={"kind": "llvm"}, inplace=inplace)
        for _ in range(3):
            step(x)
        updates = [e.args[0] for e in _calls(step.graph.mod["train_step"])
                   if optimizer_update.OPTIMIZER_ATTR in step.graph.mod[e.args[0]].attrs]
        return {n: p.numpy().copy() for n, p in step.parameters().items()}, updates

    params, updates = trained()
    assert len(updates) == 5 and len(set(updates)) == 1
    monkeypatch.setattr(optimizer_update, "MAX_KERNEL_PARAMS", 1000)
    one_params, one_update = trained()
    assert len(one_update) == 1
    for name, value in one_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)


def _calls(func) -> list:
    """The call_tir / call_tir_inplace calls in `func`."""
    kernels = (tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.call_tir_inplace"))
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and e.op in kernels else None)
    return found


def test_cuda_tuning_leaves_the_update_to_its_own_form():
    """MetaSchedule would tune the portable form (a loop nest a parameter) into several kernels:
    on CUDA the update is no tuning task (ScheduleTIRForGPU swaps in its one kernel); on llvm it is."""
    from tvm_evt import tuning

    mod = relax.transform.LegalizeOps()(_train_step())
    names = lambda target: {t.task_name for t in tuning.extract_tasks(mod, tvm.target.Target(target))}
    assert any("optimizer_update" in n for n in names({"kind": "llvm"}))
    assert not any("optimizer_update" in n for n in names({"kind": "cuda", "arch": "sm_90a"}))


def test_plain_tvm_cuda_schedule_takes_the_portable_form():
    """A train step built with TVM's own CUDA pipeline: DLight's default rules schedule the
    portable form (a kernel an output) where a nest of several blocks made them raise."""
    from tvm.s_tir import dlight as dl

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        mod = relax.transform.LegalizeOps()(_train_step())
        mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                      dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
    assert int(mod["optimizer_update"].attrs["tirx.is_scheduled"]) == 1


# ------------------------------------------------------------------ weight copies (bf16 / fp16)

COPIES = ["bfloat16", None, "float16"]  # the first and last parameter have a copy


def _bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """`a` (float32) rounded to `dtype` as its raw 16 bits (torch rounds to nearest even, as TVM)."""
    t = torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dtype))
    return t.view(torch.int16).numpy()


def _raw16(t) -> np.ndarray:
    return torch.from_dlpack(t).view(torch.int16).cpu().numpy()


@pytest.mark.parametrize("inplace", [False, True])
def test_portable_forms_write_each_copy_as_the_new_parameter_cast(inplace):
    """Each copy is its new parameter rounded to the copy's dtype, bit for bit, in the out-of-place
    (TE) and in-place (loop) forms; the parameters and slots are what they are without copies."""
    optimizer = CASES["adamw"][0]
    params, grads = _inputs()
    specs = [(s, "float32") for s in SHAPES]
    slots = optimizer.slots()
    if inplace:
        func = optimizer_update.loop_primfunc(optimizer, specs, copies=COPIES, gpu=False, inplace=True)
        plain = optimizer_update.loop_primfunc(optimizer, specs, gpu=False, inplace=True)
    else:
        func = optimizer_update.update_primfunc(optimizer, specs, copies=COPIES)
        plain = optimizer_update.update_primfunc(optimizer, specs)
    copied = [(s, c) for s, c in zip(SHAPES, COPIES) if c is not None]
    assert len(func.params) == len(plain.params) + len(copied)
    dev = tvm.cpu()
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    base = tvm.compile(tvm.IRModule({"main": plain.with_attr("global_symbol", "main")}), target="llvm")
    state = [np.zeros_like(p) for _ in slots for p in params]
    arrays = params + grads[0] + state + [np.float32(1)]
    n = len(SHAPES)
    outs_plain = [tvm.runtime.empty(s, "float32", dev) for s in SHAPES * (1 + len(slots))]
    args_plain = [tvm.runtime.tensor(np.asarray(a, dtype="float32"), dev) for a in arrays]
    base["main"](*args_plain, *([] if inplace else outs_plain))
    want = [a.numpy() for a in (args_plain[:n] + args_plain[2 * n:2 * n + n * len(slots)] if inplace else outs_plain)]
    args = [tvm.runtime.tensor(np.asarray(a, dtype="float32"), dev) for a in arrays]
    copies = [tvm.runtime.empty(s, c, dev) for s, c in copied]
    if inplace:
        lib["main"](*args, *copies)
        got = [a.numpy() for a in args[:n] + args[2 * n:2 * n + n * len(slots)]]
    else:
        outs = [tvm.runtime.empty(s, "float32", dev) for s in SHAPES * (1 + len(slots))]
        lib["main"](*args, *outs, *copies)
        got = [o.numpy() for o in outs]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    new_params = [got[i] for i, c in enumerate(COPIES) if c is not None]
    for copy, p, (_, c) in zip(copies, new_params, copied):
        np.testing.assert_array_equal(_raw16(copy), _bits(p, c))


def test_gpu_form_with_copies_builds_for_cuda():
    """The one-kernel form (rebuilt from the portable one's attributes, as ScheduleTIRForGPU does)
    takes the copies' arguments too, and compiles (nvrtc/nvcc: no GPU needed)."""
    optimizer = CASES["adamw"][0]
    func = optimizer_update.loop_primfunc(optimizer, [(s, "float32") for s in SHAPES], copies=COPIES,
                                          gpu=False, inplace=True)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        gpu = ScheduleTIRForGPU()(tvm.IRModule({"optimizer_update": func.with_attr("global_symbol",
                                                                                  "optimizer_update")}))
    gpu = gpu["optimizer_update"]
    assert int(gpu.attrs["tirx.is_scheduled"]) == 1 and len(gpu.params) == len(func.params)
    src = tvm.tirx.build(tvm.IRModule({"optimizer_update": gpu}), target=target).imports[0].inspect_source()
    assert "nv_bfloat16" in src and "half" in src


@pytest.mark.gpu
def test_gpu_form_copies_match_the_portable_form():
    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA device")
    optimizer = CASES["adamw"][0]
    params, grads = _inputs()
    specs = [(s, "float32") for s in SHAPES]
    func = optimizer_update.loop_primfunc(optimizer, specs, copies=COPIES, gpu=True, inplace=True)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    dev = tvm.cuda(0)
    state = [np.zeros_like(p) for _ in optimizer.slots() for p in params]
    args = [tvm.runtime.tensor(np.asarray(a, dtype="float32"), dev) for a in params + grads[0] + state + [np.float32(1)]]
    copies = [tvm.runtime.empty(s, c, dev) for s, c in zip(SHAPES, COPIES) if c is not None]
    lib["main"](*args, *copies)
    new_params = [args[i].numpy() for i, c in enumerate(COPIES) if c is not None]
    for copy, p, c in zip(copies, new_params, [c for c in COPIES if c is not None]):
        np.testing.assert_array_equal(_raw16(copy), _bits(p, c))
