"""Emit CUTLASS 3.x SM90 C++ for a lowered ``Partition`` (one TVM FFI entry per kernel).

Node types are declared once each (``Node<i>``), trees as ``EVT<i>`` (``Sm90EVT``) and regions as
``Topo<i>`` (``Sm90TopologicalVisitor``), in the visitor tree's order, so the same partition always
emits the same text.
"""
from __future__ import annotations

import math
import re

from ..errors import Unsupported
from ..ir import (
    AccFetch,
    AuxLoad,
    AuxStore,
    ColBroadcast,
    Compute,
    Dropout,
    EVTNode,
    Partition,
    Reduction,
    ReduceAxis,
    ReduceFn,
    RowBroadcast,
    ScalarBroadcast,
)
from ..philox import dropout_scale, keep_threshold
from .config import Decomposition, KernelConfig, Schedule, default_config
from .functors import BITS, CPP_TYPE, DL_TYPE, FUNCTOR, REDUCE
from .kernel_type import type_line
from .templates import DROPOUT, HEADER, KERNEL, KERNEL_TYPES, LAUNCHER, PRELUDE, SCHEDULER_ARGS, STREAM_K, TILE_SCHEDULER

CODEGEN_VERSION = "0.1.0"
FUSION = "cutlass::epilogue::fusion"
ROUND = "cutlass::FloatRoundStyle::round_to_nearest"


def _cpp(dtype: str) -> str:
    if dtype not in CPP_TYPE:
        raise Unsupported(f"dtype {dtype} has no epilogue element type")
    return CPP_TYPE[dtype]


def _full_vector(dtype: str) -> int:
    """Elements of ``dtype`` in one 16-byte vector access, CUTLASS's default alignment."""
    return 128 // BITS.get(dtype, 8)


def _vector_alignment(extent: int, dtype: str) -> int:
    """Elements per (predicated) vector load of a row/column broadcast vector: 16 bytes where its
    extent, which is also its batch stride, is a multiple of that, else the largest power of two
    dividing it (1 for ViT's 197 query rows: scalar loads of a vector that is one value a row)."""
    align = _full_vector(dtype)
    while extent % align:
        align //= 2
    return align


def _stride_type(stride) -> str:
    """cute::Stride with static 0/1 for M and N, dynamic int64 batch stride."""
    parts = []
    for s in stride[:2]:
        parts.append("cute::Int<0>" if s == 0 else "cute::Int<1>" if s == 1 else "int64_t")
    return f"cute::Stride<{parts[0]}, {parts[1]}, int64_t>"


def _stride_value(stride) -> str:
    parts = []
    for s in stride[:2]:
        parts.append("cute::Int<0>{}" if s == 0 else "cute::Int<1>{}" if s == 1 else f"int64_t({s})")
    return f"cute::make_stride({parts[0]}, {parts[1]}, int64_t({stride[2]}))"


def _float_literal(v: float) -> str:
    if math.isnan(v):
        return "cutlass::platform::numeric_limits<float>::quiet_NaN()"
    if math.isinf(v):
        return ("-" if v < 0 else "") + "cutlass::platform::numeric_limits<float>::infinity()"
    return f"{float(v)!r}f"


def _store_stride(p: Partition, axis: ReduceAxis | None):
    m, n, l = p.gemm.m, p.gemm.n, p.gemm.batch
    batched = l > 1
    if axis is None:
        return (n, 1, m * n if batched else 0)
    return {
        ReduceAxis.ROW: (0, 1, n if batched else 0),
        ReduceAxis.COL: (1, 0, m if batched else 0),
        ReduceAxis.SCALAR: (0, 0, 1 if batched else 0),
    }[axis]


def atomic_reduction(node: Reduction, config: KernelConfig) -> bool:
    """Whether a row/column reduction is finished with atomics: asked for by the configuration,
    and only for float32 sums (atomics reduce in the output type; CUTLASS's float max atomic does
    not propagate NaN as ``Max`` does)."""
    return config.atomic_reduce and node.fn is ReduceFn.SUM and node.dtype == "float32"


