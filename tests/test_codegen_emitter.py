"""Emitted C++: structure of the EVT type tree, layouts, configs, determinism (no nvcc)."""
import re

import pytest
from tvm import relax

from tvm_evt.codegen import KernelConfig, Schedule, Unsupported, emit, from_function, lower

M, N, K = 128, 64, 32


def build(epilogue, a_t=False, b_t=True, dtype="float16", batch=(), m=M):
    M = m  # noqa: N806 - the rows of this build
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(batch + ((K, M) if a_t else (M, K)), dtype))
    w = relax.Var("w", relax.TensorType((N, K) if b_t else (K, N), dtype))
    b = relax.Var("b", relax.TensorType((N,), dtype))
    c = relax.Var("c", relax.TensorType((M, 1), dtype))
    with bb.function("evt_kernel", [x, w, b, c]):
        with bb.dataflow():
            rank = len(batch) + 2
            axes = list(range(rank - 2)) + [rank - 1, rank - 2]
            a = relax.op.permute_dims(x, axes) if a_t else x
            y = bb.emit(relax.op.matmul(a, relax.op.permute_dims(w, [1, 0]) if b_t else w))
            res = bb.emit_output(epilogue(bb, y, b, c))
        bb.emit_func_output(res)
    return lower(from_function(bb.get()["evt_kernel"]))


def bias_relu(bb, y, b, c):
    return bb.emit(relax.op.nn.relu(relax.op.add(y, b)))


def test_evt_tree_for_a_chain():
    src = emit(build(bias_relu))
    assert "Sm90TopologicalVisitor" not in src
    assert re.search(r"using EVT\d+ = cutlass::epilogue::fusion::Sm90EVT<Node\d+, Node\d+, Node\d+>;", src)
    assert re.search(r"Sm90EVT<Node\d+, EVT\d+>;", src)  # relu(add(...))
    assert "Sm90RowBroadcast<0, TileShape, cutlass::half_t, ElementCompute, cute::Stride<cute::Int<0>, cute::Int<1>, int64_t>>" in src
    assert "Sm90Compute<tvm_evt::Relu, cutlass::half_t" in src
    assert "int __tvm_ffi_evt_kernel(void*, TVMFFIAny const* args, int32_t num_args," in src
    assert "TVM_FFI_THROW" not in src and "<tvm/ffi/function.h>" not in src  # C ABI, no exceptions


def test_topological_visitor_for_shared_value_and_aux_store():
    def epi(bb, y, b, c):
        z = bb.emit(relax.op.add(y, c))  # column broadcast
        g = bb.emit(relax.op.multiply(z, relax.op.sigmoid(z)))
        s = bb.emit(relax.op.sum(g, axis=[1]))
        return relax.Tuple([g, z, s])

    src = emit(build(epi))
    assert "Sm90TopologicalVisitor<ElementCompute, cute::tuple<" in src
    assert "Sm90ColBroadcast<0, TileShape, cutlass::half_t" in src
    assert "Sm90AuxStore<" in src and "AuxStoreDescriptor<EpilogueDescriptor" in src
    assert "Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape" in src


def test_broadcast_vector_of_odd_extent_is_loaded_an_element_at_a_time():
    """ViT's 197 query rows: a column vector's loads cannot be 16-byte vectors (nor can its batch
    stride be 16-byte aligned), so CUTLASS gets alignment 1 and predicates each element; an
    extent that allows 16 bytes keeps the default (and the source the cache knows)."""
    def epi(bb, y, b, c):
        return bb.emit(relax.op.add(y, c))

    def col_line(src):
        return next(line for line in src.splitlines() if "Sm90ColBroadcast<" in line).rstrip()

    assert col_line(emit(build(epi, m=197, batch=(2,)))).endswith("int64_t>, 1>;")
    assert col_line(emit(build(epi, m=196, batch=(2,)))).endswith("int64_t>, 4>;")
    assert col_line(emit(build(epi, batch=(2,)))).endswith("int64_t>>;")


