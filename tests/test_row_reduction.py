"""RowReduction: sums, maxima and minima over the innermost axis, 16-byte vectors of a row a
thread's load (a row no vector fits: a block of threads, one element a load)."""
import shutil

import pytest
import torch
import tvm
import tvm_ffi
from tvm import s_tir, te, tirx
from tvm.s_tir import dlight as dl
from tvm.support import nvcc

from _te_kernels import CUDA, assert_matches_llvm_on_gpu, schedule

from tvm_evt.relax_passes.lower.row_reduction import RowReduction


def _kernels():
    """name -> (te tensors, expected elements a thread's load; 0: declined)."""
    y = te.placeholder((512, 1024), "bfloat16", name="y")
    t = te.placeholder((512, 1024), "float32", name="t")
    b = te.placeholder((384, 3, 512), "bfloat16", name="b")
    w = te.placeholder((384, 3), "float32", name="w")
    k, k3 = te.reduce_axis((0, 1024), "k"), te.reduce_axis((0, 512), "k")
    few = te.placeholder((16, 65536), "float32", name="few")
    kf = te.reduce_axis((0, 65536), "k")
    odd = te.placeholder((512, 1000), "float32", name="odd")
    ko = te.reduce_axis((0, 1000), "k")
    col = te.placeholder((1024, 512), "bfloat16", name="col")
    kc = te.reduce_axis((0, 1024), "k")
    logits = te.placeholder((512, 32000), "bfloat16", name="logits")
    kv = te.reduce_axis((0, 32000), "k")
    gpt2 = te.placeholder((512, 50257), "bfloat16", name="gpt2")
    kg = te.reduce_axis((0, 50257), "k")
    return {
        # a split MSE loss: bf16 output, float32 target, summed in float32 -> 4 elements a load
        "mse": ([y, t, te.compute((512,), lambda m: te.sum(
            (y[m, k].astype("float32") - t[m, k]) * (y[m, k].astype("float32") - t[m, k]), axis=k), name="s")], 4),
        # two spatial axes and a per-row factor that does not use the reduced axis
        "scaled_rows": ([b, w, te.compute((384, 3), lambda i, j: te.sum(
            b[i, j, k3].astype("float32") * w[i, j], axis=k3), name="s")], 4),
        # 16 rows: DLight's rule spreads a row over a block and more
        "few_rows": ([few, te.compute((16,), lambda m: te.sum(few[m, kf], axis=kf), name="s")], 0),
        # a row no multiple of 32 vectors
        "odd_length": ([odd, te.compute((512,), lambda m: te.sum(odd[m, ko], axis=ko), name="s")], 0),
        # the reduced axis is not the innermost: ColumnReduction's
        "column_sum": ([col, te.compute((512,), lambda n: te.sum(col[kc, n].astype("float32"), axis=kc),
                                        name="s")], 0),
        # a cross-entropy's max over a 32000 vocabulary, bf16 logits widened (keepdims, as Relax's)
        "cross_entropy_max": ([logits, te.compute((512, 1), lambda m, _: te.max(
            logits[m, kv].astype("float32"), axis=kv), name="s")], 4),
        "row_max": ([t, te.compute((512,), lambda m: te.max(t[m, k], axis=k), name="s")], 4),
        "row_min": ([t, te.compute((512,), lambda m: te.min(t[m, k], axis=k), name="s")], 4),
        "row_product": ([t, te.compute((512,), lambda m: te.comm_reducer(
            lambda a, b: a * b, lambda dt: tvm.tirx.const(1, dt))(t[m, k], axis=k), name="s")], 4),
        # DLight's Reduction takes no max: taken at any row count
        "few_rows_max": ([few, te.compute((16,), lambda m: te.max(few[m, kf], axis=kf), name="s")], 4),
        # no vector fits a row of 50257 (GPT-2's vocabulary) or 1000: one element a load
        "odd_vocab_max": ([gpt2, te.compute((512, 1), lambda m, _: te.max(
            gpt2[m, kg].astype("float32"), axis=kg), name="s")], 1),
        "odd_length_max": ([odd, te.compute((512,), lambda m: te.max(odd[m, ko], axis=ko), name="s")], 1),
        # a max down a column is not a row's
        "column_max": ([col, te.compute((512,), lambda n: te.max(col[kc, n].astype("float32"), axis=kc),
                                        name="s")], 0),
    }


