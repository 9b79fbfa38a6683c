"""Random epilogue DAGs: the numpy interpreter of the epilogue IR agrees with TVM's own lowering
(LegalizeOps + llvm) of the same Relax partition, before and after the passes; every DAG emits."""
from __future__ import annotations

import numpy as np
from tvm import relax

UNARY = ["negative", "exp", "log", "tanh", "erf", "sigmoid", "relu", "gelu", "gelu_tanh", "silu"]
BINARY = ["add", "subtract", "multiply", "divide", "maximum", "minimum"]
COMPARE = ["greater", "greater_equal", "less", "less_equal"]
CONNECTIVES = ["logical_and", "logical_or"]


def _op(name):
    if name in ("relu", "gelu", "gelu_tanh", "silu"):
        return getattr(relax.op.nn, name)
    return getattr(relax.op, name)


def random_partition(seed: int, dtype: str = "float32"):
    """A Relax function: one matmul plus a random elementwise/broadcast/reduction DAG.

    Returns (function, input arrays).  Values stay bounded: exp/log/div see squashed inputs.
    """
    rng = np.random.default_rng(seed)
    M, N, K = 16, 24, 8
    batch = (2,) if rng.random() < 0.3 else ()
    bb = relax.BlockBuilder()
    params, arrays = [], []

    def param(shape, dt=dtype, low=-1.0, high=1.0):
        var = relax.Var(f"p{len(params)}", relax.TensorType(shape, dt))
        params.append(var)
        arrays.append(rng.uniform(low, high, size=shape).astype(dt))
        return var

    x = param(batch + (M, K))
    w_nk = rng.random() < 0.5
    w = param((N, K) if w_nk else (K, N))

    def leaf():
        kind = rng.integers(0, 7)
        if kind == 0:
            return param(batch + (M, N))
        if kind == 1:  # column-major M x N: a transposed (N, M) input
            return ("T", param((N, M)))
        if kind == 2:
            return param((N,))
        if kind == 3:
            return param((M, 1))
        if kind == 4:
            return param((1, N))
        if kind == 5:
            return relax.const(float(rng.uniform(-2, 2)), dtype)
        return param((M, N))

    pending = [leaf() for _ in range(4)]
    with bb.function(f"rand{seed}", params):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(w, [1, 0])) if w_nk else w
            y = bb.emit(relax.op.matmul(x, wt))
            pool = [y]

            def operand():
                if rng.random() < 0.5 or not pending:
                    return pool[rng.integers(0, len(pool))]
                item = pending.pop()
                if isinstance(item, tuple):
                    return bb.emit(relax.op.permute_dims(item[1], [1, 0]))
                return item

            for _ in range(int(rng.integers(2, 8))):
                choice = rng.random()
                a = pool[rng.integers(0, len(pool))] if rng.random() < 0.7 else pool[-1]
                if choice < 0.35:
                    name = UNARY[rng.integers(0, len(UNARY))]
                    if name == "exp":
                        a = bb.emit(relax.op.tanh(a))
                    if name == "log":
                        a = bb.emit(relax.op.add(relax.op.sigmoid(a), relax.const(0.5, dtype)))
                    v = bb.emit(_op(name)(a))
                elif choice < 0.75:
                    name = BINARY[rng.integers(0, len(BINARY))]
                    b = operand()
                    if name == "divide":
                        b = bb.emit(relax.op.add(relax.op.sigmoid(b), relax.const(0.5, dtype)))
                    v = bb.emit(_op(name)(a, b) if rng.random() < 0.8 else _op(name)(b, a))
                elif choice < 0.85:
                    c = bb.emit(_op(COMPARE[rng.integers(0, len(COMPARE))])(a, operand()))
                    if rng.random() < 0.5:  # a clamp's mask: two comparisons joined
                        d = bb.emit(_op(COMPARE[rng.integers(0, len(COMPARE))])(a, operand()))
                        c = bb.emit(_op(CONNECTIVES[rng.integers(0, len(CONNECTIVES))])(c, d))
                    v = bb.emit(relax.op.where(c, a, operand()))
                elif choice < 0.9:
                    v = bb.emit(relax.op.astype(relax.op.astype(a, "float16"), dtype))
                else:
                    v = bb.emit(relax.op.multiply(a, a))
                v_shape = tuple(int(d) for d in v.ty.shape.values)
                if v_shape != batch + (M, N):  # a broadcast-only value: tie it back to the GEMM
                    v = bb.emit(relax.op.add(v, y))
                pool.append(v)
            outs = [pool[-1]]
            for extra in pool[1:-1]:
                if rng.random() < 0.25:
                    outs.append(extra)
            if rng.random() < 0.5:
                src = pool[rng.integers(0, len(pool))]
                rank = len(batch) + 2
                axis = [[rank - 2], [rank - 1], [rank - 2, rank - 1]][rng.integers(0, 3)]
                red = relax.op.sum if rng.random() < 0.6 else relax.op.max
                outs.append(bb.emit(red(src, axis=axis)))
            result = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(result)
    mod = bb.get()
    return mod[f"rand{seed}"], arrays


# ------------------------------------------------------------------------------------------ tests
import pytest  # noqa: E402
import tvm  # noqa: E402

from tvm_evt.codegen import Unsupported, emit, from_function, lower, reference  # noqa: E402

SEEDS = range(64)


@pytest.fixture(scope="module")
def compiled():
    """All random partitions in one module, legalized and built once for llvm."""
    funcs, arrays = {}, {}
    for seed in SEEDS:
        funcs[seed], arrays[seed] = random_partition(seed)
    mod = tvm.IRModule({f"rand{s}": f for s, f in funcs.items()})
    mod = relax.transform.LegalizeOps()(mod)
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    return funcs, arrays, relax.VirtualMachine(ex, tvm.cpu())


def _tvm_outputs(vm, name, arrays):
    result = vm[name](*[tvm.runtime.tensor(a) for a in arrays])
    return [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]


@pytest.mark.parametrize("seed", SEEDS)
def test_reference_matches_tvm(compiled, seed):
    funcs, arrays, vm = compiled
    expected = _tvm_outputs(vm, f"rand{seed}", arrays[seed])
    parsed = from_function(funcs[seed])
    lowered = lower(parsed)
    for stage, partition in (("parsed", parsed), ("lowered", lowered)):
        got = reference.evaluate(partition, arrays[seed])
        assert len(got) == len(expected)
        for i, (e, g) in enumerate(zip(expected, got)):
            np.testing.assert_allclose(
                g.astype(np.float64), e.astype(np.float64), rtol=1e-4, atol=1e-4,
                err_msg=f"seed {seed} output {i} ({stage})",
            )
    try:
        source = emit(lowered)
    except Unsupported as err:  # the only legal refusal for these shapes
        assert "tf32" in err.reason
    else:
        assert f"int __tvm_ffi_{parsed.symbol}(void*, TVMFFIAny const* args" in source
