"""AbsorbPartitionInputCasts and SaveSoftmaxLowPrecision on a bert_layer training graph."""
import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt import models, pipeline, tuning
from tvm_evt.codegen.legality import legality
from tvm_evt.relax_passes.partition.absorb_partition_input_casts import AbsorbPartitionInputCasts
from tvm_evt.relax_passes.graph.save_softmax_low_precision import SaveSoftmaxLowPrecision, low_precision_copies

from _passes import flat_numpy

ASTYPE = tvm.ir.Op.get("relax.astype")


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    """Both rewrites are on unless a user switched them off (pipeline.OPTIONAL)."""
    monkeypatch.delenv(pipeline.DISABLE_ENV, raising=False)
    monkeypatch.delenv(pipeline.ENABLE_ENV, raising=False)


def _inverted_residual():
    """torchvision's MobileNetV2 InvertedResidual (expand 1x1, depthwise 3x3, project 1x1, each
    with a batch norm, ReLU6 after the first two), channels-last, under a classifier."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    hidden = 48
    model = nn.Sequential(
        nn.Conv2d(16, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
        nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
        nn.Conv2d(hidden, 24, 1, bias=False), nn.BatchNorm2d(24),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 10))

    def make():
        return (torch.randn(4, 16, 8, 8).contiguous(memory_format=torch.channels_last), torch.randint(0, 10, (4,)))

    return models.ZooEntry(model, make, F.cross_entropy, "MobileNetV2 block", num_targets=1)


def _bottleneck():
    """ResNet-50's bottleneck (1x1, 3x3, 1x1 with batch norms, ReLUs, the identity shortcut),
    channels-last, under a classifier."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(models.Bottleneck(64, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def make():
        return (torch.randn(4, 64, 8, 8).contiguous(memory_format=torch.channels_last), torch.randint(0, 10, (4,)))

    return models.ZooEntry(model.to(memory_format=torch.channels_last), make, F.cross_entropy, "ResNet bottleneck",
                           num_targets=1)


def _graph(precision="bf16", model="bert_layer"):
    """bert_layer (small), a ResNet or MobileNetV2 block, or a scripts/bench.py model at its quick
    shapes."""
    from tvm_evt import bench_e2e

    if model == "bert_layer":
        entry = models.ZOO["bert_layer"](batch=2, seq=16, hidden=64, heads=4)
    elif model == "inverted_residual":
        entry = _inverted_residual()
    elif model == "bottleneck":
        entry = _bottleneck()
    else:
        entry = bench_e2e.build_entry(model, True)
    return tuning.training_graph(entry, precision)[1].mod


def _front(mod, absorb=True):
    passes = pipeline.front_passes()
    assert "AbsorbPartitionInputCasts" in [p.info.name for p in passes]
    if not absorb:
        passes = [p for p in passes if p.info.name != "AbsorbPartitionInputCasts"]
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        return tvm.transform.Sequential(passes)(mod)


def _partition_args(mod, fn="train_step"):
    parts = tuning.evt_functions(mod)
    bindings = [b for block in mod[fn].body.blocks for b in block.bindings]
    bound = {b.var: b.value for b in bindings}
    return parts, [(b.value, [bound.get(a) for a in b.value.args]) for b in bindings
                   if isinstance(b.value, relax.Call) and b.value.op in parts]


def test_softmax_gradient_reads_the_rounded_copy():
    mod = _graph()
    with tvm.target.Target("llvm"):
        mod = tvm.transform.Sequential(pipeline.pre_partition_passes())(mod)
    func = mod["train_step"]
    (p, pb), = low_precision_copies(func).items()
    readers = [b.value for block in func.body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and any(a.same_as(p) for a in b.value.args)]
    assert [r.op for r in readers] == [ASTYPE]  # only the cast to bf16 reads the float32 softmax
    widened = [b.var for block in func.body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and b.value.op == ASTYPE and b.value.args[0].same_as(pb)
               and str(b.value.attrs.dtype) == "float32"]
    assert widened  # the gradient's float32 P


def test_save_softmax_leaves_a_softmax_without_low_copy_alone():
    mod = _graph("fp32")
    with tvm.target.Target("llvm"):
        before = tvm.transform.Sequential(pipeline.pre_partition_passes())(mod)
    assert not low_precision_copies(before["train_step"])
    tvm.ir.assert_structural_equal(SaveSoftmaxLowPrecision()(before), before)


