"""Epilogue IR and pass unit tests (CPU, no Relax build)."""
from dataclasses import replace

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.codegen import Unsupported, from_function, legality, lower, philox, reference
from tvm_evt.codegen.ir import (
    AccFetch, AuxLoad, AuxStore, ColBroadcast, Compute, EVTNode, EpilogueGraph, GemmSpec, OpKind,
    Partition, Permute, Reduction, ReduceAxis, ReduceFn, RowBroadcast, ScalarBroadcast, TensorDesc,
    TensorInput, TopoVisitor, canonicalize,
)
from tvm_evt.codegen.passes import (
    DagToTree, EliminateLayout, InlineStores, InvariantError, PropagateShapeDtype,
)

M, N, K = 16, 32, 8


def make_partition(nodes, params, outputs, batch_shape=()):
    gemm = GemmSpec(a_param=0, b_param=1, m=M, n=N, k=K, batch=int(np.prod(batch_shape)),
                    a_stride=(K, 1, 0), b_stride=(K, 1, 0), dtype_a="float16", dtype_b="float16")
    params = (TensorDesc((M, K), "float16"), TensorDesc((N, K), "float16")) + tuple(params)
    return Partition("k", params, tuple(outputs), tuple(batch_shape), gemm, canonicalize(nodes), 0)


def out(shape=(M, N)):
    return TensorDesc(shape, "float16")


def bias_relu():
    nodes = [
        AccFetch(dtype="float16"),
        TensorInput(param=2, shape=(N,), dtype="float16"),
        Compute(op=OpKind.ADD, inputs=(0, 1)),
        Compute(op=OpKind.RELU, inputs=(2,)),
        AuxStore(inputs=(3,), output=0, dtype="float16"),
    ]
    return make_partition(nodes, [TensorDesc((N,), "float16")], [out()])


# ------------------------------------------------------------------------------------ graph
def test_graph_rejects_non_topological_order():
    with pytest.raises(ValueError):
        EpilogueGraph((Compute(op=OpKind.NEG, inputs=(1,)), AccFetch()))


def test_canonical_order_ignores_binding_order():
    a = [AccFetch(), TensorInput(param=2), TensorInput(param=3),
         Compute(op=OpKind.ADD, inputs=(0, 1)), Compute(op=OpKind.MUL, inputs=(0, 2)),
         Compute(op=OpKind.SUB, inputs=(3, 4))]
    b = [TensorInput(param=3), AccFetch(), Compute(op=OpKind.MUL, inputs=(1, 0)),
         TensorInput(param=2), Compute(op=OpKind.ADD, inputs=(1, 3)), Compute(op=OpKind.SUB, inputs=(4, 2))]
    assert canonicalize(a) == canonicalize(b)
    # operand order is kept: sub(add, mul)
    g = canonicalize(a)
    sub = g.nodes[-1]
    assert [g.nodes[i].op for i in sub.inputs] == [OpKind.ADD, OpKind.MUL]


# ---------------------------------------------------------------------------------- passes
def test_propagate_shape_dtype():
    p = PropagateShapeDtype()(bias_relu())
    assert [n.shape for n in p.epilogue.nodes] == [(M, N), (N,), (M, N), (M, N), (M, N)]
    assert {n.dtype for n in p.epilogue.nodes} == {"float16"}


def test_propagate_rejects_mixed_dtypes():
    p = bias_relu()
    nodes = list(p.epilogue.nodes)
    nodes[1] = replace(nodes[1], dtype="float32")
    with pytest.raises(Unsupported, match="mixes dtypes"):
        PropagateShapeDtype()(replace(p, epilogue=EpilogueGraph(tuple(nodes)),
                                      params=p.params[:2] + (TensorDesc((N,), "float32"),)))


