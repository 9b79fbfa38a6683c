"""PartitionEVT (the ILP partitioner) and the ``evt`` pipeline, on the CPU.

Every zoo model: partitions legal and acyclic, modelled bytes no more than TVM's FuseOps, loss and
gradients equal to torch autograd after all passes.  Random small graphs: the ILP's objective
equals brute force.  Determinism, the cache, the greedy fallback.
"""
from __future__ import annotations

import copy
import itertools
import random

import pytest
from tvm_evt import pipeline
import tvm
from tvm import relax

import tvm_evt
from tvm_evt import models
from tvm_evt.codegen.legality import legality
from tvm_evt.pipeline import pre_partition_passes
from tvm_evt.relax_passes.partition import evt_cost
from tvm_evt.relax_passes.partition.partition_evt import (
    CODEGEN, OpGraph, PartitionEVT, assignment_feasible, build_problem, cluster_gain, partition_report,
    solve,
)

from _torch_ref import assert_step_matches_torch, no_dropout

LLVM = {"kind": "llvm"}
ZOO_NAMES = sorted(models.ZOO)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """One cache directory for the whole file, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def _partitions(mod):
    return {gv: f for gv, f in mod.functions_items()
            if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == CODEGEN}


def _fuse_ops(mod, name="train_step"):
    mod = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint == name or
                        not isinstance(f, relax.Function) or f.attrs.get("Codegen") == CODEGEN})
    with tvm.target.Target("llvm"):
        seq = tvm.transform.Sequential([
            relax.transform.LegalizeOps(),
            relax.transform.RewriteDataflowReshape(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(),
        ])
        return seq(mod)[name]


# ------------------------------------------------------------------------------------- zoo
@pytest.mark.parametrize("name", ZOO_NAMES + ["resnet_bottleneck+nhwc"])
def test_zoo(name, monkeypatch):
    name, _, nhwc = name.partition("+")
    # the default NHWC layout is judged by the '+nhwc' case
    monkeypatch.setenv(pipeline.DISABLE_ENV if not nhwc else pipeline.ENABLE_ENV, "nhwc")
    entry = models.ZOO[name]()
    no_dropout(entry.model)
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(),
                                    loss_fn=entry.loss_fn, target=LLVM)

    # loss and gradients after graph passes + partitioning (+ the CPU reference lowering)
    assert_step_matches_torch(step, entry, entry.example_inputs())

    # the same partitioning (from the cache the compile filled), checked
    graph_mod = tvm.transform.Sequential(pre_partition_passes())(step.graph.mod)
    parted = PartitionEVT(functions=("train_step",))(graph_mod)
    report = partition_report(parted)["train_step"]
    assert report["method"] == "cache"
    relax.analysis.well_formed(parted)  # raises unless every value is defined before use
    parts = _partitions(parted)
    assert len(parts) == len(report["partitions"])
    for gv, func in parts.items():
        result = legality(func)
        assert result.ok, f"{gv.name_hint}: {result.reason}"
    matmuls = sum(p["ops"].count("relax.matmul") for p in report["partitions"])
    assert matmuls == sum(1 for p in report["partitions"])  # one main loop per partition
    n_matmul = sum(1 for b in graph_mod["train_step"].body.blocks for x in b.bindings
                   if isinstance(x.value, relax.Call) and x.value.op == tvm.ir.Op.get("relax.matmul"))
    assert matmuls + len(report["unfused_matmuls"]) == n_matmul
    assert all(m["reason"] for m in report["unfused_matmuls"])

    # modelled global-memory bytes: partitions + FuseOps on the rest <= FuseOps alone.  The
    # operand copies inserted for tf32's K-major rule (fp32 only) are a layout fix-up outside
    # the fusion model (they buy a CUTLASS GEMM instead of DLight's): compared without them.
    fusion_only = PartitionEVT(functions=("train_step",), transpose_operands=False)(graph_mod)
    ours = evt_cost.function_traffic(_fuse_ops(fusion_only))
    tvm_only = evt_cost.function_traffic(_fuse_ops(graph_mod))
    assert ours <= tvm_only, (ours, tvm_only)
    print(f"\n{name}: {len(parts)} partitions, {len(report['unfused_matmuls'])} unfused matmuls, "
          f"bytes {ours} vs FuseOps {tvm_only}")


def test_report_and_png(tmp_path):
    entry = models.ZOO["mlp"]()
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(),
                                    loss_fn=entry.loss_fn, target=LLVM)
    report = step.report()
    assert {"partitions", "unfused_matmuls", "solve_seconds"} <= set(report)
    first = report["partitions"][0]
    assert "relax.matmul" in first["ops"] and first["bytes_saved"] > 0
    pytest.importorskip("matplotlib")
    path = step.report_png(str(tmp_path / "mlp.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- random graphs
SHAPE, DTYPE = (32, 64), "float16"
UNARY = [relax.op.nn.relu, relax.op.exp, relax.op.tanh, relax.op.negative]
BINARY = [relax.op.add, relax.op.multiply, relax.op.subtract]


def _random_function(seed: int, n_ops: int = 10) -> relax.Function:
    rng = random.Random(seed)
    x = relax.Var("x", relax.TensorType(SHAPE, DTYPE))
    ws = [relax.Var(f"w{i}", relax.TensorType((64, 64), DTYPE)) for i in range(2)]
    bias = relax.Var("b", relax.TensorType((64,), DTYPE))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *ws, bias]):
        with bb.dataflow():
            values, reductions, used = [x], [], set()
            n_matmul = 0
            for k in range(n_ops):
                r = rng.random()
                src = rng.choice(values[-4:])
                used.add(src)
                if k == 0 or (r < 0.25 and n_matmul < 3):
                    values.append(bb.emit(relax.op.matmul(src, rng.choice(ws))))
                    n_matmul += 1
                elif r < 0.45:
                    values.append(bb.emit(rng.choice(UNARY)(src)))
                elif r < 0.8:
                    other = rng.choice(values + [bias])
                    values.append(bb.emit(rng.choice(BINARY)(src, other)))
                    used.add(other)
                else:
                    reductions.append(bb.emit(relax.op.sum(src, axis=[rng.choice([0, 1])])))
            dangling = [v for v in values[1:] if v not in used]
            outs = bb.emit_output(relax.Tuple(dangling + values[-1:] + reductions))
        bb.emit_func_output(outs)
    return bb.get()["main"]


def _brute_force(problem) -> float:
    owners = {}
    for c, cl in enumerate(problem.clusters):
        for v in cl.candidates:
            owners.setdefault(v, []).append(c)
    ops = sorted(owners)
    best = None
    for choice in itertools.product(*[[None] + owners[v] for v in ops]):
        assign = {v: c for v, c in zip(ops, choice) if c is not None}
        if assignment_feasible(problem, assign) is not None:
            continue
        value = sum(cluster_gain(problem, c, {v for v, k in assign.items() if k == c})
                    for c in range(len(problem.clusters)))
        best = value if best is None else max(best, value)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_brute_force(seed):
    func = _random_function(seed)
    graph = OpGraph(func.body.blocks[0])
    problem = build_problem(graph)
    assert problem.clusters and not problem.refused
    if sum(len(c.candidates) for c in problem.clusters) > 9:
        pytest.skip("too many candidates to enumerate")
    solution = solve(problem, use_cache=False)
    assert assignment_feasible(problem, solution.assign) is None
    assert solution.objective == pytest.approx(_brute_force(problem), rel=1e-9, abs=1e-6)


def test_greedy_fallback_is_valid():
    func = _random_function(3)
    problem = build_problem(OpGraph(func.body.blocks[0]))
    solution = solve(problem, time_limit=0.0, use_cache=False)
    assert solution.method == "greedy"
    assert assignment_feasible(problem, solution.assign) is None


# --------------------------------------------------------------------- determinism and cache
def _functions(mod):
    return tvm.IRModule(dict(mod.functions_items()))  # without the report (it has timings)


def _bert_graph():
    entry = models.ZOO["bert_layer"]()
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    graph = tvm_evt.build_training_module(imported, None)
    return tvm.transform.Sequential(pre_partition_passes())(graph.mod)


def test_deterministic_and_cached():
    mod = _bert_graph()
    a = PartitionEVT(use_cache=False, functions=("train_step",))(mod)
    b = PartitionEVT(use_cache=False, functions=("train_step",))(mod)
    tvm.ir.assert_structural_equal(_functions(a), _functions(b))
    ra, rb = partition_report(a)["train_step"], partition_report(b)["train_step"]
    assert ra["partitions"] == rb["partitions"] and ra["method"] == "ilp"
    cold = PartitionEVT(functions=("train_step",))(mod)
    warm = PartitionEVT(functions=("train_step",))(mod)
    assert partition_report(warm)["train_step"]["method"] == "cache"
    tvm.ir.assert_structural_equal(_functions(cold), _functions(warm))
    tvm.ir.assert_structural_equal(_functions(a), _functions(warm))


# ----------------------------------------------------- partitions vs the epilogue interpreter
@pytest.mark.parametrize("name", ["bert_layer", "gpt2_block", "vit"])
def test_partitions_compute_what_the_codegen_reads(name):
    """Each evt partition of a zoo model's training graph, run by TVM (LegalizeOps + llvm), equals
    the numpy interpreter of the epilogue IR the codegen reads from it (``from_function`` +
    ``lower``): the reshapes between [M, N] and [B, S, N] it aliases, the [B, S, 1] / [1, 1, N]
    operands it views in the tile's rank, reductions over the split form."""
    import numpy as np

    from tvm_evt.codegen import from_function, lower, reference
    from tvm_evt.relax_passes.partition.inline_partitions import _composite
    from tvm_evt.tuning import training_graph

    entry = models.ZOO[name]()
    _, graph = training_graph(entry, "fp32")
    parted = PartitionEVT(functions=("train_step",))(tvm.transform.Sequential(pre_partition_passes())(graph.mod))
    rng = np.random.default_rng(0)
    reshaped = 0
    for gv, func in sorted(_partitions(parted).items(), key=lambda kv: kv[0].name_hint):
        partition = lower(from_function(func))
        composite = _composite(func)
        bindings = [b for block in composite.body.blocks for b in block.bindings]
        reshaped += any(isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.reshape")
                        and not any(b.value.args[0].same_as(p) for p in composite.params) for b in bindings)
        arrays = []
        for p in func.params:
            shape = tuple(int(d) for d in p.ty.shape.values)
            dtype = str(p.ty.dtype)
            arrays.append(np.array([0x1234, 0x5678], "uint32") if dtype == "uint32" else
                          rng.integers(0, 2, shape).astype(bool) if dtype == "bool" else
                          rng.uniform(-1, 1, shape).astype(dtype))
        ex = tvm.compile(tvm.IRModule({"main": composite.without_attr("Composite").with_attr("global_symbol", "main")}),
                         target=tvm.target.Target(LLVM))
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in arrays])
        got = [got] if hasattr(got, "numpy") else list(got)
        for i, (g, e) in enumerate(zip(got, reference.evaluate(partition, arrays))):
            g, e = g.numpy().astype(np.float64), np.asarray(e, dtype=np.float64)
            assert g.shape == e.shape, f"{gv.name_hint} output {i}: {g.shape} vs {e.shape}"
            finite = np.isfinite(e)  # a causal mask's -inf: the same infinities on both sides
            np.testing.assert_array_equal(g[~finite], e[~finite])
            g, e = g[finite], e[finite]
            err = np.linalg.norm(g - e) / max(np.linalg.norm(e), 1e-30)
            assert err <= 1e-4, f"{gv.name_hint} output {i}: relative error {err:.3g}"
    assert reshaped, "no partition fused across a [M, N] <-> [B, S, N] reshape"


