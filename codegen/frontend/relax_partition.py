"""Read a Relax partition (its ops, not its name) into a ``Partition``.

Accepts the function ``FuseOpsByPattern(..., annotate_codegen=True)`` creates (an outer function
with ``Codegen="evt"`` calling an inner ``Composite`` function) or a bare composite function, or
the bindings a ``PatternCheckContext`` holds.  Anything the epilogue cannot express raises
``Unsupported`` with the reason; the partition is then left to TVM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import tvm
from tvm import relax

from ..errors import Unsupported
from ..ir import (
    AccFetch,
    AuxStore,
    Compute,
    Dropout,
    EpilogueGraph,
    GemmSpec,
    LAYOUT_KINDS,
    Node,
    OpKind,
    Partition,
    Permute,
    Reduction,
    ReduceAxis,
    ReduceFn,
    Reshape,
    ScalarBroadcast,
    TensorDesc,
    TensorInput,
    canonicalize,
)
from ..ir.views import View, collapse_batch
from ..passes.eliminate_layout import view_of

# ----------------------------------------------------------------------------------- op tables
BINARY_OPS = {
    "relax.add": OpKind.ADD,
    "relax.subtract": OpKind.SUB,
    "relax.multiply": OpKind.MUL,
    "relax.divide": OpKind.DIV,
    "relax.maximum": OpKind.MAX,
    "relax.minimum": OpKind.MIN,
    "relax.greater": OpKind.GT,
    "relax.greater_equal": OpKind.GE,
    "relax.less": OpKind.LT,
    "relax.less_equal": OpKind.LE,
    "relax.equal": OpKind.EQ,
    "relax.not_equal": OpKind.NE,
    "relax.logical_and": OpKind.AND,
    "relax.logical_or": OpKind.OR,
}
UNARY_OPS = {
    "relax.negative": OpKind.NEG,
    "relax.exp": OpKind.EXP,
    "relax.log": OpKind.LOG,
    "relax.tanh": OpKind.TANH,
    "relax.erf": OpKind.ERF,
    "relax.sigmoid": OpKind.SIGMOID,
    "relax.nn.relu": OpKind.RELU,
    "relax.nn.gelu": OpKind.GELU,
    "relax.nn.gelu_tanh": OpKind.GELU_TANH,
    "relax.nn.silu": OpKind.SILU,
}
REDUCE_OPS = {"relax.sum": ReduceFn.SUM, "relax.max": ReduceFn.MAX}
LAYOUT_OPS = ("relax.permute_dims", "relax.reshape")
OTHER_OPS = ("relax.matmul", "relax.astype", "relax.where", "relax.call_pure_packed")

# Extern functions (called through R.call_pure_packed) the training graph uses for the forms
# Relax has no operator for.  Arguments in order:
#   DROPOUT_EXTERN(x, seed: uint32[2] tensor, site: R.prim_value(int), p: R.prim_value(float))
#       -> keep ? x / (1 - p) : 0, keep by the Philox convention of ``tvm_evt.codegen.philox``
#   RELU_BACKWARD_EXTERN(grad, x)   -> grad * (x > 0)
#   GELU_BACKWARD_EXTERN(grad, x)   -> grad * gelu'(x)  (erf form)
DROPOUT_EXTERN = "tvm_evt.philox_dropout"
RELU_BACKWARD_EXTERN = "tvm_evt.relu_backward"
GELU_BACKWARD_EXTERN = "tvm_evt.gelu_backward"
EXTERN_BINARY = {RELU_BACKWARD_EXTERN: OpKind.RELU_BACKWARD, GELU_BACKWARD_EXTERN: OpKind.GELU_BACKWARD}

SUPPORTED_OPS = frozenset(BINARY_OPS) | frozenset(UNARY_OPS) | frozenset(REDUCE_OPS) | frozenset(
    LAYOUT_OPS
) | frozenset(OTHER_OPS)
SUPPORTED_EXTERNS = frozenset({DROPOUT_EXTERN, *EXTERN_BINARY})

GEMM_DTYPES = {("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32")}
EPILOGUE_DTYPES = frozenset({"float16", "bfloat16", "float32", "bool"})


# TVM 0.27 spells struct info as ``expr.ty`` (a ``relax.TensorType`` with ``shape``/``dtype``),
# relax.Var/Tuple/Call as tvm.ir.expr classes, and constants as tvm.ir.expr.Constant subclasses.
def _ttype(expr):
    ty = getattr(expr, "ty", None)
    return ty if isinstance(ty, relax.TensorType) else None


def _dtype(expr) -> str | None:
    ty = _ttype(expr)
    return None if ty is None else str(ty.dtype)


def _static_shape(expr, what: str) -> tuple[int, ...]:
    ty = _ttype(expr)
    if ty is None or ty.shape is None or not hasattr(ty.shape, "values"):
        raise Unsupported(f"{what} is not a tensor of known shape")
    dims = []
    for d in ty.shape.values:
        if not isinstance(d, tvm.ir.prim.expr.IntImm):
            raise Unsupported(f"{what} has a symbolic dimension {d}")
        dims.append(int(d))
    return tuple(dims)


def tile_view(shape: tuple[int, ...], tile: tuple[int, ...]) -> tuple[int, ...] | None:
    """``shape`` in the tile's rank when it is the tile (or a broadcast of it) with the leading
    dimensions split: [B, S, N] -> [B*S, N] for an (M, N) tile; [b, h, M, N] -> [b*h, M, N] for an
    (L, M, N) tile; [B, S, 1] -> [B*S, 1]; [1, 1, N] -> [1, N].  None when it is not."""
    rank = len(tile)
    if len(shape) <= rank:
        return None
    keep = rank - 1  # dims kept as they are: N, or (M, N) of a batched tile
    lead = math.prod(shape[:len(shape) - keep])
    view = (lead,) + tuple(shape[len(shape) - keep:])
    ok = all(v in (1, t) for v, t in zip(view, tile))
    return view if ok else None


def same_tile(shape: tuple[int, ...] | None, tile: tuple[int, ...]) -> bool:
    """Is a tensor of ``shape`` the GEMM's output ``tile`` ([batch,] M, N) element for element:
    the tile itself or its split-leading-dims form ([B, S, N] for (B*S, N))?"""
    return shape is not None and (tuple(shape) == tuple(tile) or tile_view(tuple(shape), tuple(tile)) == tuple(tile))


def _desc(expr, what: str) -> TensorDesc:
    return TensorDesc(_static_shape(expr, what), _dtype(expr))


@dataclass
class _Builder:
    params: list  # relax.Var
    nodes: list[Node] = field(default_factory=list)
    env: dict = field(default_factory=dict)  # relax.Var -> node index
    reductions: dict = field(default_factory=dict)  # relax.Var -> Reduction (output unset)
    views: dict = field(default_factory=dict)  # (node index, tile-rank shape) -> its Reshape node
    gemm: GemmSpec | None = None
    batch_shape: tuple[int, ...] = ()
    acc: int | None = None

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def operand(self, expr) -> int:
        if isinstance(expr, relax.Var):
            if expr in self.reductions:
                raise Unsupported("a reduction result is read inside the epilogue (reductions must be terminal)")
            if expr in self.env:
                return self.env[expr]
            for i, p in enumerate(self.params):
                if p.same_as(expr):
                    desc = _desc(p, f"parameter {p.name}")
                    self.env[expr] = self.add(TensorInput(param=i, shape=desc.shape, dtype=desc.dtype))
                    return self.env[expr]
            raise Unsupported(f"free variable {expr.name} is not a partition parameter")
        if isinstance(expr, tvm.ir.expr.Constant) and hasattr(expr.value, "numpy"):
            data = expr.value.numpy()
            if data.size != 1:
                raise Unsupported(f"non-scalar constant of shape {data.shape} in the epilogue")
            return self.add(ScalarBroadcast(value=float(data.reshape(-1)[0]), dtype=str(data.dtype), shape=()))
        raise Unsupported(f"unsupported operand {type(expr).__name__}")

    # ---------------------------------------------------------------------------------- bindings
    def bind(self, var, value) -> None:
        if isinstance(value, relax.Var):
            self.env[var] = self.operand(value)
            return
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            raise Unsupported(f"binding {var.name} is a {type(value).__name__}, not an operator call")
        name = value.op.name
        dtype = _dtype(var)
        if name == "relax.matmul":
            self.env[var] = self.matmul(var, value)
        elif name in LAYOUT_OPS:
            src = self.operand(value.args[0])
            if not isinstance(self.nodes[src], LAYOUT_KINDS):
                if name == "relax.reshape" and self._same_tile(_static_shape(var, "reshape")) \
                        and self._same_tile(_static_shape(value.args[0], "reshape input")):
                    self.env[var] = src  # [M, N] <-> [B, S, N]: every element stays where it is
                    return
                raise Unsupported(f"{name} of an epilogue value (only inputs can be transposed/reshaped, "
                                  "and epilogue values only between forms of the M x N tile)")
            if name == "relax.permute_dims":
                rank = len(_static_shape(value.args[0], "permute_dims input"))
                axes = value.attrs.axes
                axes = tuple(range(rank))[::-1] if axes is None else tuple(int(a) % rank for a in axes)
                self.env[var] = self.add(Permute(inputs=(src,), axes=axes))
            else:
                self.env[var] = self.add(Reshape(inputs=(src,), new_shape=_static_shape(var, "reshape")))
        elif name in BINARY_OPS or name in UNARY_OPS:
            op = BINARY_OPS.get(name) or UNARY_OPS[name]
            self.env[var] = self.compute(op, value.args, dtype)
        elif name == "relax.where":
            self.env[var] = self.compute(OpKind.WHERE, value.args, dtype)
        elif name == "relax.astype":
            src = self.tiled(self.operand(value.args[0]), value.args[0])  # a cast input in [B, S, N] form
            self.env[var] = self.add(Compute(op=OpKind.CAST, inputs=(src,), dtype=str(value.attrs.dtype)))
        elif name in REDUCE_OPS:
            self.reductions[var] = self.reduction(var, value, REDUCE_OPS[name])
        elif name == "relax.call_pure_packed":
            self.env[var] = self.extern(value, dtype)
        else:
            raise Unsupported(f"operator {name} cannot be fused into a GEMM epilogue")
        if dtype is not None and dtype not in EPILOGUE_DTYPES and name not in LAYOUT_OPS:
            raise Unsupported(f"{name} produces {dtype}; the epilogue supports {sorted(EPILOGUE_DTYPES)}")

    def compute(self, op: OpKind, args, dtype) -> int:
        ins = tuple(self.tiled(self.operand(a), a) for a in args)
        return self.add(Compute(op=op, inputs=ins, dtype=dtype))

    @property
    def tile(self) -> tuple[int, ...]:
        return tuple(self.batch_shape) + (self.gemm.m, self.gemm.n)

    def _same_tile(self, shape) -> bool:
        return self.gemm is not None and same_tile(shape, self.tile)

    def tiled(self, i: int, expr) -> int:
        """Input-derived operand ``i`` reshaped to the tile's rank when Relax gave it in the
        split-leading-dims form of the tile ([B, S, N], [B, S, 1], [1, 1, N])."""
        if self.gemm is None or not isinstance(self.nodes[i], LAYOUT_KINDS):
            return i
        shape = getattr(getattr(expr, "ty", None), "shape", None)
        if shape is None or not hasattr(shape, "values"):
            return i
        view = tile_view(_static_shape(expr, "operand"), self.tile)
        if view is None:
            return i
        if (i, view) not in self.views:  # one view a read input: one load, however many ops read it
            self.views[(i, view)] = self.add(Reshape(inputs=(i,), new_shape=view))
        return self.views[(i, view)]

    def _depends_on_acc(self, i: int) -> bool:
        node = self.nodes[i]
        return isinstance(node, AccFetch) or any(self._depends_on_acc(j) for j in node.inputs)

    def matmul(self, var, call) -> int:
        if self.gemm is not None:
            raise Unsupported("more than one matmul in the partition")
        a, b = (self.operand(x) for x in call.args)
        for x in (a, b):
            if not isinstance(self.nodes[x], LAYOUT_KINDS):
                raise Unsupported("a matmul operand is computed (only transposes/reshapes of inputs fold into the main loop)")
        a_param, a_view = view_of(self.nodes, a)
        b_param, b_view = view_of(self.nodes, b)
        if len(a_view.shape) < 2 or len(b_view.shape) < 2:
            raise Unsupported("matmul with a 1-D operand")
        out = _static_shape(var, "matmul result")
        batch, (m, n) = out[:-2], out[-2:]
        k = a_view.shape[-1]
        a_dims = a_view.align(batch + (m, k), "matmul operand A")
        b_dims = b_view.align(batch + (k, n), "matmul operand B")
        a_stride = (a_dims[-2], a_dims[-1], collapse_batch(batch, a_dims[:-2], "matmul operand A"))
        b_stride = (b_dims[-1], b_dims[-2], collapse_batch(batch, b_dims[:-2], "matmul operand B"))
        for name, st in (("A", a_stride), ("B", b_stride)):
            if 1 not in st[:2]:
                raise Unsupported(f"matmul operand {name} has no unit stride (strides {st})")
            if 0 in st[:2]:  # CUTLASS's SM90 operand strides are (int64, _1) or (_1, int64): no _0
                raise Unsupported(f"matmul operand {name} has a zero stride (strides {st}: a broadcast operand or "
                                  f"an extent-1 dimension, M={m} N={n} K={k}), which a TMA operand cannot take")
        dta, dtb = _dtype(call.args[0]), _dtype(call.args[1])
        if (dta, dtb) not in GEMM_DTYPES:
            raise Unsupported(f"matmul of {dta} x {dtb}; supported: {sorted(GEMM_DTYPES)}")
        self.gemm = GemmSpec(
            a_param=a_param, b_param=b_param, m=m, n=n, k=k, batch=math.prod(batch),
            a_stride=a_stride, b_stride=b_stride, dtype_a=dta, dtype_b=dtb,
        )
        self.batch_shape = batch
        self.acc = self.add(AccFetch(dtype=_dtype(var)))
        return self.acc

    def reduction(self, var, call, fn: ReduceFn) -> Reduction:
        src = self.operand(call.args[0])
        rank = len(self.batch_shape) + 2
        src_rank = len(_static_shape(call.args[0], "reduction input"))
        axis = call.attrs.axis
        axes = set(range(src_rank)) if axis is None else {int(a) % src_rank for a in axis}
        if src_rank > rank:  # the split form [B, S, N] of an (M, N) tile: the leading dims are M
            split = src_rank - rank + 1  # dims that make up the tile's first dim
            if not (axes >= set(range(split)) or not axes & set(range(split))):
                raise Unsupported(f"reduction over axes {sorted(axes)} splits the tile's leading dimension")
            axes = ({0} if axes & set(range(split)) else set()) | {a - split + 1 for a in axes if a >= split}
        if axes == {rank - 2}:
            kind = ReduceAxis.ROW
        elif axes == {rank - 1}:
            kind = ReduceAxis.COL
        elif axes == {rank - 2, rank - 1} or (axes == set(range(rank)) and math.prod(self.batch_shape) == 1):
            kind = ReduceAxis.SCALAR
        else:
            raise Unsupported(f"reduction over axes {sorted(axes)} (the batch dims are never reduced)")
        return Reduction(inputs=(src,), axis=kind, fn=fn, output=-1, dtype=_dtype(var))

    def extern(self, call, dtype) -> int:
        func = call.args[0]
        name = func.global_symbol if isinstance(func, relax.ExternFunc) else None
        if name == DROPOUT_EXTERN:
            x = self.operand(call.args[1])
            seed = self._param_index(call.args[2], "dropout seed")
            site, p = call.args[3], call.args[4]
            for what, v in (("site", site), ("probability", p)):
                if not (isinstance(v, tvm.ir.expr.Constant) and isinstance(v.value, (int, float))):
                    raise Unsupported(f"dropout {what} must be a compile-time R.prim_value")
            return self.add(Dropout(inputs=(x,), p=float(p.value), seed_param=seed, site=int(site.value), dtype=dtype))
        if name in EXTERN_BINARY:
            ins = tuple(self.tiled(self.operand(a), a) for a in call.args[1:3])
            return self.add(Compute(op=EXTERN_BINARY[name], inputs=ins, dtype=dtype))
        raise Unsupported(f"extern call {name!r} cannot be fused into a GEMM epilogue")

    def _param_index(self, expr, what: str) -> int:
        for i, p in enumerate(self.params):
            if p.same_as(expr):
                desc = _desc(p, what)
                if desc.dtype != "uint32" or desc.shape != (2,):
                    raise Unsupported(f"{what} must be a uint32[2] tensor, got {desc}")
                return i
        raise Unsupported(f"{what} must be a partition parameter")

    # ----------------------------------------------------------------------------------- outputs
    def finish(self, symbol: str, outputs) -> Partition:
        if self.gemm is None:
            raise Unsupported("the partition has no matmul")
        out_descs = []
        for i, var in enumerate(outputs):
            desc = _desc(var, f"output {i}")
            out_descs.append(desc)
            if var in self.reductions:
                red = self.reductions[var]
                src = red.inputs[0]
                self.add(Reduction(inputs=(src,), axis=red.axis, fn=red.fn, output=i, dtype=red.dtype))
            else:
                src = self.operand(var)
                if isinstance(self.nodes[src], LAYOUT_KINDS):
                    raise Unsupported(f"output {i} is an input passed through, not an epilogue value")
                if not self._same_tile(desc.shape):
                    raise Unsupported(f"output {i} of shape {desc.shape} is not the GEMM's M x N shape")
                self.add(AuxStore(inputs=(src,), output=i, dtype=desc.dtype))
            if not self._depends_on_acc(src):
                raise Unsupported(f"output {i} does not depend on the matmul")
        stores = [n for n in self.nodes if isinstance(n, AuxStore)]
        if not stores:
            raise Unsupported("no M x N output: reduction-only epilogues are not supported yet")
        live = self._live()
        index = {old: new for new, old in enumerate(live)}
        nodes = [_reindex(self.nodes[i], index) for i in live]
        return Partition(
            symbol=symbol,
            params=tuple(_desc(p, f"parameter {p.name}") for p in self.params),
            outputs=tuple(out_descs),
            batch_shape=tuple(self.batch_shape),
            gemm=self.gemm,
            epilogue=canonicalize(nodes),
            d_output=min(s.output for s in stores),
        )

    def _live(self) -> list[int]:
        live = set()
        stack = [i for i, n in enumerate(self.nodes) if isinstance(n, (AuxStore, Reduction))]
        while stack:
            i = stack.pop()
            if i not in live:
                live.add(i)
                stack.extend(self.nodes[i].inputs)
        return sorted(live)


def _reindex(node: Node, index: dict[int, int]) -> Node:
    from dataclasses import replace

    return replace(node, inputs=tuple(index[j] for j in node.inputs))


def _bindings(func: relax.Function):
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        raise Unsupported("partition body is not a sequence of bindings")
    pairs = []
    for block in body.blocks:
        for b in block.bindings:
            if not isinstance(b, relax.VarBinding):
                raise Unsupported("match_cast inside the partition")
            pairs.append((b.var, b.value))
    result = body.body
    tuples = {var: value for var, value in pairs if isinstance(value, relax.Tuple)}
    if isinstance(result, relax.Var) and result in tuples:  # gv = (a, b); return gv
        result = tuples[result]
        pairs = [(v, x) for v, x in pairs if not isinstance(x, relax.Tuple)]
    if isinstance(result, relax.Tuple):
        outputs = list(result.fields)
    else:
        outputs = [result]
    return pairs, outputs


def _unwrap(func: relax.Function) -> relax.Function:
    """The composite function inside an ``annotate_codegen`` wrapper (same parameter order)."""
    pairs, _ = _bindings(func)
    local = {var: value for var, value in pairs if isinstance(value, relax.Function)}
    calls = [value for _, value in pairs if isinstance(value, relax.Call)]
    if len(calls) == 1:
        inner = local.get(calls[0].op, calls[0].op)
        if isinstance(inner, relax.Function) and "Composite" in (inner.attrs or {}):
            args = list(calls[0].args)
            if len(args) == len(func.params) and all(a.same_as(p) for a, p in zip(args, func.params)):
                return inner
            raise Unsupported("codegen wrapper reorders the composite's parameters")
    return func


def from_bindings(params, bindings, outputs, symbol: str) -> Partition:
    """Analyse ``bindings`` [(var, value)] in dependency order over ``params``, yielding ``outputs``."""
    builder = _Builder(params=list(params))
    for var, value in bindings:
        builder.bind(var, value)
    return builder.finish(symbol, outputs)


def from_check_context(ctx) -> Partition:
    """Analyse what a ``FuseOpsByPattern`` check sees (``PatternCheckContext``).

    Outputs are the root of the match plus every matched variable used outside the match
    (FuseOpsByPattern turns those into extra outputs of the partition).
    """
    matched = dict(ctx.matched_bindings.items())
    order, seen = [], set()

    def visit(var):
        if var in seen:
            return
        seen.add(var)
        value = matched[var]
        for arg in getattr(value, "args", []):
            if isinstance(arg, relax.Var) and arg in matched:
                visit(arg)
        order.append(var)

    for var in matched:
        visit(var)
    params, outputs = [], []
    for var in order:
        for arg in getattr(matched[var], "args", []):
            if isinstance(arg, relax.Var) and arg not in matched and not any(arg.same_as(p) for p in params):
                params.append(arg)
    root = ctx.value_to_bound_var.get(ctx.matched_expr) if ctx.matched_expr in ctx.value_to_bound_var else None
    for var in order:
        users = ctx.var_usages.get(var, []) if var in ctx.var_usages else []
        if var.same_as(root) or any(u not in matched for u in users):
            outputs.append(var)
    if root is None and order:
        outputs.append(order[-1])
    return from_bindings(params, [(v, matched[v]) for v in order], outputs, "evt_check")


def from_function(func: relax.Function, symbol: str | None = None) -> Partition:
    """Analyse a partition function (see module docstring)."""
    if symbol is None:
        attrs = func.attrs or {}
        symbol = str(attrs["global_symbol"]) if "global_symbol" in attrs else "evt_kernel"
    inner = _unwrap(func)
    pairs, outputs = _bindings(inner)
    return from_bindings(inner.params, pairs, outputs, symbol)