def _schedule(tensors):
    return schedule(tensors, RowReduction())


def _loops(func) -> list[tuple[str, int]]:
    """(thread tag, or the loop kind for unbound loops: "SERIAL", "VECTORIZED"; extent) of every
    loop of `func`, outer first."""
    loops = []

    def visit(node):
        bound = node.thread_binding
        kind = bound.thread_tag if bound is not None else tirx.ForKind(int(node.kind)).name
        loops.append((kind, int(node.extent)))

    tvm_ffi.structural_walk(func.body, (tirx.For, visit), order="pre")
    return loops


@pytest.mark.parametrize("name", list(_kernels()))
def test_takes_row_reductions_and_declines_the_rest(name):
    tensors, lanes = _kernels()[name]
    out = _schedule(tensors)["main"]
    assert (bool(out.attrs) and "tirx.is_scheduled" in out.attrs) == bool(lanes)
    if lanes:
        kinds = [kind for kind, _ in _loops(out)]
        assert "threadIdx.x" in kinds and "blockIdx.x" in kinds
        assert (("VECTORIZED", lanes) in _loops(out)) == (lanes > 1)


@pytest.mark.parametrize("name, threads, serial", [
    ("cross_entropy_max", 64, 125),  # 32000 = 125 chunks of 64 threads x 4
    ("few_rows_max", 128, 128),  # 65536 = 128 chunks of 128 threads x 4
    ("odd_vocab_max", 1024, 50),  # 50257 in 50 chunks of 1024 threads, the last one cut
    ("odd_length_max", 512, 2),  # 1000 in 2 chunks of 512 threads
])
def test_a_max_is_a_block_a_row_with_a_short_loop_a_thread(name, threads, serial):
    """A max takes the sums' schedule: a block a row, its threads each a short run of the row
    (no thread loops over a whole row, as under DLight's Fallback), then one value a row
    combined across the block."""
    tensors, _ = _kernels()[name]
    rows = int(tensors[-1].shape[0])
    row = int(tensors[0].shape[-1])
    loops = _loops(_schedule(tensors)["main"])
    assert ("blockIdx.x", rows) in loops
    assert loops.count(("threadIdx.x", threads)) == 2  # the partial results, then the cross-thread one
    assert max(e for kind, e in loops if kind == "SERIAL") == serial
    assert serial * threads < 2 * row


def test_a_max_starts_from_the_lowest_float():
    """The partial maxima start from float32's lowest value (the reducer's identity, as Relax's
    max legalizes its init); a max from -inf is no registered reducer, and rfactor refuses it."""
    tensors, _ = _kernels()["cross_entropy_max"]
    inits = []

    def visit(node):
        if isinstance(node.value, tirx.FloatImm):
            inits.append(node.value.value)

    tvm_ffi.structural_walk(_schedule(tensors)["main"].body, (tirx.BufferStore, visit))
    lowest = float(torch.finfo(torch.float32).min)
    assert inits and all(v == lowest for v in inits), inits

    logits = tensors[0]
    kv = te.reduce_axis((0, 32000), "k")
    from_inf = te.comm_reducer(lambda a, b: tvm.tirx.max(a, b), lambda dt: tvm.tirx.const(float("-inf"), dt))
    out = te.compute((512, 1), lambda m, _: from_inf(logits[m, kv].astype("float32"), axis=kv), name="s")
    with pytest.raises(Exception, match="rfactor cannot be applied"):
        _schedule([logits, out])


