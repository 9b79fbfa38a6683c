"""GPU tier: every epilogue node kind, every main-loop layout and dtype, against torch float64.

Each case is written once, as a function of an ``ops`` namespace: `RelaxOps` turns it into the Relax
partition the codegen offloads, `TorchOps` into the float64 reference on the same inputs.  All
kernels are generated, built in parallel and linked into one library by a module fixture; each
test calls its kernel's FFI entry directly (DPS: inputs, then outputs) twice, each time with fresh
random inputs (seeded from the OS, the seed is in the failure message) and with every output
poisoned with NaN first, so an output the kernel does not write fails the comparison.

Tolerance: relative L2 error of each output ≤1e-2 for bf16/fp16 operands, ≤1e-3 for tf32.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
from tvm import relax

torch = pytest.importorskip("torch")

from tvm_evt.codegen.bench import load_library  # noqa: E402
from tvm_evt.codegen.frontend import GELU_BACKWARD_EXTERN, RELU_BACKWARD_EXTERN  # noqa: E402
from tvm_evt.codegen.relax_ext import build_kernels, generate_kernels  # noqa: E402
from tvm_evt.relax_passes.training import gradient_rules  # noqa: E402

M, N, K, BATCH = 256, 192, 128, 3
TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-3}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# operand shapes of the main loop, by layout: y = A·B with A stored (M, K) or (K, M), B (K, N) or (N, K)
#   NT: y = a @ bᵀ (forward x·Wᵀ)   NN: y = a @ b (dX = dY·W)   TN: y = aᵀ @ b (dW = dYᵀ·X)
LAYOUTS = {"NT": lambda m, n, k: ((m, k), (n, k)), "NN": lambda m, n, k: ((m, k), (k, n)),
           "TN": lambda m, n, k: ((k, m), (k, n))}
# extra inputs a case may name: row-major M×N aux, column-major aux (an N×M tensor, transposed),
# row broadcast (N), column broadcast (M, 1)
EXTRAS = {"c": lambda m, n: (m, n), "ct": lambda m, n: (n, m), "bias": lambda m, n: (n,), "col": lambda m, n: (m, 1)}


class RelaxOps:
    """The epilogue as Relax ops (emitted into the partition function)."""

    def __init__(self, bb: relax.BlockBuilder, dtype: str):
        self.bb, self.dtype = bb, dtype

    def _e(self, expr):
        return self.bb.emit(expr)

    def const(self, v):
        return relax.const(v, self.dtype)

    def T(self, x):
        axes = list(range(x.ty.ndim))
        axes[-2:] = axes[-1], axes[-2]
        return self._e(relax.op.permute_dims(x, axes))

    def cast(self, x, dtype):
        return self._e(relax.op.astype(x, dtype))

    def where(self, c, a, b):
        return self._e(relax.op.where(c, a, b))

    def sum(self, x, axis=None):
        return self._e(relax.op.sum(x, axis=axis))

    def max(self, x, axis=None):
        return self._e(relax.op.max(x, axis=axis))

    def relu_bwd(self, grad, x):
        return self._extern(RELU_BACKWARD_EXTERN, grad, x)

    def gelu_bwd(self, grad, x):
        return self._extern(GELU_BACKWARD_EXTERN, grad, x)

    def gelu_grad(self, x):  # gelu'(x) as the training graph's gradient rule spells it
        return self._rule(gradient_rules.gelu_grad, relax.op.nn.gelu, x)

    def gelu_tanh_grad(self, x):
        return self._rule(gradient_rules.gelu_tanh_grad, relax.op.nn.gelu_tanh, x)

    def _rule(self, rule, op, x):
        (grad,) = rule(None, op(x), self.const(1.0), None)
        return self._e(grad)

    def _extern(self, name, grad, x):
        return self._e(relax.call_pure_packed(name, grad, x, ty_args=grad.ty))

    def __getattr__(self, name):
        nn = ("relu", "gelu", "gelu_tanh", "silu")
        op = getattr(relax.op.nn if name in nn else relax.op, {"neg": "negative", "sub": "subtract", "mul": "multiply",
                                                                "div": "divide", "gt": "greater", "ge": "greater_equal",
                                                                "lt": "less", "le": "less_equal", "eq": "equal",
                                                                "ne": "not_equal"}.get(name, name))
        return lambda *args: self._e(op(*args))


class TorchOps:
    """The same epilogue in float64, each result rounded to its Relax dtype (the partition's meaning:
    a bf16 op yields bf16) so the comparison measures the kernel, not the dtype."""

    def __init__(self, dtype: str):
        self.dt = TORCH_DTYPES[dtype]

    def _round(self, x):
        return x.to(self.dt).double() if x.dtype == torch.float64 else x

    def const(self, v):
        return v

    def T(self, x):
        return x.transpose(-1, -2)

    def cast(self, x, dtype):
        return x.to(TORCH_DTYPES[dtype]).double()

    def where(self, c, a, b):
        return torch.where(c, a, b)

    def sum(self, x, axis=None):  # the kernel accumulates in float32: compare unrounded
        return x.sum() if axis is None else x.sum(dim=axis)

    def max(self, x, axis=None):
        return x.max() if axis is None else x.amax(dim=axis)

    def relu_bwd(self, grad, x):
        return self._round(grad * (x > 0))

    def gelu_bwd(self, grad, x):
        return self._round(torch.ops.aten.gelu_backward(grad, x))

    def gelu_grad(self, x):
        return self._round(torch.ops.aten.gelu_backward(torch.ones_like(x), x))

    def gelu_tanh_grad(self, x):
        return self._round(torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate="tanh"))

    def __getattr__(self, name):
        F = torch.nn.functional
        table = {"matmul": torch.matmul, "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
                 "minimum": torch.minimum, "neg": torch.neg, "exp": torch.exp, "log": torch.log, "tanh": torch.tanh,
                 "erf": torch.erf, "sigmoid": torch.sigmoid, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
                 "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gt": torch.gt, "ge": torch.ge,
                 "lt": torch.lt, "le": torch.le, "eq": torch.eq, "ne": torch.ne,
                 "logical_and": torch.logical_and, "logical_or": torch.logical_or}
        fn = table[name]
        return lambda *args: self._round(fn(*args))


@dataclass(frozen=True)
class Case:
    name: str
    body: Callable  # (ops, y, **extras) -> list of outputs
    dtype: str = "bfloat16"
    layout: str = "NT"
    batched: bool = False
    extras: tuple = field(default=())
    mnk: tuple = (M, N, K)
    config: tuple = ()  # explicit kernel options as (key, value) pairs; else the shape heuristic's

    @property
    def symbol(self) -> str:
        shape = "" if self.mnk == (M, N, K) else "_" + "x".join(map(str, self.mnk))
        return f"evt_gpu_kinds_{self.name}_{self.dtype}_{self.layout}" + ("_batched" if self.batched else "") + shape

    def shapes(self) -> list[tuple]:
        a, b = LAYOUTS[self.layout](*self.mnk)
        if self.batched:
            a, b = (BATCH,) + a, (BATCH,) + b
        return [a, b] + [EXTRAS[e](*self.mnk[:2]) for e in self.extras]

    def main_loop(self, ops, a, b):
        if self.layout == "TN":
            a = ops.T(a)
        if self.layout == "NT":
            b = ops.T(b)
        return ops.matmul(a, b)

    def relax_function(self) -> relax.Function:
        bb = relax.BlockBuilder()
        params = [relax.Var(n, relax.TensorType(s, self.dtype)) for n, s in zip(["a", "b", *self.extras], self.shapes())]
        with bb.function(self.symbol, params):
            with bb.dataflow():
                ops = RelaxOps(bb, self.dtype)
                y = self.main_loop(ops, params[0], params[1])
                outs = self.body(ops, y, **dict(zip(self.extras, params[2:])))
                result = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
            bb.emit_func_output(result)
        return bb.get()[self.symbol].with_attr("global_symbol", self.symbol)

    def reference(self, inputs) -> list:
        ops = TorchOps(self.dtype)
        x = [t.double() for t in inputs]
        return self.body(ops, self.main_loop(ops, x[0], x[1]), **dict(zip(self.extras, x[2:])))


def _layouts(ops, y):
    return [y]


def _aux_loads(ops, y, c, ct):
    return [ops.add(y, c), ops.mul(y, ops.T(ct))]


def _broadcasts(ops, y, bias, col):
    return [ops.add(ops.add(y, bias), ops.mul(y, col)), ops.sub(y, ops.const(0.5))]


def _arith(ops, y, c):
    denominator = ops.add(ops.sigmoid(c), ops.const(0.5))
    return [ops.sub(y, c), ops.div(y, denominator), ops.maximum(y, c), ops.minimum(y, c)]


def _unary(ops, y):
    return [ops.neg(y), ops.exp(ops.tanh(y)), ops.log(ops.add(ops.sigmoid(y), ops.const(0.5))), ops.erf(y)]


def _activations(ops, y):
    return [ops.sigmoid(y), ops.relu(y), ops.silu(y), ops.gelu(y), ops.gelu_tanh(y)]


def _activation_grads(ops, y):  # FoldActivationGradient's nodes, next to the activations they share a term with
    return [ops.gelu(y), ops.gelu_grad(y), ops.gelu_tanh(y), ops.gelu_tanh_grad(y)]


def _backward(ops, y, c):
    return [ops.relu_bwd(y, c), ops.gelu_bwd(y, c)]


def _select(ops, y, c):
    r = ops.relu(y)
    return [ops.where(ops.gt(y, c), y, c), ops.where(ops.ge(y, c), c, y), ops.where(ops.lt(y, ops.const(0.25)), y, c),
            ops.add(ops.where(ops.le(c, y), y, c), ops.where(ops.eq(r, ops.const(0.0)), c, y)),
            ops.where(ops.ne(r, ops.const(0.0)), y, c)]


def _connectives(ops, y, c):  # ReLU6's gradient mask (two comparisons of one tensor joined), and its complement
    inside = ops.logical_and(ops.gt(c, ops.const(-0.5)), ops.lt(c, ops.const(0.5)))
    outside = ops.logical_or(ops.le(y, ops.const(-0.25)), ops.ge(y, ops.const(0.75)))
    return [ops.where(inside, y, ops.const(0.0)), ops.where(outside, c, y)]


def _casts(ops, y, bias):
    h = ops.add(y, bias)
    return [ops.cast(h, "float32"), ops.cast(ops.cast(ops.gelu(h), "float16"), "bfloat16")]


def _sums(ops, y, bias):
    g = ops.gelu(ops.add(y, bias))
    return [g, ops.sum(g, [0]), ops.sum(y, [1]), ops.sum(ops.cast(g, "float32"))]  # scalar: atomic, float32


def _maxes(ops, y):
    return [y, ops.max(y, [0]), ops.max(y, [1]), ops.max(ops.cast(y, "float32"))]


CASES = (
    [Case("plain", _layouts, dtype, layout) for dtype in ("bfloat16", "float16") for layout in LAYOUTS]
    + [Case("plain", _layouts, "float32", "NT")]  # tf32: K-major A and B only (others fall back to TVM)
    + [Case("plain", _layouts, "bfloat16", layout, batched=True) for layout in ("NT", "NN")]
    + [Case("aux_loads", _aux_loads, extras=("c", "ct")),
       Case("broadcasts", _broadcasts, extras=("bias", "col")),
       Case("arith", _arith, extras=("c",)),
       Case("unary", _unary),
       Case("unary", _unary, dtype="float16", layout="NN"),
       Case("activations", _activations, layout="TN"),
       Case("activation_grads", _activation_grads, layout="NT"),
       Case("backward", _backward, layout="NN", extras=("c",)),
       Case("select", _select, extras=("c",)),
       Case("connectives", _connectives, layout="NN", extras=("c",)),
       Case("casts", _casts, extras=("bias",)),
       Case("sums", _sums, extras=("bias",)),
       Case("sums", _sums, dtype="float16", layout="TN", extras=("bias",)),
       Case("maxes", _maxes, layout="NN"),
       Case("arith", _arith, dtype="float32", extras=("c",)),
       Case("sums", _sums, dtype="float32", extras=("bias",))]
    # tiles fitted to a narrow N and a K of at most 32 (``select.narrow_configs``: MobileNet's first
    # stages), with partial tiles in M (2112 rows) and in K (16, 24 under a 32-deep K tile)
    + [Case("narrow", _layouts, mnk=(2112, 96, 16), config=(("tile", (256, 96, 32)),)),
       Case("narrow", _connectives, layout="NN", extras=("c",), mnk=(2112, 48, 24),
            config=(("tile", (128, 48, 32)),)),
       Case("narrow", _backward, layout="NN", extras=("c",), mnk=(2112, 32, 16),
            config=(("tile", (128, 32, 32)), ("schedule", "pingpong"))),
       Case("narrow", _layouts, layout="NN", mnk=(2112, 16, 96), config=(("tile", (256, 16, 64)),)),
       Case("narrow", _casts, extras=("bias",), mnk=(2112, 144, 24), config=(("tile", (256, 128, 32)),))]
)


@pytest.fixture(scope="module")
def kernels(request):
    """symbol -> (lowered partition, FFI function): the cases this session runs (``-k`` narrows
    them; each nvcc build takes tens of seconds) generated, built in parallel, linked once."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the evt kernels need an SM90 GPU")
    selected = {item.callspec.params["case"].symbol for item in request.session.items
                if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    generated = {}
    for case in CASES:
        if case.symbol in selected:
            generated.update(generate_kernels([case.relax_function()], dict(case.config)))
    library = load_library(build_kernels(generated))
    return {symbol: (generated[symbol][0], library[symbol]) for symbol in generated}


def _inputs(case: Case, gen: torch.Generator) -> list:
    dt = TORCH_DTYPES[case.dtype]
    out = []
    for i, shape in enumerate(case.shapes()):
        scale = case.mnk[2] ** -0.5 if i == 1 else 1.0  # y = O(1)
        out.append((torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(dt))
    return out


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.symbol.removeprefix("evt_gpu_kinds_"))
def test_kernel_matches_float64_torch(kernels, case):
    partition, fn = kernels[case.symbol]
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    outputs = [torch.empty(d.shape, dtype=TORCH_DTYPES[d.dtype], device="cuda") for d in partition.outputs]
    for run in range(2):  # fresh inputs each run; outputs poisoned before each
        inputs = _inputs(case, gen)
        for o in outputs:
            o.fill_(float("nan"))
        fn(*inputs, *outputs)
        torch.cuda.synchronize()
        refs = case.reference(inputs)
        assert len(refs) == len(outputs)
        for i, (got, want) in enumerate(zip(outputs, refs)):
            assert tuple(got.shape) == tuple(want.shape), f"output {i}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
            err = _rel_err(got, want)
            assert err <= TOLERANCE[case.dtype], (
                f"{case.symbol} output {i} run {run}: relative L2 error {err:.3g} > {TOLERANCE[case.dtype]} "
                f"(input seed {seed})")


def test_every_case_emits():
    """CPU tier: every GPU case is one the codegen takes (emits a kernel source with its FFI entry)."""
    generated = {}
    for case in CASES:
        generated.update(generate_kernels([case.relax_function()], dict(case.config)))
        partition, config, source = generated[case.symbol]
        assert tuple(config.tile) == dict(case.config).get("tile", config.tile)  # as asked, not refitted
        assert (partition.gemm.m, partition.gemm.n, partition.gemm.k) == case.mnk
    assert sorted(generated) == sorted(case.symbol for case in CASES)
    for symbol, (_, _, source) in generated.items():
        assert f"__tvm_ffi_{symbol}" in source


def test_every_node_kind_is_exercised():
    """CPU tier: the cases cover every OpKind, node kind and reduction of the epilogue IR."""
    from tvm_evt.codegen import from_function, lower
    from tvm_evt.codegen.ir import nodes
    from tvm_evt.codegen.ir.ops import OpKind, ReduceAxis, ReduceFn

    seen_ops, seen_nodes, seen_reductions = set(), set(), set()
    for case in CASES:
        partition = lower(from_function(case.relax_function()))
        for node in partition.epilogue.nodes:
            seen_nodes.add(type(node).__name__)
            if isinstance(node, nodes.Compute):
                seen_ops.add(node.op)
            if isinstance(node, nodes.Reduction):
                seen_reductions.add((node.axis, node.fn))
    missing = set(OpKind) - seen_ops
    assert not missing, f"no GPU case exercises {sorted(k.name for k in missing)}"
    wanted = {"AccFetch", "AuxLoad", "RowBroadcast", "ColBroadcast", "ScalarBroadcast", "AuxStore", "Reduction"}
    assert wanted <= seen_nodes, f"no GPU case has a {sorted(wanted - seen_nodes)} node"  # Dropout: test_codegen_gpu.py
    assert len(seen_reductions) == len(ReduceAxis) * len(ReduceFn), seen_reductions