def test_square_of_a_leaf_pads_the_topological_visitor():
    """acc * acc is a two-op topological visitor, which CUTLASS cannot compile (its
    ``cute::repeat<1>`` of the fragments is no tuple): the emitter puts an unused AccFetch first."""
    src = emit(build(lambda bb, y, b, c: relax.op.multiply(y, y)))
    fusion = "cutlass::epilogue::fusion"
    assert re.search(
        rf"Sm90TopologicalVisitor<ElementCompute, cute::tuple<cute::seq<>, cute::seq<>, cute::seq<1, 1>>, "
        rf"{fusion}::Sm90AccFetch, Node\d+, Node\d+>;", src
    )
    assert "{{}, {{}, {}}, {}}," in src  # the padding op's arguments, then the fp16-rounded fetch's
    # a three-op visitor is emitted as is
    src = emit(build(lambda bb, y, b, c: relax.op.multiply(relax.op.add(y, b), relax.op.add(y, b))))
    assert "Sm90TopologicalVisitor<ElementCompute, cute::tuple<cute::seq<>, cute::seq<>, cute::seq<0, 1>" in src


def test_scalar_reduction_and_constant():
    def epi(bb, y, b, c):
        z = bb.emit(relax.op.multiply(y, relax.const(0.5, "float16")))
        return relax.Tuple([z, bb.emit(relax.op.max(relax.op.astype(z, "float32"), axis=[0, 1]))])

    src = emit(build(epi))
    assert "Sm90ScalarBroadcast<cutlass::half_t" in src and "cutlass::half_t(0.5f)" in src
    assert "Sm90ScalarReduction<cutlass::maximum, cutlass::atomic_maximum, float" in src


@pytest.mark.parametrize(
    "a_t, b_t, layout_a, layout_b",
    [
        (False, True, "RowMajor", "ColumnMajor"),  # TN
        (False, False, "RowMajor", "RowMajor"),  # TT (B N-major)
        (True, True, "ColumnMajor", "ColumnMajor"),  # NN
        (True, False, "ColumnMajor", "RowMajor"),
    ],
)
def test_layouts(a_t, b_t, layout_a, layout_b):
    src = emit(build(bias_relu, a_t=a_t, b_t=b_t))
    assert f"using LayoutA = cutlass::layout::{layout_a};" in src
    assert f"using LayoutB = cutlass::layout::{layout_b};" in src


def test_batched_strides():
    src = emit(build(bias_relu, batch=(3,)))
    assert f"{{{M}, {N}, {K}, 3}}" in src
    assert f"cute::make_stride(int64_t({K}), cute::Int<1>{{}}, int64_t({M * K}))" in src  # A per batch
    assert f"cute::make_stride(int64_t({K}), cute::Int<1>{{}}, int64_t(0))" in src  # shared B


def test_tf32_needs_tn():
    assert "cutlass::layout::RowMajor" in emit(build(bias_relu, dtype="float32"))
    with pytest.raises(Unsupported, match="tf32"):
        emit(build(bias_relu, dtype="float32", b_t=False))


def test_config_is_an_input():
    p = build(bias_relu)
    src = emit(p, KernelConfig(tile=(64, 128, 64), cluster=(2, 1, 1), schedule=Schedule.PINGPONG))
    assert "KernelTmaWarpSpecializedPingpong" in src and "Shape<_64, _128, _64>" in src
    assert "Shape<_2, _1, _1>" in src
    assert "KernelTmaWarpSpecializedCooperative" in emit(p)


def test_deterministic():
    assert emit(build(bias_relu)) == emit(build(bias_relu))


def test_epilogue_subtile_is_a_config_input():
    p = build(bias_relu)
    assert "using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;" in emit(p)  # default unchanged
    src = emit(p, KernelConfig(tile=(128, 64, 64), epi_tile=(128, 16)))
    assert "using EpilogueTile = Shape<_128, _16>;" in src
    pp = KernelConfig(tile=(64, 64, 64), schedule=Schedule.PINGPONG, epi_tile=(64, 16))
    assert pp.name == "pp_64x64x64_c1x1_e64x16" and KernelConfig.from_json(pp.to_json()) == pp
    for bad in ((64, 16), (128, 48)):  # cooperative needs 128 rows; N must divide the tile
        with pytest.raises(ValueError):
            KernelConfig(epi_tile=bad)



def test_atomic_row_sums_are_a_config_input():
    from tvm_evt.codegen import bench

    p = bench.Case("x", "colsum", bench.Problem("p", "dgrad", 512, 256, 128)).build().partition
    assert "Sm90RowReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape, float" in emit(p)
    atomic = KernelConfig(atomic_reduce=True)
    assert atomic.name == "coop_128x128x64_c1x1_atomic" and KernelConfig.from_json(atomic.to_json()) == atomic
    src = emit(p, atomic)
    assert "Sm90RowReduction<cutlass::plus, cutlass::plus, cutlass::atomic_add, 0, TileShape, float" in src
    assert "atomic_add" not in emit(build(bias_relu), atomic)  # nothing to reduce: the same kernel