def test_casts_feeding_only_an_epilogue_move_into_the_partition():
    without, with_ = _front(_graph(), absorb=False), _front(_graph())
    _, calls_before = _partition_args(without)
    parts, calls_after = _partition_args(with_)
    cast_args = lambda calls: sum(isinstance(v, relax.Call) and v.op == ASTYPE for _, vals in calls for v in vals)  # noqa: E731
    assert cast_args(calls_after) < cast_args(calls_before)
    absorbed = [gv for gv in parts if "_c" in gv.name_hint.rsplit("evt", 1)[-1]]
    assert absorbed
    for gv in absorbed:
        assert legality(parts[gv]).ok
    # the float32 P of the softmax gradient is now loaded in bf16 by the dS epilogue
    assert any(str(p.ty.dtype) == "bfloat16" and len(p.ty.shape.values) == 4 and int(p.ty.shape.values[-1]) == 16
               and int(p.ty.shape.values[-2]) == 16 for gv in absorbed for p in parts[gv].params)


def _masks_move_into_partitions(model: str, op: str) -> None:
    """Partition calls of `model` take masks made by `op` as arguments without the absorption, and
    none with it; the partitions computing them are legal."""
    op = tvm.ir.Op.get(op)
    without, with_ = _front(_graph(model=model), absorb=False), _front(_graph(model=model))
    masks = lambda calls: sum(isinstance(v, relax.Call) and v.op == op for _, vals in calls for v in vals)  # noqa: E731
    assert masks(_partition_args(without)[1]) > 0
    parts, calls = _partition_args(with_)
    assert masks(calls) == 0
    absorbed = [f for f in parts.values() if any(e.op == op for e in _calls(f))]
    assert absorbed and all(legality(f).ok for f in absorbed)


def _calls(func):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call) else None)
    return found


def test_relu_masks_feeding_only_an_epilogue_move_into_the_partition():
    """A ResNet bottleneck: the ReLU gradient's greater(y, 0) masks are computed by the backward
    epilogues from y, not written as bool tensors by kernels of their own."""
    _masks_move_into_partitions("bottleneck", "relax.greater")


def test_clamp_masks_feeding_only_an_epilogue_move_into_the_partition():
    """ReLU6's gradient selects by logical_and(greater(y, 0), less(y, 6)): where only the
    projection's input-gradient epilogue reads that mask, the epilogue computes it from y."""
    _masks_move_into_partitions("inverted_residual", "relax.logical_and")


def test_calls_absorbing_other_constants_get_their_own_partition():
    """Two calls of one partition whose masks compare with other constants do not share a copy."""
    from tvm.script import relax as R

    @tvm.script.ir_module
    class Module:
        @R.function
        def part(a: R.Tensor((64, 32), "bfloat16"), b: R.Tensor((32, 64), "bfloat16"),
                 m: R.Tensor((64, 64), "bool")) -> R.Tensor((64, 64), "bfloat16"):
            R.func_attr({"Codegen": "evt", "global_symbol": "part"})

            @R.function
            def inner(a1: R.Tensor((64, 32), "bfloat16"), b1: R.Tensor((32, 64), "bfloat16"),
                      m1: R.Tensor((64, 64), "bool")) -> R.Tensor((64, 64), "bfloat16"):
                R.func_attr({"Composite": "evt.gemm_epilogue"})
                with R.dataflow():
                    y = R.matmul(a1, b1)
                    z = R.where(m1, y, R.const(0, "bfloat16"))
                    R.output(z)
                return z

            out = inner(a, b, m)
            return out

        @R.function
        def main(a: R.Tensor((64, 32), "bfloat16"), b: R.Tensor((32, 64), "bfloat16"),
                 y: R.Tensor((64, 64), "bfloat16")):
            cls = Module
            with R.dataflow():
                m0 = R.greater(y, R.const(0, "bfloat16"))
                z0 = cls.part(a, b, m0)
                m1 = R.greater(y, R.const(1, "bfloat16"))
                z1 = cls.part(a, b, m1)
                R.output(z0, z1)
            return (z0, z1)

    after = AbsorbPartitionInputCasts()(Module)
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)
             and isinstance(b.value.op, tvm.ir.GlobalVar)]
    assert len(calls) == 2 and not calls[0].op.same_as(calls[1].op)
    consts = [[float(e.args[1].value.numpy()) for e in _calls(after[c.op]) if e.op == tvm.ir.Op.get("relax.greater")]
              for c in calls]
    assert consts == [[0.0], [1.0]]


@pytest.mark.parametrize("precision, model", [("bf16", "bert_layer"), ("fp32", "bert_layer"),
                                              ("bf16", "bottleneck"), ("bf16", "inverted_residual")])