class Sm90Emitter:
    def __init__(self, partition: Partition, config: KernelConfig | None = None):
        if partition.visitor is None:
            raise ValueError("emit a lowered partition (tvm_evt.codegen.passes.lower)")
        self.p = partition
        self.config = config or default_config(partition.gemm.dtype_a)
        self.decls: list[str] = []
        self.declared: set[str] = set()
        self.namespace = "evt_" + re.sub(r"\W", "_", partition.symbol)

    # ------------------------------------------------------------------------------ node types
    def _declare(self, name: str, text: str) -> str:
        if name not in self.declared:
            self.declared.add(name)
            self.decls.append(f"using {name} = {text};")
        return name

    def node_type(self, i: int) -> str:
        """The bare visitor type of node ``i`` (without its children)."""
        node = self.p.epilogue.nodes[i]
        name = f"Node{i}"
        if isinstance(node, AccFetch):
            if node.dtype == "float32":
                return self._declare(name, f"{FUSION}::Sm90AccFetch")
            # the matmul's result type is narrower than the fp32 accumulator: round like Relax does
            fetch = self._declare(f"Node{i}Fetch", f"{FUSION}::Sm90AccFetch")
            cvt = self._declare(
                f"Node{i}Round",
                f"{FUSION}::Sm90Compute<tvm_evt::Identity, {_cpp(node.dtype)}, ElementCompute, {ROUND}>",
            )
            return self._declare(name, f"{FUSION}::Sm90EVT<{cvt}, {fetch}>")
        if isinstance(node, AuxLoad):
            desc = self._declare(
                f"Node{i}Desc",
                f"cutlass::epilogue::collective::detail::AuxLoadDescriptor<EpilogueDescriptor, "
                f"{_stride_type(node.stride)}, {_cpp(node.dtype)}>",
            )
            return self._declare(
                name,
                f"{FUSION}::Sm90AuxLoad<{desc}::Stages, typename {desc}::EpilogueTile, {_cpp(node.dtype)}, "
                f"{_stride_type(node.stride)}, typename {desc}::SmemLayoutAtom, typename {desc}::CopyOpS2R>",
            )
        if isinstance(node, (RowBroadcast, ColBroadcast)):
            kind = "Sm90RowBroadcast" if isinstance(node, RowBroadcast) else "Sm90ColBroadcast"
            extent = self.p.gemm.n if isinstance(node, RowBroadcast) else self.p.gemm.m
            align = _vector_alignment(extent, node.dtype)
            return self._declare(
                name,
                f"{FUSION}::{kind}<0, TileShape, {_cpp(node.dtype)}, ElementCompute, "
                f"{_stride_type(node.stride)}"
                + ("" if align == _full_vector(node.dtype) else f", {align}") + ">",
            )
        if isinstance(node, ScalarBroadcast):
            return self._declare(
                name, f"{FUSION}::Sm90ScalarBroadcast<{_cpp(node.dtype)}, {_stride_type(node.stride)}>"
            )
        if isinstance(node, Compute):
            return self._declare(
                name,
                f"{FUSION}::Sm90Compute<{FUNCTOR[node.op]}, {_cpp(node.dtype)}, ElementCompute, {ROUND}>",
            )
        if isinstance(node, Dropout):
            return self._declare(name, f"tvm_evt::Sm90PhiloxDropout<{_cpp(node.dtype)}, ElementCompute>")
        if isinstance(node, AuxStore):
            stride = _stride_type(_store_stride(self.p, None))
            desc = self._declare(
                f"Node{i}Desc",
                f"cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpilogueDescriptor, "
                f"{stride}, {_cpp(node.dtype)}>",
            )
            return self._declare(
                name,
                f"{FUSION}::Sm90AuxStore<{desc}::Stages, typename {desc}::EpilogueTile, {_cpp(node.dtype)}, "
                f"{ROUND}, {stride}, typename {desc}::SmemLayoutAtom, typename {desc}::CopyOpR2S>",
            )
        if isinstance(node, Reduction):
            reg, final, atomic, _ = REDUCE[node.fn]
            stride = _stride_type(_store_stride(self.p, node.axis))
            out = _cpp(node.dtype)
            if node.axis is ReduceAxis.SCALAR:
                return self._declare(
                    name,
                    f"{FUSION}::Sm90ScalarReduction<{reg}, {atomic}, {out}, ElementCompute, {ROUND}, {stride}>",
                )
            kind = "Sm90RowReduction" if node.axis is ReduceAxis.ROW else "Sm90ColReduction"
            gmem = atomic if atomic_reduction(node, self.config) else final
            return self._declare(
                name,
                f"{FUSION}::{kind}<{reg}, {reg}, {gmem}, 0, TileShape, {out}, ElementCompute, {ROUND}, {stride}>",
            )
        raise Unsupported(f"no SM90 visitor for node kind {node.kind}")

    def visitor_type(self, v) -> str:
        if isinstance(v, EVTNode):
            op = self.node_type(v.node)
            if not v.children:
                return op
            children = [self.visitor_type(c) for c in v.children]
            return self._declare(f"EVT{v.node}", f"{FUSION}::Sm90EVT<{op}, {', '.join(children)}>")
        ops = [self.node_type(op) if isinstance(op, int) else self.visitor_type(op) for op in v.ops]
        edges = [e for e in v.edges]
        if len(ops) == 2:
            # CUTLASS's Sm90TopologicalVisitor needs 3+ ops: with 2 its ``cute::repeat<1>`` of the
            # compute fragments is a bare Array, not a tuple, and ``get<0>`` fails to deduce.  Two
            # ops arise from a leaf read twice by one node (``acc * acc``); an unused, free
            # Sm90AccFetch in front makes it three.
            ops = [f"{FUSION}::Sm90AccFetch", *ops]
            edges = [(), *(tuple(j + 1 for j in e) for e in edges)]
        edges = ", ".join(f"cute::seq<{', '.join(map(str, e))}>" for e in edges)
        return self._declare(
            f"Topo{v.output}",
            f"{FUSION}::Sm90TopologicalVisitor<ElementCompute, cute::tuple<{edges}>, {', '.join(ops)}>",
        )

    # ------------------------------------------------------------------------------- arguments
    def node_args(self, i: int) -> str:
        node = self.p.epilogue.nodes[i]
        if isinstance(node, AccFetch):
            return "{}" if node.dtype == "float32" else "{{}, {}}"
        if isinstance(node, (AuxLoad, RowBroadcast, ColBroadcast)):
            return f"{{{self._param_ptr(node.param, node.dtype)}, {_cpp(node.dtype)}(0), {_stride_value(node.stride)}}}"
        if isinstance(node, ScalarBroadcast):
            if node.param is None:
                return f"{{{{{_cpp(node.dtype)}({_float_literal(node.value)})}}, {{}}, {{}}}}"
            return (
                f"{{{{}}, {{{self._param_ptr(node.param, node.dtype)}}}, {{{_stride_value(node.stride)}}}}}"
            )
        if isinstance(node, Compute):
            return "{}"
        if isinstance(node, Dropout):
            seed = self._param_ptr(node.seed_param, "uint32")
            return (
                f"{{{seed}, {node.site}u, {keep_threshold(node.p)}u, {_float_literal(float(dropout_scale(node.p)))}}}"
            )
        if isinstance(node, AuxStore):
            return f"{{{self._output_ptr(node.output, node.dtype)}, {_stride_value(_store_stride(self.p, None))}}}"
        if isinstance(node, Reduction):
            identity = REDUCE[node.fn][3]
            return (
                f"{{{self._output_ptr(node.output, node.dtype)}, {identity}, "
                f"{_stride_value(_store_stride(self.p, node.axis))}}}"
            )
        raise Unsupported(f"no arguments for node kind {node.kind}")

    def visitor_args(self, v) -> str:
        if isinstance(v, EVTNode):
            if not v.children:
                return self.node_args(v.node)
            return "{" + ", ".join([self.visitor_args(c) for c in v.children] + [self.node_args(v.node)]) + "}"
        parts = [self.node_args(op) if isinstance(op, int) else self.visitor_args(op) for op in v.ops]
        if len(parts) == 2:
            parts = ["{}", *parts]  # the padding Sm90AccFetch
        return "{" + ", ".join(parts) + "}"

    def _param_ptr(self, i: int, dtype: str) -> str:
        return f"tvm_evt::data_of<{_cpp(dtype)} const>(p{i})"

    def _output_ptr(self, i: int, dtype: str) -> str:
        return f"tvm_evt::data_of<{_cpp(dtype)}>(o{i})"

    # ------------------------------------------------------------------------------------ emit
    def _check_alignment(self) -> None:
        g = self.p.gemm
        for name, dtype, stride, dims in (
            ("A", g.dtype_a, g.a_stride, (g.m, g.k)),
            ("B", g.dtype_b, g.b_stride, (g.n, g.k)),
        ):
            align = _full_vector(dtype)
            contiguous = dims[1] if stride[1] == 1 else dims[0]
            if contiguous % align:
                raise Unsupported(f"operand {name}: contiguous extent {contiguous} is not a multiple of {align}")
        for i, node in enumerate(self.p.epilogue.nodes):
            if isinstance(node, Reduction) and node.axis is ReduceAxis.SCALAR and node.dtype != "float32":
                raise Unsupported(f"%{i}: scalar reductions are atomic and need a float32 result, not {node.dtype}")
            if isinstance(node, (AuxLoad, AuxStore)) or (
                isinstance(node, Reduction) and node.axis is not ReduceAxis.SCALAR
            ):
                align = _full_vector(node.dtype)
                extent = g.m if isinstance(node, AuxLoad) and node.column_major else g.n
                if isinstance(node, Reduction):
                    extent = g.n if node.axis is ReduceAxis.ROW else g.m
                if extent % align:
                    raise Unsupported(f"%{i} {node.kind}: extent {extent} is not a multiple of {align} elements")

    def emit(self) -> str:
        p, g, cfg = self.p, self.p.gemm, self.config
        if g.dtype_a == "float32" and not (g.a_k_major and g.b_k_major):
            raise Unsupported("tf32 GEMMs need K-major A and B (a TN problem); transpose in the graph")
        self._check_alignment()
        root = self.visitor_type(p.visitor)
        d_node = next(n for n in p.epilogue.nodes if isinstance(n, AuxStore) and n.output == p.d_output)
        n_params, n_outputs = len(p.params), len(p.outputs)
        names = [f"p{i}" for i in range(n_params)] + [f"o{i}" for i in range(n_outputs)]
        bind = "\n".join(f"  DLTensor* {name} = tensors[{i}];" for i, name in enumerate(names))
        checks = []
        for prefix, descs in (("p", p.params), ("o", p.outputs)):
            for i, desc in enumerate(descs):
                if desc.dtype not in DL_TYPE:
                    raise Unsupported(f"tensor dtype {desc.dtype} is not supported by the entry function")
                code, bits = DL_TYPE[desc.dtype]
                shape = ", ".join(str(d) for d in desc.shape)
                kind = "parameter" if prefix == "p" else "output"
                checks.append(
                    f'  if (tvm_evt::check_tensor({prefix}{i}, kKernel, "{kind} {i}", {{{shape}}}, {code}, {bits}, '
                    f"device_id)) return -1;"
                )
        a_st, b_st = g.a_stride, g.b_stride
        values = dict(
            version=CODEGEN_VERSION,
            symbol=p.symbol,
            namespace=self.namespace,
            layout=g.layout_name,
            m=g.m, n=g.n, k=g.k, l=g.batch,
            dtype_a=g.dtype_a, dtype_b=g.dtype_b,
            element_a=_cpp(g.dtype_a), element_b=_cpp(g.dtype_b),
            layout_a="cutlass::layout::RowMajor" if g.a_k_major else "cutlass::layout::ColumnMajor",
            layout_b="cutlass::layout::ColumnMajor" if g.b_k_major else "cutlass::layout::RowMajor",
            align_a=_full_vector(g.dtype_a), align_b=_full_vector(g.dtype_b),
            tile_m=cfg.tile[0], tile_n=cfg.tile[1], tile_k=cfg.tile[2],
            cluster_m=cfg.cluster[0], cluster_n=cfg.cluster[1], cluster_k=cfg.cluster[2],
            kernel_schedule="cutlass::gemm::KernelTmaWarpSpecializedCooperative"
            if cfg.schedule is Schedule.COOPERATIVE else "cutlass::gemm::KernelTmaWarpSpecializedPingpong",
            epilogue_schedule="cutlass::epilogue::TmaWarpSpecializedCooperative"
            if cfg.schedule is Schedule.COOPERATIVE else "cutlass::epilogue::TmaWarpSpecialized",
            element_d=_cpp(d_node.dtype),
            visitor_decls="\n".join(self.decls),
            visitor_root=root,
            num_args=len(names),
            bind=bind,
            first_tensor="p0",
            checks="\n".join(checks),
            stride_a=_stride_value(a_st),
            stride_b=_stride_value(b_st),
            stride_d_l=g.m * g.n if g.batch > 1 else 0,
            ptr_a=self._param_ptr(g.a_param, g.dtype_a),
            ptr_b=self._param_ptr(g.b_param, g.dtype_b),
            ptr_d=self._output_ptr(p.d_output, d_node.dtype),
            fusion_args=self.visitor_args(p.visitor),
            raster=cfg.raster.value,
            epilogue_tile="cutlass::epilogue::collective::EpilogueTileAuto" if cfg.epi_tile is None
            else f"Shape<_{cfg.epi_tile[0]}, _{cfg.epi_tile[1]}>",
            tile_scheduler=TILE_SCHEDULER[cfg.decomposition.value],
            scheduler_args=SCHEDULER_ARGS[cfg.decomposition.value].substitute(splits=cfg.splits),
            launch=LAUNCHER[cfg.decomposition.value],
        )
        dropout = DROPOUT if any(isinstance(n, Dropout) for n in p.epilogue.nodes) else ""
        stream_k = STREAM_K if cfg.decomposition is not Decomposition.DATA_PARALLEL else ""
        prelude = PRELUDE + stream_k + dropout
        values["kernel_type"] = type_line(prelude + KERNEL_TYPES.substitute(values, namespace="kernel"))
        return HEADER.substitute(values) + prelude + KERNEL.substitute(values)


def emit(partition: Partition, config: KernelConfig | None = None) -> str:
    """C++ source of one kernel with its TVM FFI entry ``__tvm_ffi_<partition.symbol>``."""
    return Sm90Emitter(partition, config).emit()