@pytest.mark.parametrize(
    "shape, chain, kind, stride",
    [
        ((M, N), [], AuxLoad, (N, 1, 0)),
        ((N, M), [(1, 0)], AuxLoad, (1, M, 0)),  # transposed input -> column-major aux load
        ((N,), [], RowBroadcast, (0, 1, 0)),
        ((1, N), [], RowBroadcast, (0, 1, 0)),
        ((M, 1), [], ColBroadcast, (1, 0, 0)),
        ((1, M), [(1, 0)], ColBroadcast, (1, 0, 0)),
        ((), [], ScalarBroadcast, (0, 0, 0)),
    ],
)
def test_layout_elimination_classifies_loads(shape, chain, kind, stride):
    nodes = [AccFetch(dtype="float16"), TensorInput(param=2, shape=shape, dtype="float16")]
    src = 1
    for axes in chain:
        nodes.append(Permute(inputs=(src,), axes=axes))
        src = len(nodes) - 1
    nodes += [Compute(op=OpKind.MUL, inputs=(0, src)), AuxStore(inputs=(len(nodes),), output=0, dtype="float16")]
    p = make_partition(nodes, [TensorDesc(shape, "float16")], [out()])
    lowered = EliminateLayout()(PropagateShapeDtype()(p))
    loads = [n for n in lowered.epilogue.nodes if n.kind not in ("AccFetch", "Compute", "AuxStore")]
    assert len(loads) == 1 and isinstance(loads[0], kind) and loads[0].stride == stride
    params = [np.zeros((M, K), "float16"), np.zeros((N, K), "float16"),
              np.random.default_rng(0).standard_normal(shape).astype("float16")]
    params[0][:, 0] = 1
    params[1][:, 0] = 1
    for a, b in zip(reference.evaluate(p, params), reference.evaluate(lowered, params)):
        np.testing.assert_array_equal(a, b)


def test_layout_elimination_batch_strides():
    nodes = [AccFetch(dtype="float16"), TensorInput(param=2, shape=(3, 1, N), dtype="float16"),
             Compute(op=OpKind.ADD, inputs=(0, 1)), AuxStore(inputs=(2,), output=0, dtype="float16")]
    p = make_partition(nodes, [TensorDesc((3, 1, N), "float16")], [out((3, M, N))], batch_shape=(3,))
    lowered = EliminateLayout()(PropagateShapeDtype()(p))
    row = next(n for n in lowered.epilogue.nodes if isinstance(n, RowBroadcast))
    assert row.stride == (0, 1, N)


def test_layout_elimination_ensures():
    class Broken(EliminateLayout):
        def call(self, p):
            return p

    with pytest.raises(InvariantError, match="survived"):
        Broken()(PropagateShapeDtype()(bias_relu()))


def test_inline_stores_chains_readers_through_store():
    nodes = [AccFetch(dtype="float16"), Compute(op=OpKind.EXP, inputs=(0,)),
             AuxStore(inputs=(1,), output=1, dtype="float16"), Compute(op=OpKind.NEG, inputs=(1,)),
             AuxStore(inputs=(3,), output=0, dtype="float16")]
    p = lower(make_partition(nodes, [], [out(), out()]))
    g = p.epilogue
    neg = next(n for n in g.nodes if isinstance(n, Compute) and n.op is OpKind.NEG)
    assert isinstance(g.nodes[neg.inputs[0]], AuxStore)  # neg reads the store, not exp
    assert isinstance(p.visitor, EVTNode)  # a pure chain stays a tree


def test_dag_to_tree_wraps_multi_use_in_topological_visitor():
    nodes = [AccFetch(dtype="float16"), Compute(op=OpKind.SIGMOID, inputs=(0,)),
             Compute(op=OpKind.MUL, inputs=(0, 1)), AuxStore(inputs=(2,), output=0, dtype="float16")]
    p = lower(make_partition(nodes, [], [out()]))
    assert isinstance(p.visitor, TopoVisitor)
    topo = p.visitor
    assert len(topo.ops) == len(topo.edges) == 3
    assert topo.edges[-1] == (0, 1)  # mul(acc, sigmoid(acc))


def test_dag_to_tree_side_store_after_root():
    """The D value also feeds a later aux store: an identity is inserted so D's input is last."""
    nodes = [AccFetch(dtype="float16"), Compute(op=OpKind.RELU, inputs=(0,)),
             AuxStore(inputs=(1,), output=0, dtype="float16"), Compute(op=OpKind.EXP, inputs=(1,)),
             AuxStore(inputs=(3,), output=1, dtype="float16"),
             Reduction(inputs=(1,), axis=ReduceAxis.COL, fn=ReduceFn.SUM, output=2, dtype="float16")]
    p = lower(make_partition(nodes, [], [out(), out(), out((M,))]))
    assert isinstance(p.visitor, TopoVisitor)
    g = p.epilogue
    assert g.nodes[p.visitor.output].op is OpKind.CAST