def test_cpu_route_numbers_are_unchanged_by_the_absorption(precision, model):
    from tvm_evt.pipeline import InlineEVTPartitions

    mod = _graph(precision, model)
    ref = InlineEVTPartitions()(_front(mod, absorb=False))
    got = InlineEVTPartitions()(_front(mod))
    rng = np.random.default_rng()
    func = ref["main_adjoint"]
    args = []
    for p in func.params:
        shape, dtype = [int(s) for s in p.ty.shape.values], str(p.ty.dtype)
        args.append(rng.standard_normal(shape).astype(dtype) if dtype.startswith("float")
                    else rng.integers(0, 2, shape).astype(dtype))

    def run(m):
        ex = tvm.compile(relax.transform.DeadCodeElimination(entry_functions=["main_adjoint"])(m), target="llvm")
        out = relax.VirtualMachine(ex, tvm.cpu())["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])
        return [a.astype("float32") for a in flat_numpy(out)]

    for w, g in zip(run(ref), run(got)):
        np.testing.assert_array_equal(g, w)  # the same ops in the same order


def test_optional_rewrites_are_on_by_default_and_can_be_switched_off(monkeypatch):
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    mine = {"AbsorbPartitionInputCasts", "FuseLayerNorm", "FuseLayerNormBackward"}
    assert mine <= {p.info.name for p in pipeline.phases(cuda)}
    assert {n for n in pipeline.OPTIONAL if pipeline.enabled(n)} == {n for n, r in pipeline.OPTIONAL.items() if r.default}
    monkeypatch.setenv(pipeline.DISABLE_ENV, "all")
    assert not mine & {p.info.name for p in pipeline.phases(cuda)}
    assert not any(pipeline.enabled(n) for n in pipeline.OPTIONAL)
    monkeypatch.setenv(pipeline.DISABLE_ENV, "layer_norm")
    names = [p.info.name for p in pipeline.phases(cuda)]
    assert "AbsorbPartitionInputCasts" in names and "FuseLayerNorm" not in names
    monkeypatch.setenv(pipeline.ENABLE_ENV, "nhwc,layer_norm")  # disabling wins
    assert pipeline.enabled("nhwc") and not pipeline.enabled("layer_norm")
    monkeypatch.setenv(pipeline.ENABLE_ENV, "typo")
    with pytest.raises(ValueError, match="typo"):
        pipeline.enabled("layer_norm")
    monkeypatch.delenv(pipeline.ENABLE_ENV)
    with pytest.raises(KeyError):
        pipeline.enabled("nonexistent")


def test_partitions_whose_calls_all_moved_are_dropped():
    mod = _front(_graph())
    called = set()

    def note_callee(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar):
            called.add(expr.op.name_hint)

    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv not in tuning.evt_functions(mod):
            relax.analysis.post_order_visit(func.body, note_callee)
    names = {gv.name_hint for gv in tuning.evt_functions(mod)}
    assert any("_c" in n.rsplit("evt", 1)[-1] for n in names)
    assert names <= called, sorted(names - called)  # RunCodegen leaves an uncalled one to the VM lowering


@pytest.mark.parametrize("disabled", ["", "all"])
def test_cuda_relax_phases_reach_the_vm_executable_form(disabled, monkeypatch):
    """The whole CUDA Relax pipeline (RunCodegen with a codegen that builds nothing, up to VMShapeLower
    and the finalize passes): every partition must be consumed by RunCodegen, every optional pass must
    leave a module TVM's lowering accepts.  (The uncalled partitions once got this far only on a GPU.)"""
    import tvm_ffi
    from tvm_evt.codegen import relax_ext

    monkeypatch.setenv(pipeline.DISABLE_ENV, disabled)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    phases = pipeline.phases(cuda)  # registers the real relax.ext.evt ...
    built = []
    stub = lambda funcs, *_: built.extend(funcs) or []  # noqa: E731
    tvm_ffi.register_global_func(relax_ext.GLOBAL_FUNC, stub, override=True)
    monkeypatch.setattr(relax_ext, "prebuild", lambda mod, jobs=None: {})  # PrebuildKernels: no nvcc either
    try:  # ... which this stub replaces for the run: no nvcc
        with cuda:
            out = tvm.transform.Sequential(phases)(_graph())
    finally:
        relax_ext.register()
    assert built and not tuning.evt_functions(out)
    assert all(not isinstance(f, relax.Function) or "global_symbol" in f.attrs for f in out.functions.values())