def test_ops_only_unfused_reductions_read_stay_out_of_epilogues():
    """Batch norm's statistics of a GEMM output: ``a = astype(y)`` is read by an elementwise
    output, so it may join the epilogue; ``a * a`` feeds nothing but ``mean`` (a reduction no
    epilogue takes), so it is no candidate: stored, it would only be read back by the mean's
    kernel, which computes it from ``a`` itself."""
    x = relax.Var("x", relax.TensorType((256, 64), "float16"))
    w = relax.Var("w", relax.TensorType((64, 128), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            a = bb.emit(relax.op.astype(y, "float32"))
            sq = bb.emit(relax.op.multiply(a, a))
            m = bb.emit_output(relax.op.mean(sq, axis=[0]))
            h = bb.emit_output(relax.op.multiply(a, relax.const(0.5, "float32")))
        bb.emit_func_output(relax.Tuple([m, h]))
    graph = OpGraph(bb.get()["main"].body.blocks[0])
    (cluster,) = build_problem(graph).clusters
    names = {graph.nodes[i].var.name for i in cluster.candidates}
    assert a.name in names and h.name in names
    assert sq.name not in names and m.name not in names


def test_row_kernels_keep_what_a_layer_norm_gradient_kernel_computes_out_of_epilogues():
    """With ``row_kernels`` the partitioner counts the ops FuseLayerNormBackward's row kernels
    compute in passing (dy * gamma, the row means) as free: the FFN1 dX GEMM of a BERT layer then
    stores its dy once (for dgamma and dbeta, and for the row kernel), not also dy * gamma; the
    CUDA route's layer norm gradient kernel reads dy and gamma instead (its ``dyg`` form)."""
    from tvm_evt.relax_passes.lower.fuse_layer_norm_backward import find_chains
    from tvm_evt.tuning import training_graph

    entry = models.ZOO["bert_layer"](batch=2, seq=16, hidden=64, heads=4)
    _, graph = training_graph(entry, "bf16")
    mod = tvm.transform.Sequential(pre_partition_passes())(graph.mod)
    chains = find_chains(mod["train_step"]).values()
    assert len(chains) == 2 and all(c.gamma is not None for c in chains)  # before: both take dy * gamma

    def stores(parted):  # the outputs of every partition
        return sum(len(f.ret_ty.fields) if isinstance(f.ret_ty, relax.TupleType) else 1
                   for f in _partitions(parted).values())

    plain = PartitionEVT(use_cache=False, functions=("train_step",))(mod)
    rows = PartitionEVT(use_cache=False, functions=("train_step",), row_kernels=True)(mod)
    assert stores(rows) == stores(plain) - 1
    # after the partitioner every layer norm gradient takes dy and gamma: nothing stores dy * gamma
    left = find_chains(rows["train_step"]).values()
    assert sum(c.gamma is not None for c in left) == 2, [c.gamma for c in left]
    assert sum(c.gamma is not None for c in find_chains(plain["train_step"]).values()) == 1