def test_dag_to_tree_ensures():
    class Broken(DagToTree):
        def call(self, p):
            return replace(p, visitor=EVTNode(0))

    p = InlineStores()(EliminateLayout()(PropagateShapeDtype()(bias_relu())))
    with pytest.raises(InvariantError, match="covers"):
        Broken()(p)


# -------------------------------------------------------------------------------- frontend
def _func(build, third=((N,), "float16")):
    """f(x, w, b) = build(bb, x, w, b, x @ wᵀ); `b` has the type `third` (a bias by default)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, K), "float16"))
    w = relax.Var("w", relax.TensorType((N, K), "float16"))
    b = relax.Var("b", relax.TensorType(*third))
    with bb.function("f", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
            res = build(bb, x, w, b, y)
            res = bb.emit_output(res)
        bb.emit_func_output(res)
    return bb.get()["f"]


def test_frontend_folds_transpose_into_gemm_layout():
    p = from_function(_func(lambda bb, x, w, b, y: bb.emit(relax.op.nn.relu(relax.op.add(y, b)))))
    assert p.gemm.a_k_major and p.gemm.b_k_major and p.gemm.layout_name == "TN"
    assert (p.gemm.m, p.gemm.n, p.gemm.k) == (M, N, K)


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda bb, x, w, b, y: bb.emit(relax.op.add(relax.op.sum(y, axis=[0]), b)), "terminal"),
        (lambda bb, x, w, b, y: bb.emit(relax.op.matmul(y, relax.op.permute_dims(w, [0, 1]))), "more than one matmul"),
        (lambda bb, x, w, b, y: bb.emit(relax.op.nn.softmax(y)), "softmax"),
        (lambda bb, x, w, b, y: bb.emit(relax.op.permute_dims(y, [1, 0])), "epilogue value"),
        (lambda bb, x, w, b, y: bb.emit(relax.op.astype(y, "int32")), "int32"),
    ],
)
def test_frontend_reports_why(build, reason):
    result = legality(_func(build))
    assert not result.ok and reason in result.reason


def test_frontend_loads_an_input_read_twice_in_split_form_once():
    # GPT-2's dropout mask is read as [B, S, N] by two wheres; each read had become its own
    # tile-rank view, so the kernel loaded the mask twice
    def build(bb, x, w, keep, y):
        y3 = bb.emit(relax.op.reshape(y, (2, M // 2, N)))
        zero = relax.const(0.0, "float16")
        first = bb.emit(relax.op.where(keep, y3, zero))
        twice = bb.emit(relax.op.multiply(y3, relax.const(2.0, "float16")))
        return relax.Tuple([first, bb.emit(relax.op.where(keep, twice, zero))])

    p = lower(from_function(_func(build, third=((2, M // 2, N), "bool"))))
    loads = [n for n in p.epilogue.nodes if isinstance(n, AuxLoad)]
    assert len(loads) == 1 and loads[0].param == 2 and loads[0].dtype == "bool"
    assert sum(isinstance(n, AuxStore) for n in p.epilogue.nodes) == 2


def test_legality_accepts_bias_gelu():
    result = legality(_func(lambda bb, x, w, b, y: bb.emit(relax.op.nn.gelu(relax.op.add(y, b)))))
    assert result.ok, result.reason
    assert result.partition.visitor is not None


# ---------------------------------------------------------------------------------- philox
def test_philox_known_answers():
    # Random123 kat_vectors for philox4x32_10
    assert [int(v) for v in philox.philox4x32_10((0, 0, 0, 0), (0, 0))] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert [int(v) for v in philox.philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
                                                  (0xA4093822, 0x299F31D0))] == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_dropout_keep_rate():
    keep = philox.dropout_keep((2, 64, 64), (1234, 5678), site=3, p=0.25)
    assert abs(keep.mean() - 0.75) < 0.02
    other_site = philox.dropout_keep((2, 64, 64), (1234, 5678), site=4, p=0.25)
    assert (keep != other_site).any()
