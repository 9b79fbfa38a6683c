"""MergeSmallKernels: small elementwise kernels merged into one kernel per convex group.

Structure on hand-built blocks (which kernels group, what stays apart and why), the batch norm's
per-channel kernels of a training step on the CUDA route, the merged kernels' GPU schedules run
serially on llvm against the kernels they replace, and a whole CPU-route step with the pass
(merged loops left serial) equal bit for bit to the step without it."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import tvm
from tvm import relax, topi

from tvm_evt import pipeline, tuning
from tvm_evt.relax_passes.lower import merge_small_kernels as msk
from tvm_evt.relax_passes.lower.merge_small_kernels import MergeSmallKernels
from tvm_evt.training import build_training_module, cpu_target, from_torch, hopper_target

from _passes import flat_numpy
from _te_kernels import run_on_llvm, serial
from test_cnn_layers import MODELS

CUDA = hopper_target()


def _block(build) -> tvm.IRModule:
    """A module whose ``main`` binds, in one dataflow block, what `build(bb, x)` emits (x: (64,)
    float32); its result is the tuple of the vars `build` returns."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            outs = build(bb, x)
            result = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(result)
    return bb.get()


def _names(mod) -> list[str]:
    """The PrimFuncs ``main`` calls, in binding order."""
    return [b.value.args[0].name_hint for b in mod["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.call_tir")]


def _run(mod, x):
    ex = tvm.compile(mod, target=tvm.target.Target(cpu_target()))
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return [o.numpy() for o in out]


def test_a_chain_and_its_siblings_become_one_kernel():
    def build(bb, x):
        a = bb.emit_te(topi.multiply, x, 2.0)
        b = bb.emit_te(topi.sqrt, a)  # reads a member: joins
        c = bb.emit_te(topi.exp, x)  # reads what a member reads: joins
        return [a, b, c]

    mod = _block(build)
    after = MergeSmallKernels()(mod)
    assert len(_names(mod)) == 3 and _names(after) == ["merged_multiply"]
    x = np.random.default_rng(0).random(64).astype("float32")
    for want, got in zip(_run(mod, x), _run(after, x)):
        np.testing.assert_array_equal(got, want)


def test_a_group_never_waits_on_a_kernel_that_reads_it():
    """b reads a member's value through a reduction outside the group: merged, the group would
    read what it computes.  b starts a group of its own; c, reading a member only, joins."""

    def build(bb, x):
        a = bb.emit_te(topi.multiply, x, 2.0)
        s = bb.emit_te(topi.sum, a, None, True)  # a reduction: not small, outside every group
        b = bb.emit_te(topi.add, a, s)
        c = bb.emit_te(topi.exp, a)
        return [b, c]

    mod = _block(build)
    assert msk._Grouping(mod, mod["main"].body.blocks[0]).groups == [[0, 3]]
    after = MergeSmallKernels()(mod)
    assert _names(after) == ["merged_multiply", "sum", "add"]  # the merged kernel before the sum that reads it
    x = np.random.default_rng(0).random(64).astype("float32")
    for want, got in zip(_run(mod, x), _run(after, x)):
        np.testing.assert_array_equal(got, want)


