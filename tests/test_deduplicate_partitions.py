"""DeduplicateEVTPartitions merges equal evt partitions and keeps the values."""

import tvm
from tvm import relax

from tvm_evt.relax_passes.partition.deduplicate_partitions import DeduplicateEVTPartitions, duplicates


def _partition(bb, name):
    x = relax.Var("x", relax.TensorType((16, 32), "float16"))
    w = relax.Var("w", relax.TensorType((32, 16), "float16"))
    with bb.function(name, [x, w], attrs={"Codegen": "evt", "global_symbol": name}):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
        bb.emit_func_output(y)
    return bb.get().get_global_var(name)


def test_equal_partitions_are_merged_and_calls_redirected():
    bb = relax.BlockBuilder()
    a, b = _partition(bb, "p_a"), _partition(bb, "p_b")
    x = relax.Var("x", relax.TensorType((16, 32), "float16"))
    w = relax.Var("w", relax.TensorType((32, 16), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y1 = bb.emit(relax.Call(a, [x, w]))
            y2 = bb.emit(relax.Call(b, [x, w]))
            out = bb.emit_output(relax.op.add(y1, y2))
        bb.emit_func_output(out)
    mod = bb.get()
    assert {k.name_hint: v.name_hint for k, v in duplicates(mod).items()} == {"p_b": "p_a"}
    after = DeduplicateEVTPartitions()(mod)
    assert sorted(gv.name_hint for gv in after.get_global_vars()) == ["main", "p_a"]
    assert after["main"].script().count("p_a") == 2


def test_different_partitions_stay():
    bb = relax.BlockBuilder()
    _partition(bb, "p_a")
    x = relax.Var("x", relax.TensorType((16, 32), "float16"))
    w = relax.Var("w", relax.TensorType((32, 8), "float16"))  # another shape
    with bb.function("p_c", [x, w], attrs={"Codegen": "evt", "global_symbol": "p_c"}):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(y)
    mod = bb.get()
    assert duplicates(mod) == {}
    tvm.ir.assert_structural_equal(DeduplicateEVTPartitions()(mod), mod)
