"""Gradient rules of tvm_evt.relax_passes.training.gradient_rules against torch autograd.

Every case builds a one-op Relax function on random shapes and attributes, takes
loss = sum(op(inputs) * w) with a random weight w, differentiates it with
relax.transform.Gradient, compiles it for the project's llvm target (cpu_target), and compares
the loss and the gradients with torch autograd in float64. The random seed is printed with every
failure.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax, te, topi
from tvm.relax import op as R

import tvm_evt.relax_passes.training.gradient_rules as gradient_rules
from tvm_evt.relax_passes.lower.legalize_ops import LEGALIZE
from tvm_evt.training import cpu_target

RTOL = 1e-4


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy % (2**32)
    print(f"numpy seed: {seed}")  # shown by pytest with a failure
    return np.random.default_rng(seed)


def randn(rng, *shape, low=None):
    data = rng.standard_normal(shape)
    if low is not None:
        data = np.abs(data) + low
    return data.astype("float32")


def _rel_err(actual, expected):
    expected = np.asarray(expected, dtype="float64")
    actual = np.asarray(actual, dtype="float64")
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    denom = np.linalg.norm(expected)
    return np.linalg.norm(actual - expected) / (denom if denom > 0 else 1.0)


def check(rng, build, reference, *inputs, wrt=None, legalize=None, compare_loss=True):
    """Compare loss = sum(build(*vars) * w) and its gradients with torch autograd.

    build: relax vars -> relax tensor expr; reference: torch float64 tensors -> tensor;
    wrt: indices of the inputs to differentiate (default: the float ones).
    """
    if wrt is None:
        wrt = [i for i, a in enumerate(inputs) if a.dtype.kind == "f"]
    tensors = [
        torch.tensor(a, dtype=torch.float64 if a.dtype.kind == "f" else torch.int64, requires_grad=i in wrt)
        for i, a in enumerate(inputs)
    ]
    out = reference(*tensors)
    fdtype = next((str(a.dtype) for a in inputs if a.dtype.kind == "f"), "float32")
    weight = randn(rng, *out.shape).astype(fdtype)
    loss_ref = (out * torch.tensor(weight, dtype=torch.float64)).sum()
    grads_ref = torch.autograd.grad(loss_ref, [tensors[i] for i in wrt], allow_unused=True)

    params = [relax.Var(f"x{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(inputs)]
    w = relax.Var("w", relax.TensorType(weight.shape, fdtype))
    bb = relax.BlockBuilder()
    with bb.function("main", params + [w]):
        with bb.dataflow():
            y = bb.emit(build(*params))
            assert list(y.ty.shape) == list(out.shape), f"relax {y.ty.shape} vs torch {out.shape}"
            loss = bb.emit_output(bb.emit(R.sum(R.multiply(y, w))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main", require_grads=[params[i] for i in wrt])(bb.get())
    if legalize:
        mod = relax.transform.LegalizeOps(customize_legalize_map=legalize)(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(cpu_target())), tvm.cpu())
    loss_tvm, grads_tvm = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in inputs + (weight,)])

    where = f"(input shapes {[a.shape for a in inputs]})"
    if compare_loss:
        # relative to the summands: a loss that cancels to near 0 (conv1d, 2e-4 of its terms'
        # magnitude) carries float32 rounding of the terms, not of the result
        terms = float((out * torch.tensor(weight, dtype=torch.float64)).abs().sum())
        diff = abs(float(loss_tvm.numpy()) - float(loss_ref))
        assert diff <= RTOL * max(terms, 1e-30), f"loss {where}: {diff:.3g} against terms {terms:.3g}"
    for k, (got, ref) in enumerate(zip(grads_tvm, grads_ref)):
        ref = np.zeros(inputs[wrt[k]].shape) if ref is None else ref.numpy()
        err = _rel_err(got.numpy(), ref)
        assert err <= RTOL, f"grad of input {wrt[k]}: rel err {err:.2e} {where}"


def test_check_detects_a_wrong_gradient(rng):
    """The harness must fail on a reference with the same values but another gradient."""
    x = randn(rng, 3, 4)
    same_value_other_grad = lambda t: torch.sin(t.detach()) + 2.0 * (t - t.detach())  # noqa: E731
    with pytest.raises(AssertionError, match="grad of input 0"):
        check(rng, R.sin, same_value_other_grad, x)


##################### Elementwise #####################

UNARY = [
    ("erf", R.erf, torch.erf, None),
    ("rsqrt", R.rsqrt, torch.rsqrt, 0.2),
    ("square", R.square, torch.square, None),
    ("tan", R.tan, torch.tan, None),
    ("asin", R.asin, torch.asin, None),
    ("acos", R.acos, torch.acos, None),
    ("asinh", R.asinh, torch.asinh, None),
    ("acosh", R.acosh, torch.acosh, None),
    ("atanh", R.atanh, torch.atanh, None),
    ("sinh", R.sinh, torch.sinh, None),
    ("cosh", R.cosh, torch.cosh, None),
    ("gelu", R.nn.gelu, F.gelu, None),
    ("gelu_tanh", R.nn.gelu_tanh, lambda t: F.gelu(t, approximate="tanh"), None),
    ("log_softmax", lambda x: R.nn.log_softmax(x, -1), lambda t: F.log_softmax(t, -1), None),
    ("silu", R.nn.silu, F.silu, None),
]


@pytest.mark.parametrize("name,relax_fn,torch_fn,low", UNARY, ids=[u[0] for u in UNARY])
def test_unary(rng, name, relax_fn, torch_fn, low):
    shape = rng.integers(1, 6, size=rng.integers(1, 4))
    x = randn(rng, *shape, low=low)
    if name == "tan":
        x = np.clip(x, -1.2, 1.2)
    if name in ("asin", "acos", "atanh"):  # inside (-1, 1), away from the poles
        x = np.clip(x, -0.9, 0.9)
    if name == "acosh":  # above 1
        x = np.abs(x) + 1.1
    check(rng, relax_fn, torch_fn, x)


def test_relu_masks_with_its_output(rng):
    """torch's relu gradient (0 where x = 0, exact zeros included), and the backward reads the
    forward's output, not its input: the input then has the relu as its only reader."""
    x = randn(rng, 4, 6)
    x[rng.random(x.shape) < 0.25] = 0.0
    check(rng, R.nn.relu, F.relu, x)

    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType((4, 6), "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(R.sum(R.nn.relu(xv))))
        bb.emit_func_output(out)
    adjoint = relax.transform.Gradient("main")(bb.get())["main_adjoint"]
    bound = {b.var: b.value for block in adjoint.body.blocks for b in block.bindings}
    masks = [v.args[0] for v in bound.values()
             if isinstance(v, relax.Call) and v.op.name in ("relax.greater", "relax.less")]
    assert len(masks) == 1 and bound[masks[0]].op.name == "relax.nn.relu", masks


def test_leakyrelu_softplus_clip(rng):
    x = randn(rng, 4, 7) * 4
    alpha, beta, threshold = rng.uniform(0.01, 0.5), rng.uniform(0.5, 2), rng.uniform(1, 4)
    lo, hi = -rng.uniform(0.2, 2), rng.uniform(0.2, 2)
    check(rng, lambda v: R.nn.leakyrelu(v, alpha), lambda t: F.leaky_relu(t, alpha), x)
    check(rng, lambda v: R.nn.softplus(v, beta, threshold), lambda t: F.softplus(t, beta, threshold), x)
    check(rng, lambda v: R.clip(v, lo, hi), lambda t: torch.clamp(t, lo, hi), x)


def test_where_sums_broadcast_operands_down(rng):
    """where(cond, a, b) with a and b broadcast to the output (T5's position bias [1, H, q, k] under a
    [B, 1, 1, k] key mask): each operand's gradient has its own shape (TVM's rule gave the output's)."""
    cond = rng.integers(0, 2, (2, 1, 1, 5)).astype("bool")
    a, b = randn(rng, 1, 3, 4, 5), randn(rng, 2, 3, 1, 5)
    check(rng, lambda c, x, y: R.where(c, x, y), lambda c, x, y: torch.where(c.bool(), x, y), cond, a, b, wrt=[1, 2])


@pytest.mark.parametrize("op", ["remainder", "fmod", "atan2"])
def test_remainders_and_atan2(rng, op):
    """torch's ``remainder`` (``floor_mod``) and ``fmod`` (``mod``) of floats, the divisor broadcast;
    operands kept off the quotient's jumps, where the gradient is not defined."""
    a = randn(rng, 3, 4) * 3
    b = (randn(rng, 1, 4, low=0.5) * np.sign(randn(rng, 1, 4))).astype("float32")
    q = a / b
    a = np.where(np.abs(q - np.round(q)) < 0.05, a + 0.1 * b, a).astype("float32")
    relax_fn, torch_fn = {"remainder": (R.floor_mod, torch.remainder), "fmod": (R.mod, torch.fmod),
                          "atan2": (R.atan2, torch.atan2)}[op]
    check(rng, relax_fn, torch_fn, a, b)


def test_floor_division_takes_no_gradient(rng):
    a, b = randn(rng, 3, 4) * 3, randn(rng, 3, 4, low=0.5)
    check(rng, lambda x, y: R.add(R.floor_divide(x, y), x),
          lambda x, y: torch.div(x, y, rounding_mode="floor") + x, a, b)


##################### Reductions #####################


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("ties", [False, True])
def test_max_min(rng, kind, ties):
    shape = list(rng.integers(2, 6, size=3))
    x = (rng.integers(-2, 3, size=shape) if ties else rng.standard_normal(shape)).astype("float32")
    axis = sorted(rng.choice(3, size=rng.integers(1, 4), replace=False).tolist())
    if rng.random() < 0.3:
        axis = None
    keepdims = bool(rng.integers(2)) and axis is not None
    relax_fn = R.max if kind == "max" else R.min
    torch_fn = torch.amax if kind == "max" else torch.amin
    dims = tuple(range(3)) if axis is None else tuple(axis)
    check(rng, lambda v: relax_fn(v, axis, keepdims), lambda t: torch_fn(t, dims, keepdims), x)


def test_mean(rng):
    x = randn(rng, 3, 4, 5)
    axis = sorted(rng.choice(3, size=rng.integers(1, 3), replace=False).tolist())
    check(rng, lambda v: R.mean(v, axis, keepdims=False), lambda t: t.mean(axis), x)


##################### Normalization #####################


def test_layer_norm(rng):
    nnorm = int(rng.integers(1, 3))
    shape = [int(d) for d in rng.integers(3, 6, size=nnorm + int(rng.integers(1, 3)))]  # see batch_norm
    x, g, b = randn(rng, *shape), randn(rng, *shape[-nnorm:]), randn(rng, *shape[-nnorm:])
    axes = list(range(-nnorm, 0))
    check(
        rng,
        lambda v, gv, bv: R.nn.layer_norm(v, gv, bv, axes, 1e-5),
        lambda t, gt, bt: F.layer_norm(t, shape[-nnorm:], gt, bt, 1e-5),
        x, g, b,
    )


def test_rms_norm(rng):
    shape = [int(d) for d in rng.integers(2, 7, size=3)]
    x, w = randn(rng, *shape), randn(rng, shape[-1])
    check(
        rng,
        lambda v, wv: R.nn.rms_norm(v, wv, [-1], 1e-6),
        lambda t, wt: F.rms_norm(t, shape[-1:], wt, 1e-6),
        x, w,
    )


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm(rng, training):
    # >= 3 values per channel: with 2 the normalized output does not depend on x (dx == 0)
    shape = [int(rng.integers(3, 5))] + [int(d) for d in rng.integers(1, 5, size=int(rng.integers(1, 4)))]
    c = shape[1]
    x, g, b = randn(rng, *shape), randn(rng, c), randn(rng, c)
    mean, var = randn(rng, c), randn(rng, c, low=0.5)

    def build(v, gv, bv, mv, vv):
        return relax.TupleGetItem(R.nn.batch_norm(v, gv, bv, mv, vv, 1, 1e-5, training=training), 0)

    def reference(t, gt, bt, mt, vt):
        return F.batch_norm(t, mt.clone(), vt.clone(), gt, bt, training=training, eps=1e-5)

    check(rng, build, reference, x, g, b, mean, var, wrt=[0, 1, 2])


@pytest.mark.parametrize("ndim", [3, 4])
def test_group_norm(rng, ndim):
    """Groups of 4 elements or more: two normal draws are within 0.01 of each other one time in
    about 180, and such a group's variance (2e-5, against eps 1e-5) leaves float32 gradients 1e-4
    off (torch's own float32 4e-5 on seed 3288890057's, ours 1.75e-4)."""
    groups = int(rng.integers(1, 4))
    spatial = rng.integers(4 if ndim == 3 else 2, 6, size=ndim - 2)
    shape = [2, groups * int(rng.integers(1, 4))] + [int(d) for d in spatial]
    c = shape[1]
    x, g, b = randn(rng, *shape), randn(rng, c), randn(rng, c)
    axes = list(range(2, ndim))
    check(
        rng,
        lambda v, gv, bv: R.nn.group_norm(v, gv, bv, groups, 1, axes, 1e-5),
        lambda t, gt, bt: F.group_norm(t, groups, gt, bt, 1e-5),
        x, g, b,
        legalize=LEGALIZE,  # the pipeline's two-pass rule (TVM's E[x^2] - E[x]^2 misses on tight groups)
    )


@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_norms_without_scale_or_center_are_refused(op):
    """TVM's legalization applies gamma and beta whatever ``scale``/``center`` say: a gradient rule
    that honoured them would differentiate something else than what runs."""
    x = relax.Var("x", relax.TensorType((2, 4, 3), "float32"))
    g, b = (relax.Var(n, relax.TensorType((4,), "float32")) for n in "gb")
    make = (lambda: R.nn.group_norm(x, g, b, 2, 1, [2], 1e-5, center=False, scale=False)) if op == "group_norm" \
        else (lambda: R.nn.instance_norm(x, g, b, 1, [2], 1e-5, center=False, scale=False))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            loss = bb.emit_output(bb.emit(R.sum(make())))
        bb.emit_func_output(loss)
    with pytest.raises(Exception, match="scale=False or center=False"):
        relax.transform.Gradient("main", require_grads=[x, g, b])(bb.get())


@pytest.mark.parametrize("over_batch", [False, True])
def test_instance_norm(rng, over_batch):
    """Per instance (InstanceNorm), and over the batch too: a training-mode BatchNorm without running
    statistics, which TVM's importer writes as this op with axes (0, 2, ...)."""
    shape = [int(rng.integers(2, 4)), int(rng.integers(1, 5)), 3, int(rng.integers(2, 5))]
    c = shape[1]
    x, g, b = randn(rng, *shape), randn(rng, c), randn(rng, c)
    axes = ([0] if over_batch else []) + [2, 3]

    def reference(t, gt, bt):
        if over_batch:
            return F.batch_norm(t, None, None, gt, bt, training=True, eps=1e-5)
        return F.instance_norm(t, weight=gt, bias=bt, eps=1e-5)

    check(rng, lambda v, gv, bv: R.nn.instance_norm(v, gv, bv, 1, axes, 1e-5), reference, x, g, b, legalize=LEGALIZE)


def test_dropout(rng):
    """With a deterministic training lowering: out = x * mask / (1 - p), mask 0/1."""
    rate = float(rng.uniform(0.1, 0.6))
    x = randn(rng, 4, 9)
    mask = (np.add.outer(np.arange(4) * 7, np.arange(9) * 3) % 3 != 0).astype("float32")

    def training_dropout(bb, call):
        def fn(data):
            keep = te.compute(
                data.shape,
                lambda i, j: tvm.tirx.Select((i * 7 + j * 3) % 3 != 0, 1.0, 0.0).astype(data.dtype),
            )
            return [topi.multiply(data, keep) * (1.0 / (1.0 - rate)), keep]

        return bb.call_te(fn, call.args[0])

    check(
        rng,
        lambda v: relax.TupleGetItem(R.nn.dropout(v, rate), 0),
        lambda t: t * torch.tensor(mask, dtype=torch.float64) / (1 - rate),
        x,
        legalize={"relax.nn.dropout": training_dropout},
    )


##################### Attention #####################


def _attention_reference(q, k, v, bias, scale, causal):
    s, s_kv = q.shape[1], k.shape[1]
    scores = torch.einsum("bsnd,btnd->bnst", q, k) * scale
    if bias is not None:
        scores = scores + bias
    if causal is not None:
        offset = 0 if causal == "TopLeft" else abs(s - s_kv)
        keep = torch.tensor(np.tril(np.ones((s, s_kv), dtype=bool), k=offset))
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("bnst,btnd->bsnd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("causal", [None, "TopLeft", "BottomRight"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_attention(rng, causal, with_bias):
    b, s, n, d = (int(x) for x in rng.integers(1, 5, size=4))
    s_kv, d_v = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    if causal == "TopLeft":
        s_kv = max(s_kv, s)  # every query row keeps at least one key
    q, k, v = randn(rng, b, s, n, d), randn(rng, b, s_kv, n, d), randn(rng, b, s_kv, n, d_v)
    use_scale = bool(rng.integers(2))
    scale = float(rng.uniform(0.1, 1.0)) if use_scale else 1.0 / math.sqrt(d)
    relax_scale = tvm.tirx.FloatImm("float64", scale) if use_scale else None
    inputs = (q, k, v) + ((randn(rng, 1, n, s, s_kv),) if with_bias else ())
    # in float64: a softmax over one or two keys can cancel its gradient down to where float32
    # rounding alone exceeds RTOL (2.4e-4 seen on q's gradient with 2 keys)
    inputs = tuple(a.astype("float64") for a in inputs)

    def build(qv, kv, vv, bias=None):
        return R.nn.attention(qv, kv, vv, bias, relax_scale, causal)

    def reference(qt, kt, vt, bias=None):
        return _attention_reference(qt, kt, vt, bias, scale, causal)

    check(rng, build, reference, *inputs)


##################### Manipulation and indexing #####################


def test_squeeze_flatten_tile_repeat(rng):
    x = randn(rng, 3, 1, 4)
    check(rng, lambda v: R.squeeze(v, [1]), lambda t: t.squeeze(1), x)
    check(rng, R.flatten, lambda t: t.flatten(), x)
    reps = [int(r) for r in rng.integers(1, 4, size=rng.integers(1, 5))]
    check(rng, lambda v: R.tile(v, reps), lambda t: t.tile(reps), x)
    r, axis = int(rng.integers(1, 4)), int(rng.integers(-3, 3))
    check(rng, lambda v: R.repeat(v, r, axis), lambda t: t.repeat_interleave(r, axis), x)
    check(rng, lambda v: R.repeat(v, r), lambda t: t.repeat_interleave(r), x)


@pytest.mark.parametrize("upper", [False, True])
def test_tril_triu(rng, upper):
    x, k = randn(rng, 2, 5, 6), int(rng.integers(-2, 3))
    relax_fn, torch_fn = (R.triu, torch.triu) if upper else (R.tril, torch.tril)
    check(rng, lambda v: relax_fn(v, k), lambda t: torch_fn(t, k), x)


def test_pad(rng):
    x = randn(rng, 2, 3, 4)
    widths = [int(w) for w in rng.integers(0, 3, size=6)]
    torch_pad = [w for i in reversed(range(3)) for w in widths[2 * i : 2 * i + 2]]
    check(rng, lambda v: R.nn.pad(v, widths, "constant", 0.0), lambda t: F.pad(t, torch_pad), x)


def _random_slices(rng, shape):
    """Random non-empty python slices over random axes (negative begin/end, ends past the size)."""
    axes = sorted(rng.choice(len(shape), size=rng.integers(1, len(shape) + 1), replace=False).tolist())
    while True:
        slices = [slice(None)] * len(shape)
        for a in axes:
            b0, e0 = int(rng.integers(-shape[a], shape[a])), int(rng.integers(-shape[a], shape[a] + 3))
            slices[a] = slice(b0, e0, int(rng.integers(1, 4)))
        if 0 not in np.empty(shape)[tuple(slices)].shape:
            return axes, [slices[a] for a in axes], tuple(slices)


def test_strided_slice(rng):
    shape = [int(d) for d in rng.integers(3, 9, size=3)]
    axes, per_axis, slices = _random_slices(rng, shape)
    begin, end, strides = ([getattr(sl, f) for sl in per_axis] for f in ("start", "stop", "step"))
    x = randn(rng, *shape)
    check(rng, lambda v: R.strided_slice(v, axes, begin, end, strides), lambda t: t[slices], x)


def test_strided_slice_negative_stride(rng):
    x = randn(rng, 4, 7)
    check(rng, lambda v: R.strided_slice(v, [1], [5], [0], [-2]), lambda t: t.flip(1)[:, 1:7:2], x)


def test_gather_elements_topk(rng):
    x = randn(rng, 3, 6)
    idx = rng.integers(0, 6, size=(3, 8)).astype("int64")
    check(rng, lambda v, i: R.gather_elements(v, i, 1), lambda t, i: torch.gather(t, 1, i), x, idx)
    k = int(rng.integers(1, 6))
    check(
        rng,
        lambda v: relax.TupleGetItem(R.topk(v, k, -1, "both", True, "int64"), 0),
        lambda t: torch.topk(t, k, -1).values,
        x,
    )


@pytest.mark.parametrize("axis", [0, 1])
def test_take_repeated_indices(rng, axis):
    """Embedding-style take: indices repeat, so gradients must accumulate."""
    table = randn(rng, 4, 5)
    idx = rng.integers(0, table.shape[axis], size=(3, 6)).astype("int64")
    out_shape = (3, 6, 5) if axis == 0 else (4, 3, 6)

    def reference(t, i):
        return torch.index_select(t, axis, i.flatten()).reshape(out_shape)

    check(rng, lambda v, i: R.take(v, i, axis), reference, table, idx)
    check(rng, lambda v, i: R.take(v, i, axis), lambda t, i: torch.index_select(t, axis, i), table, idx[0])


##################### Convolution and pooling #####################


def test_conv1d(rng):
    groups = int(rng.choice([1, 2]))
    cin, cout = 2 * int(rng.integers(1, 3)), 2 * int(rng.integers(1, 3))
    kw, stride, dilation = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    pad = int(rng.integers(0, 3))
    x, w = randn(rng, 2, cin, int(rng.integers(8, 13))), randn(rng, cout, cin // groups, kw)
    check(
        rng,
        lambda v, wv: R.nn.conv1d(v, wv, stride, pad, dilation, groups),
        lambda t, wt: F.conv1d(t, wt, None, stride, pad, dilation, groups),
        x, w,
    )


def test_conv2d(rng):
    groups = int(rng.choice([1, 2]))
    cin, cout = 2 * int(rng.integers(1, 3)), 2 * int(rng.integers(1, 3))
    kh, stride, pad = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(0, 2))
    x, w = randn(rng, 2, cin, 7, 8), randn(rng, cout, cin // groups, kh, kh)
    check(
        rng,
        lambda v, wv: R.nn.conv2d(v, wv, stride, pad, 1, groups),
        lambda t, wt: F.conv2d(t, wt, None, stride, pad, 1, groups),
        x, w,
    )


@pytest.mark.parametrize("trial", range(3))
def test_conv2d_transpose(rng, trial):
    """``nn.ConvTranspose2d``: strides, padding, output padding, dilation and groups drawn."""
    groups = int(rng.choice([1, 2]))
    cin, cout = 2 * int(rng.integers(1, 3)), 2 * int(rng.integers(1, 3))
    kh, stride, pad, dilation = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(0, 2)), \
        int(rng.integers(1, 3))
    out_pad = int(rng.integers(0, stride))  # below the stride (or the dilation): torch's bound
    out_pad = min(out_pad, max(stride, dilation) - 1)
    x, w = randn(rng, 2, cin, 5, 6), randn(rng, cin, cout // groups, kh, kh)
    check(
        rng,
        lambda v, wv: R.nn.conv2d_transpose(v, wv, stride, pad, out_pad, dilation, groups),
        lambda t, wt: F.conv_transpose2d(t, wt, None, stride, pad, out_pad, groups, dilation),
        x, w,
    )


def test_flip(rng):
    x = randn(rng, 3, 4, 5)
    axis = int(rng.integers(-3, 3))
    check(rng, lambda v: R.flip(v, axis), lambda t: torch.flip(t, [axis]), x)


def test_slice_scatter(rng):
    """As a circular convolution's padding writes its wrapped borders."""
    x, src = randn(rng, 3, 8), randn(rng, 3, 3)
    start = int(rng.integers(0, 2))
    check(rng, lambda v, sv: R.slice_scatter(v, sv, start, start + 5, 2, axis=1),
          lambda t, st: torch.slice_scatter(t, st, 1, start, start + 5, 2), x, src)


def _pool_params(rng):
    k = int(rng.integers(2, 4))
    return dict(
        kernel=k,
        stride=int(rng.integers(1, 3)),
        pad=int(rng.integers(0, k // 2 + 1)),
        dilation=int(rng.integers(1, 3)),
        ceil=bool(rng.integers(2)),
        include_pad=bool(rng.integers(2)),
    )


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool(rng, ndim, ties):
    """Includes windows that do not tile the input (ceil_mode, trailing elements) and ties."""
    shape = [2, 3] + [int(d) for d in rng.integers(5, 10, size=ndim)]
    x = (rng.integers(-1, 2, size=shape) if ties else rng.standard_normal(shape)).astype("float32")
    p = _pool_params(rng)
    relax_fn, torch_fn = (R.nn.max_pool1d, F.max_pool1d) if ndim == 1 else (R.nn.max_pool2d, F.max_pool2d)
    args = (p["kernel"], p["stride"], p["pad"], p["dilation"])
    ceil = p["ceil"]
    check(rng, lambda v: relax_fn(v, *args, ceil_mode=ceil), lambda t: torch_fn(t, *args, ceil_mode=ceil), x)


def _calls(func) -> list[relax.Call]:
    found = []
    relax.analysis.post_order_visit(
        func.body, lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool_tiled_windows(rng, ndim, ties):
    """kernel = stride over an input the windows tile (adaptive max pooling after its take): one
    argmax a window, the gradient to its first maximum as torch routes it, ties included."""
    kernel = [5] if ndim == 1 else [2, 3]
    shape = [2, 3] + [k * int(o) for k, o in zip(kernel, rng.integers(2, 4, size=ndim))]
    x = (rng.integers(-1, 1, size=shape) if ties else rng.standard_normal(shape)).astype("float32")
    relax_fn, torch_fn = (R.nn.max_pool1d, F.max_pool1d) if ndim == 1 else (R.nn.max_pool2d, F.max_pool2d)
    check(rng, lambda v: relax_fn(v, kernel, kernel), lambda t: torch_fn(t, kernel, kernel), x)

    var = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [var]):
        with bb.dataflow():
            loss = bb.emit_output(bb.emit(R.sum(relax_fn(var, kernel, kernel))))
        bb.emit_func_output(loss)
    adjoint = relax.transform.Gradient("main")(bb.get())["main_adjoint"]
    ops = [c.op.name for c in _calls(adjoint)]
    assert ops.count("relax.argmax") == 1 and "relax.strided_slice" not in ops, ops


@pytest.mark.parametrize("ndim", [1, 2])
def test_avg_pool(rng, ndim):
    x = randn(rng, *([2, 3] + [int(d) for d in rng.integers(5, 10, size=ndim)]))
    p = _pool_params(rng)
    relax_fn, torch_fn = (R.nn.avg_pool1d, F.avg_pool1d) if ndim == 1 else (R.nn.avg_pool2d, F.avg_pool2d)
    args = (p["kernel"], p["stride"], p["pad"])
    flags = dict(ceil_mode=p["ceil"], count_include_pad=p["include_pad"])
    check(rng, lambda v: relax_fn(v, *args, **flags), lambda t: torch_fn(t, *args, **flags), x)


def test_adaptive_avg_pool(rng):
    x1 = randn(rng, 2, 3, int(rng.integers(3, 11)))
    o1 = int(rng.integers(1, 6))
    check(rng, lambda v: R.nn.adaptive_avg_pool1d(v, o1), lambda t: F.adaptive_avg_pool1d(t, o1), x1)
    x2 = randn(rng, 2, 2, int(rng.integers(3, 9)), int(rng.integers(3, 9)))
    o2 = (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
    check(rng, lambda v: R.nn.adaptive_avg_pool2d(v, o2), lambda t: F.adaptive_avg_pool2d(t, o2), x2)


def test_registered():
    for name in list(gradient_rules.GRADIENT_RULES) + list(gradient_rules.NO_GRAD_OPS):
        assert tvm.ir.Op.get(name).get_attr("FPrimalGradient") is not None, name


##################### Imported PyTorch models #####################


class _TransformerLM(torch.nn.Module):
    """GPT-2/BERT-style: embedding, causal attention, layer_norm, gelu, cross entropy."""

    def __init__(self, vocab=11, dim=8, heads=2):
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(6, dim)
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.heads = heads

    def forward(self, idx, target):
        b, t = idx.shape
        x = self.emb(idx) + self.pos(torch.arange(t))
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return F.cross_entropy((x @ self.emb.weight.T).flatten(0, 1), target.flatten())


class _ConvNet(torch.nn.Module):
    """ResNet-style: conv, batch_norm (training), max/avg/adaptive pooling."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4)
        self.c2, self.fc = torch.nn.Conv2d(4, 4, 3, stride=2, padding=1), torch.nn.Linear(4, 5)

    def forward(self, x, y):
        z = F.max_pool2d(F.relu(self.bn(self.c1(x))), 3, 2, 1)
        z = F.relu(self.c2(z) + F.avg_pool2d(z, 2))
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(z, 1).flatten(1)), y)


class _XMLCNN(torch.nn.Module):
    """XML-CNN-style: embedding, conv1d, max_pool1d, BCE; plus max/min/clamp/rsqrt reductions."""

    def __init__(self):
        super().__init__()
        self.emb, self.conv = torch.nn.Embedding(13, 6), torch.nn.Conv1d(6, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 3, 7)

    def forward(self, idx, y):
        h = F.max_pool1d(F.relu(self.conv(self.emb(idx).transpose(1, 2))), 3).flatten(1)
        logits = self.fc(h)
        extra = logits.max() - logits.min() + torch.rsqrt(h.clamp(0.1, 2.0) + 1).mean()
        return F.binary_cross_entropy_with_logits(logits, y) + 0.1 * extra


MODELS = {
    "transformer": lambda rng: (_TransformerLM(), rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))),
    "convnet": lambda rng: (_ConvNet(), randn(rng, 2, 3, 8, 8), rng.integers(0, 5, (2,))),
    "xmlcnn": lambda rng: (_XMLCNN(), rng.integers(0, 13, (2, 9)), rng.random((2, 7)).astype("float32")),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_imported_model(rng, name):
    """Parameter gradients of a torch model imported with from_exported_program."""
    from tvm.relax.frontend.torch import from_exported_program

    model, *inputs = MODELS[name](rng)
    torch.manual_seed(int(rng.integers(2**31)))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    inputs = [np.asarray(a, dtype="int64" if a.dtype.kind == "i" else "float32") for a in inputs]
    model.train()
    exported = torch.export.export(model, tuple(torch.from_numpy(a) for a in inputs))
    mod = from_exported_program(exported, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    params = mod["main"].params[len(inputs) :]
    param_values = mod["main"].attrs["params"]
    mod = relax.transform.Gradient("main", require_grads=list(params))(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(cpu_target())), tvm.cpu())
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in inputs], *param_values)

    reference = model.double()
    loss_ref = reference(*[torch.from_numpy(a.astype("float64") if a.dtype.kind == "f" else a) for a in inputs])
    loss_ref.backward()
    assert _rel_err(loss.numpy(), loss_ref.detach().numpy()) <= RTOL
    named = list(reference.named_parameters())
    assert len(named) == len(grads)
    for (pname, p), got in zip(named, grads):
        err = _rel_err(got.numpy(), p.grad.numpy())
        assert err <= RTOL, f"{name}: grad of {pname}: rel err {err:.2e}"


def test_unsupported_attribute_names_the_op():
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(R.nn.pad(x, [0, 0, 1, 1], "reflect"))
            loss = bb.emit_output(bb.emit(R.sum(y)))
        bb.emit_func_output(loss)
    with pytest.raises(Exception, match="gradient of relax.nn.pad: pad_mode 'reflect'"):
        relax.transform.Gradient("main")(bb.get())