def test_sum_schedules_are_unchanged_by_the_other_reducers():
    """A max and a sum of the same row take the same loops (only the combiner differs), so the
    sums' measured schedule is the one the max gets."""
    t = te.placeholder((512, 1024), "float32", name="t")
    k = te.reduce_axis((0, 1024), "k")
    total = _loops(_schedule([t, te.compute((512,), lambda m: te.sum(t[m, k], axis=k), name="s")])["main"])
    assert _loops(_schedule(_kernels()["row_max"][0])["main"]) == total


def _source(name) -> str:
    tensors, _ = _kernels()[name]
    return tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("name", ["mse", "scaled_rows", "cross_entropy_max", "row_min"])
def test_row_reductions_compile_with_nvcc(name):
    src = _source(name)
    assert "float4" in src  # the accumulator (and float32 loads) as 16-byte vectors
    assert "__shfl_down_sync" in src  # the threads' results combined across the block
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_odd_vocabulary_max_compiles_with_nvcc():
    src = _source("odd_vocab_max")
    assert "< 50257" in src  # the last chunk's predicate
    assert "__shfl_down_sync" in src
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


def test_cross_entropy_max_is_the_row_rule_s_in_the_cuda_lowering():
    """A linear head over a 32000 vocabulary and its cross-entropy, lowered for sm_90a: the loss's
    max over the vocabulary (bf16 logits widened to float32) is scheduled by RowReduction, not
    left to DLight's Fallback (one thread a row: 21.4 ms a step for Llama's [8192, 32000] on
    H200).  Every kernel with a non-sum reduction is checked, by scheduling it with the rule
    alone and comparing."""
    from tvm_evt import optim, tuning
    from tvm_evt.models import ZooEntry
    from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU
    from tvm_evt.training import hopper_target

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 32000)

        def forward(self, x, labels):
            return torch.nn.functional.cross_entropy(self.proj(x), labels)

    entry = ZooEntry(Head(), lambda: (torch.randn(256, 64), torch.randint(0, 32000, (256,))), None, "head")
    target = hopper_target()
    _, graph = tuning.training_graph(entry, "bf16", optim.AdamW(lr=1e-4), target)
    before, schedule = tuning.until_scheduling(target)
    assert isinstance(schedule, ScheduleTIRForGPU) and schedule.vectorize
    with target:
        fused = tvm.transform.Sequential(before)(graph.mod)
        scheduled = schedule(fused)

    def combiners(func):
        found = []

        def visit(node):
            if isinstance(node.body, tirx.BufferStore) and \
                    any(iv.iter_type == tirx.IterVar.CommReduce for iv in node.iter_vars):
                found.append(type(node.body.value))

        tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
        return found

    maxima = [gv for gv, f in fused.functions_items()
              if isinstance(f, tirx.PrimFunc) and any(c is not tirx.Add for c in combiners(f))]
    assert [combiners(fused[gv]) for gv in maxima] == [[tirx.Max]], [gv.name_hint for gv in maxima]
    (gv,) = maxima
    assert [str(p.dtype) for p in fused[gv].params] == ["bfloat16", "float32"]
    assert [int(s) for s in fused[gv].params[0].shape] == [256, 32000]
    with target:
        alone = dl.ApplyDefaultSchedule(RowReduction())(tvm.IRModule({gv: fused[gv]}))[gv]
    tvm.ir.assert_structural_equal(scheduled[gv], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mse", "scaled_rows"])
def test_row_sums_on_gpu_match_llvm(name):
    tensors, _ = _kernels()[name]
    assert_matches_llvm_on_gpu(_schedule(tensors), tensors, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cross_entropy_max", "row_min", "few_rows_max", "odd_vocab_max",
                                  "odd_length_max"])
def test_row_maxima_on_gpu_match_llvm_exactly(name):
    """A max or min in any order is the same value: bit for bit."""
    tensors, _ = _kernels()[name]
    assert_matches_llvm_on_gpu(_schedule(tensors), tensors)