def test_a_member_reading_another_element_keeps_the_group_apart():
    """A transpose of a member's result reads, in an iteration of the merged loop, an element
    another iteration writes: that group stays as it was."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit_te(topi.multiply, x, 2.0)
            t = bb.emit_te(topi.transpose, a)
            result = bb.emit_output(relax.Tuple([a, t]))
        bb.emit_func_output(result)
    mod = bb.get()
    assert msk._Grouping(mod, mod["main"].body.blocks[0]).groups == [[0, 1]]
    tvm.ir.assert_structural_equal(MergeSmallKernels()(mod), mod)


def test_large_kernels_and_dataflow_reshapes_stay():
    def build(bb, x):
        big = bb.emit_te(topi.broadcast_to, x, (512, 64))  # 32768 elements: not small
        a = bb.emit_te(topi.multiply, x, 2.0)
        r = bb.emit_te(topi.reshape, a, (8, 8))  # a view after RewriteDataflowReshape
        return [big, bb.emit_te(topi.add, r, 1.0)]

    mod = _block(build)
    small = [msk.small_kernel(mod, b) for b in mod["main"].body.blocks[0].bindings]
    assert small == [None, 64, None, 64, None]  # (the last binding: the result tuple)


def _cnn_step(name="mobilenet_v2_blocks", precision="fp32"):
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    return build_training_module(from_torch(MODELS[name](), (x, torch.randint(0, 10, (4,))), F.cross_entropy),
                                 None, precision)


def _until_merge(graph_mod, merge: bool):
    before, _ = tuning.until_scheduling(CUDA)
    names = [p.info.name for p in before]
    if not merge:
        before = [p for p in before if p.info.name != "MergeSmallKernels"]
    elif "MergeSmallKernels" not in names:
        before = before + [MergeSmallKernels()]
    with CUDA:
        return tvm.transform.Sequential(before)(graph_mod)


def test_batch_norm_statistics_are_two_kernels_a_norm():
    """Each batch norm of the step leaves a forward group (mean, variance, its square root, the
    running statistics, the reciprocal its gradient reads) and, apart from it (its operands come
    from the backward, which reads the forward group), the gradient's scaled column sum: two
    kernels of C elements where FuseOps left seven (dgamma and dbeta are views in this step)."""
    torch.manual_seed(0)
    graph = _cnn_step(precision="bf16")
    plain, merged = _until_merge(graph.mod, False), _until_merge(graph.mod, True)

    def small(mod) -> dict:  # element count -> small and merged kernels of the step
        counts: dict = {}
        for b in mod["train_step"].body.blocks[0].bindings:
            if isinstance(b.value, relax.Call) and b.value.args and isinstance(b.value.args[0], tvm.ir.GlobalVar) \
                    and b.value.args[0].name_hint.startswith("merged_"):
                n = msk.elements(relax.TupleGetItem(b.var, 0) if isinstance(b.var.ty, relax.TupleType) else b.var)
            else:
                n = msk.small_kernel(mod, b)
            if n is not None:
                counts[n] = counts.get(n, 0) + 1
        return counts

    norms = [m for m in MODELS["mobilenet_v2_blocks"]().modules() if isinstance(m, torch.nn.BatchNorm2d)]
    p, m = small(plain), small(merged)
    for c in {n.num_features for n in norms}:
        with_c = sum(1 for n in norms if n.num_features == c)
        assert p[c] == 7 * with_c and m[c] == 2 * with_c, (c, p[c], m[c])
    # the norms of one width share their merged kernels (one PrimFunc a group shape)
    calls = [b.value.args[0] for b in merged["train_step"].body.blocks[0].bindings if isinstance(b.value, relax.Call)
             and b.value.args and isinstance(b.value.args[0], tvm.ir.GlobalVar)
             and b.value.args[0].name_hint.startswith("merged_")]
    assert len(set(calls)) < len(calls)


def test_merged_gpu_kernels_compute_what_their_members_do():
    """Every merged kernel of a CNN step, its GPU schedule made serial and built for llvm, against
    the unscheduled fusion of the kernels it replaces, on the same random inputs."""
    torch.manual_seed(0)
    mod = _until_merge(_cnn_step().mod, False)
    checked = 0
    readers = msk._readers(mod["train_step"])
    for bi, block in enumerate(mod["train_step"].body.blocks):
        if not isinstance(block, relax.DataflowBlock):
            continue
        for indices in msk._Grouping(mod, block).groups:
            members, params, outputs, _ = msk.group_signature(readers, bi, block, indices)
            fused = msk._merged_func(mod, members, params, outputs)
            merged = msk.merge_loops(fused, len(outputs), msk.elements(members[0].var))
            if merged is None:
                continue
            scheduled = msk.gpu_variant(merged)
            rng = np.random.default_rng(checked)
            arrays = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype))
                      if str(p.dtype).startswith("float") else np.zeros([int(d) for d in p.shape], str(p.dtype))
                      for p in fused.params]
            for want, got in zip(run_on_llvm(fused, arrays), run_on_llvm(serial(scheduled), arrays)):
                np.testing.assert_array_equal(got, want)
            checked += 1
    assert checked >= 4


def test_cpu_route_step_is_unchanged_by_merging(name="mobilenet_v2_blocks"):
    """The CPU route's step with the pass after TVM's legalisation (every op a kernel of its own
    there; the merged loops run as written, serially) computes what it computes without, bit for
    bit."""
    torch.manual_seed(0)
    graph = _cnn_step(name)
    target = tvm.target.Target(cpu_target())
    passes = pipeline.phases(target)
    at = [p.info.name for p in passes].index("LegalizeOps") + 1
    func = graph.mod["train_step"]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype(str(p.ty.dtype))
            if str(p.ty.dtype).startswith("float") else rng.integers(0, 10, [int(d) for d in p.ty.shape.values])
            .astype(str(p.ty.dtype)) for p in func.params]

    def run(extra):
        with target:
            mod = tvm.transform.Sequential(passes[:at] + extra)(graph.mod)
        merged = sum(1 for gv, _ in mod.functions_items() if gv.name_hint.startswith("merged_"))
        ex = tvm.compile(mod, target=target, relax_pipeline=tvm.transform.Sequential(passes[at:]))
        out = relax.VirtualMachine(ex, tvm.cpu())["train_step"](*[tvm.runtime.tensor(a) for a in args])
        return merged, flat_numpy(out)

    (none, want), (merged, got) = run([]), run([MergeSmallKernels()])
    assert none == 0 and merged >= 3
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
