import re
import shutil

import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm.support import nvcc

from _te_kernels import CUDA, assert_matches_llvm_on_gpu, schedule, serial

from tvm_evt.relax_passes.lower.vectorized_elementwise import VectorizedElementwise


def _kernels():
    """name -> (te tensors, expected lanes; 0: declined)."""
    x = te.placeholder((32, 256), "bfloat16", name="x")
    xf = te.placeholder((32, 256), "float32", name="xf")
    m = te.placeholder((32, 256), "bool", name="m")
    v = te.placeholder((256,), "float32", name="v")
    odd = te.placeholder((32, 197), "bfloat16", name="odd")
    nchw = te.placeholder((4, 16, 392), "bfloat16", name="nchw")
    s = te.placeholder((16,), "bfloat16", name="s")
    dq, dk, dv = (te.placeholder((2, 16, 4, 64), "bfloat16", name=n) for n in ("dq", "dk", "dv"))
    a3 = te.placeholder((32, 3), "bfloat16", name="a3")
    xt = te.placeholder((256, 32), "bfloat16", name="xt")
    lab = te.placeholder((32, 1), "int64", name="lab")
    g = te.placeholder((2, 4, 16, 128), "bfloat16", name="g")
    sin = te.placeholder((16, 128), "bfloat16", name="sin")
    stat = te.placeholder((32, 1), "float32", name="stat")
    xb = te.placeholder((32, 256), "bfloat16", name="xb")
    return {
        # a cross-entropy gradient's one-hot: the class index compared with the row's int64 label,
        # a float32 row statistic; staged, and neither per-row value narrows the bf16 vectors
        "one_hot": ([x, lab, stat, te.compute((32, 256), lambda i, j: tirx.Select(
            j.astype("int64") == lab[i, 0], (x[i, j].astype("float32") - stat[i, 0]).astype("bfloat16"),
            tirx.const(0, "bfloat16")), name="y")], 8),
        # a 7x7/2 convolution's im2col rows on 3 float32 channels (a stem), cast to bf16: the input
        # gathered under the padding guard element by element, the rows stored as 8-lane vectors
        "stem_gather": _stem_gather(),
        # staged by its mask, with a transposed read outside any guard: declined (the transpose rule's)
        "mask_transpose": ([xt, m, te.compute((32, 256), lambda i, j: tirx.Select(
            m[i, j], xt[j, i], tirx.const(0, "bfloat16")), name="y")], 0),
        # attention head split: [B*S, H*d] -> [B, H, S, d], innermost d stays contiguous
        "heads": ([x, te.compute((2, 4, 16, 64), lambda b, h, s, d: x[b * 16 + s, h * 64 + d], name="y")], 8),
        # bf16 -> fp32 cast times a row vector: the widest type (fp32) sets 4 lanes
        "cast_bcast": ([x, v, te.compute((32, 256), lambda i, j: x[i, j].astype("float32") * v[j], name="y")], 4),
        # NCHW batch norm: a per-channel scalar along the whole vector (a broadcast, not a gather)
        "channel_bcast": ([nchw, s, te.compute((4, 16, 392), lambda n, c, i: nchw[n, c, i] / s[c], name="y")], 8),
        "fp32_add": ([xf, te.compute((32, 256), lambda i, j: xf[i, j] + tirx.const(1.0, "float32"), name="y")], 4),
        # staged (no boolxN type in TVM's CUDA codegen): a bool mask read along the vector
        "mask": ([x, m, te.compute((32, 256), lambda i, j: tirx.Select(m[i, j], x[i, j], tirx.const(0, "bfloat16")),
                                   name="y")], 8),
        # staged: a comparison along the vector (ReLU's backward), x read twice at one place
        "relu_bwd": ([x, te.compute((32, 256), lambda i, j: tirx.Select(x[i, j] > tirx.const(0, "bfloat16"), x[i, j],
                                                                           tirx.const(0, "bfloat16")), name="y")], 8),
        # staged: a select on the row alone between values along the vector (a slice scatter, circular
        # padding's gradient); vectorized, its condition would be a broadcast boolx8
        "row_select": ([x, xb, te.compute((32, 256), lambda i, j: tirx.Select(
            tirx.all(1 <= i, i < 31), x[tirx.max(i - 1, 0), j], xb[i, j]), name="y")], 8),
        # staged, with x under a padding guard (read element by element) and the mask's fp32 scale
        # as the widest type (4 lanes)
        "mask_pad": ([x, m, xf, te.compute(
            (32, 256), lambda i, j: tirx.Select(m[i, j], xf[i, j], tirx.const(0, "float32")) + tirx.if_then_else(
                i > 0, x[i - 1, j], tirx.const(0, "bfloat16")).astype("float32"), name="y")], 4),
        # attention's dQ, dK, dV ([B, S, H, d]) as one [B, S, 3 H d] (a fused QKV projection's
        # gradient): reshapes read as x[b, s, i // 64, i % 64], guards at multiples of 8 pick the input
        "concat": ([dq, dk, dv, te.compute((2, 16, 768), lambda b, t, i: tirx.if_then_else(
            i >= 512, dv[b, t, (i - 512) // 64, (i - 512) % 64], tirx.if_then_else(
                i >= 256, dk[b, t, (i - 256) // 64, (i - 256) % 64], dq[b, t, i // 64, i % 64])), name="y")], 8),
        # rotary embeddings' gradient through rotate_half (Llama's q and k), written to [B, S, H, D]:
        # each half of the head reads the other half under a range guard (pad of a strided slice)
        "rotary_bwd": ([g, sin, te.compute((2, 16, 4, 128), lambda b, t, h, d: tirx.if_then_else(
            tirx.all(64 <= d, d < 128), g[b, h, t, d - 64] * sin[t, d - 64] * tirx.const(-1, "bfloat16"),
            tirx.const(0, "bfloat16")) + tirx.if_then_else(
            tirx.all(0 <= d, d < 64), g[b, h, t, d + 64] * sin[t, d + 64], tirx.const(0, "bfloat16")), name="y")], 8),
        # a guard at 3: no vector holds one input only, and the second input's reads are misaligned
        "concat_at_3": ([a3, x, te.compute((32, 259), lambda i, j: tirx.if_then_else(
            j >= 3, x[i, j - 3], a3[i, j]), name="y")], 0),
        # a transpose that moves the innermost axis
        "transpose": ([x, te.compute((256, 32), lambda i, j: x[j, i], name="y")], 0),
        # a shifted window: vectors would start misaligned
        "shift": ([x, te.compute((32, 248), lambda i, j: x[i, j + 3], name="y")], 0),
        # an odd row length: only 1 lane divides it
        "odd": ([odd, te.compute((32, 197), lambda i, j: odd[i, j] * tirx.const(2, "bfloat16"), name="y")], 0),
    }


def _stem_gather(n=2, size=32, c=3, k=7, stride=2, pad=3):
    """(tensors, lanes): `conv_op.gather_windows`'s kernel with the input's cast fused in."""
    out = (size + 2 * pad - k) // stride + 1
    taps = k * k * c
    width = -(-taps // 8) * 8
    x = te.placeholder((n, size, size, c), "float32", name="x")

    def element(row, col):
        img, pix = row // (out * out), row % (out * out)
        i = pix // out * stride - pad + col // (k * c)
        j = pix % out * stride - pad + col // c % k
        inside = tirx.all(col < taps, i >= 0, i < size, j >= 0, j < size)
        return tirx.if_then_else(inside, x[img, i, j, col % c].astype("bfloat16"), tirx.const(0, "bfloat16"))

    return [x, te.compute((tirx.IntImm("int64", n * out * out), tirx.IntImm("int64", width)), element, name="y")], 8


def _schedule(tensors):
    return schedule(tensors, VectorizedElementwise())


def test_a_guarded_gather_is_staged_with_vector_stores():
    """The stem's im2col rows: the float32 input is read element by element under its guard (not
    staged into registers, not a vector), each thread computes 8 columns in an unrolled loop and
    stores them as one 16-byte vector; the schedule computes what the kernel computes (its thread
    loops run serially on llvm)."""
    import numpy as np

    tensors, _ = _kernels()["stem_gather"]
    scheduled = _schedule(tensors)["main"]
    script = scheduled.script()
    assert "T.unroll(T.int64(8))" in script and "y_local" in script and "x_local" not in script
    x = np.random.default_rng(0).standard_normal([int(d) for d in tensors[0].shape]).astype("float32")
    outs = []
    for f in (te.create_prim_func(tensors), serial(scheduled)):
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")
        y = tvm.runtime.empty([int(d) for d in tensors[1].shape], "bfloat16")
        lib["main"](tvm.runtime.tensor(x), y)
        outs.append(y.numpy().view("uint16"))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert (outs[0] != 0).any() and (outs[0][:, 147:] == 0).all()  # the padding columns are zero


@pytest.mark.parametrize("name", list(_kernels()))
def test_takes_contiguous_injective_kernels_and_declines_the_rest(name):
    tensors, lanes = _kernels()[name]
    out = _schedule(tensors)["main"]
    scheduled = bool(out.attrs) and "tirx.is_scheduled" in out.attrs
    assert scheduled == bool(lanes)
    if lanes:
        script = re.sub(r"T\.int64\((\d+)\)", r"\1", out.script())
        assert f"T.vectorized({lanes})" in script


STAGED = {"mask": ("x", "m"), "relu_bwd": ("x", None), "mask_pad": ("xf", "x"),
          "row_select": ("xb", None)}  # (a vector load, a scalar one)


@pytest.mark.parametrize("name", list(STAGED))
def test_bool_kernels_are_staged_through_registers(name):
    """Bool data along the vector: vector loads into registers and a vector store around an
    unrolled scalar loop; bool buffers and guarded reads stay element loads."""
    tensors, lanes = _kernels()[name]
    script = _schedule(tensors)["main"].script()
    vector, scalar = STAGED[name]
    assert f"T.unroll({lanes})" in script.replace("T.int64(", "(")
    assert f"{vector}_local" in script and "y_local" in script
    if scalar:
        assert f"{scalar}_local" not in script


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("name", [*STAGED, "stem_gather", "one_hot"])
def test_staged_bool_kernels_compile_with_nvcc(name):
    """A vectorized compare did not build ('Cannot convert type T.boolx8 to CUDA type', ResNet's
    ReLU backward in NHWC); the staged form does, with 16-byte accesses for the non-bool data."""
    tensors, _ = _kernels()[name]
    src = tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert "uint4" in src or "float4" in src
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_concatenation_picks_its_input_once_a_vector():
    """Guards at multiples of the lanes hold for a whole vector: one guard a vector and 16-byte
    loads in its branches (before, the guards made the kernel one element a thread, 1.1 TB/s for
    GPT-2's dQKV on H100), not a guard and a 2-byte load per lane."""
    tensors, _ = _kernels()["concat"]
    script = _schedule(tensors)["main"].script()
    assert "T.unroll" not in script and "y_local" not in script  # not staged
    src = tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert src.count("*(uint4*)(") == 4  # three loads, one per input, and the store
    assert "condval_2" not in src  # two guards (three inputs), not two per lane
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_a_range_guard_picks_its_half_once_a_vector():
    """rotate_half's gradient: guards ``64 <= d and d < 128`` hold for a whole vector of 8 (their
    bounds are multiples of it), so each half is read as 16-byte vectors under one guard a vector
    (it was staged: each guarded element read alone, Llama's q gradient at 1.5 TB/s on an H200,
    ``docs/bench/h200-2026-11-30f/``); the schedule computes what the kernel computes."""
    tensors, _ = _kernels()["rotary_bwd"]
    scheduled = _schedule(tensors)["main"]
    assert "T.unroll" not in scheduled.script() and "y_local" not in scheduled.script()  # not staged
    src = tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert src.count("*(uint4*)(") == 5  # g and sin in each of two branches, and the store
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in t.shape]).astype("float32") for t in tensors[:2]]
    outs = []
    for f in (te.create_prim_func(tensors), serial(scheduled)):
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")
        y = tvm.runtime.empty([int(d) for d in tensors[2].shape], "bfloat16")
        lib["main"](*[_bf16(a) for a in args], y)
        outs.append(y.numpy().view("uint16"))
    np.testing.assert_array_equal(outs[1], outs[0])
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


def _bf16(a):
    import ml_dtypes

    return tvm.runtime.tensor(a.astype(ml_dtypes.bfloat16))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_vectorized_kernels_build_with_16_byte_accesses():
    tensors, _ = _kernels()["heads"]
    src = tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert "uint4" in src  # 8 bf16 lanes as one 16-byte access


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("name", ["heads", "cast_bcast", "channel_bcast"])
def test_vectorized_kernels_compile_with_nvcc(name):
    """tvm.compile only emits CUDA source here (it is compiled when loaded on a GPU), so compile it.
    ResNet-50's NCHW batch norm failed on H100 with NVRTC "too many arguments in function call":
    the per-channel operand was gathered by an int32x8 index made with an 8-argument make_longlong4."""
    tensors, _ = _kernels()[name]
    src = tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    with tvm.target.Target(CUDA):  # nvcc -gencode arch=compute_90a,code=sm_90a
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["heads", "cast_bcast", "channel_bcast", "fp32_add", "concat", "rotary_bwd", *STAGED,
                                  "stem_gather", "one_hot"])
def test_vectorized_kernels_on_gpu_match_llvm(name):
    tensors, _ = _kernels()[name]
    assert_matches_llvm_on_gpu(_schedule(tensors), tensors)


def test_a_select_on_the_row_alone_computes_what_the_kernel_does():
    """Staged, the row select (a slice scatter's) keeps its meaning: its thread loops run serially
    on llvm and equal the unscheduled kernel bit for bit."""
    tensors, _ = _kernels()["row_select"]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((32, 256)) for _ in range(2)]
    outs = []
    for f in (te.create_prim_func(tensors), serial(_schedule(tensors)["main"])):
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")
        y = tvm.runtime.empty((32, 256), "bfloat16")
        lib["main"](*(_bf16(a) for a in inputs), y)
        outs.append(y.numpy().view("uint16"))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert (outs[0][0] == _bf16(inputs[1]).numpy()[0].view("uint16")).all()  # row 0 from the second input
