"""GPU numerics of offloaded partitions (skipped without CUDA; needs an SM90 GPU and nvcc).

Reference: torch float64 on the same inputs, and the numpy interpreter of the epilogue IR.
"""
import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.codegen import from_function, lower, reference
from tvm_evt.codegen.frontend import DROPOUT_EXTERN
from tvm_evt.codegen.relax_ext import register

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def offload(func: relax.Function, name: str, config: dict | None = None) -> relax.VirtualMachine:
    """main(params) calls ``func`` marked Codegen="evt"; RunCodegen (with a kernel ``config``, as
    ``KernelConfig.to_json`` writes it) + build for CUDA."""
    register()
    func = func.with_attrs({"Codegen": "evt", "global_symbol": name})
    bb = relax.BlockBuilder()
    gv = bb.add_func(func, name)  # a GlobalVar that carries the function's type
    params = [relax.Var(p.name, p.ty) for p in func.params]
    with bb.function("main", params):
        out = bb.emit(relax.Call(gv, params))
        bb.emit_func_output(out)
    mod = bb.get()
    mod = relax.transform.RunCodegen({"evt": config} if config else None)(mod)
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    return relax.VirtualMachine(ex, tvm.cuda(0))


def run(vm, arrays):
    dev = tvm.cuda(0)
    result = vm["main"](*[tvm.runtime.tensor(a, dev) for a in arrays])
    return [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]


def bias_gelu_func(m=512, n=256, k=128, dtype="float16", column_sum=True):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    w = relax.Var("w", relax.TensorType((n, k), dtype))
    b = relax.Var("b", relax.TensorType((n,), dtype))
    with bb.function("f", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
            g = bb.emit(relax.op.nn.gelu(relax.op.add(y, b)))
            outs = [g, y, bb.emit(relax.op.sum(g, axis=[0]))] if column_sum else [g, y]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()["f"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bias_gelu_rowsum_vs_torch_float64(dtype):
    func = bias_gelu_func(dtype=dtype)
    rng = np.random.default_rng(0)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    x, w, b = (torch.tensor(rng.uniform(-1, 1, s), dtype=tdt) for s in ((512, 128), (256, 128), (256,)))
    arrays = [t.float().numpy().astype(reference.NP_DTYPES[dtype]) for t in (x, w, b)]  # exact
    g, y, s = run(offload(func, f"evt_gpu_bias_gelu_{dtype}"), arrays)
    y64 = x.double() @ w.double().T
    g64 = torch.nn.functional.gelu(y64 + b.double())
    tol = 2e-2 if dtype == "bfloat16" else 5e-3
    np.testing.assert_allclose(y.astype(np.float64), y64.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(g.astype(np.float64), g64.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(s.astype(np.float64), g64.sum(0).numpy(), rtol=tol, atol=tol * 512)


# Configurations whose epilogues hold a thread's elements differently: the cooperative and ping-pong
# accumulator layouts (drawn once per quad), a narrow epilogue subtile, 200 rows (a partial tile),
# and float32 with N = 132, where a row's draws do not start at a multiple of 8 columns (each thread
# draws for its own elements).
DROPOUT_CASES = [
    ("float16", (256, 128, 64), None),
    ("float16", (256, 256, 64), {"tile": [128, 256, 64], "schedule": "cooperative"}),
    ("float16", (256, 256, 64), {"tile": [128, 128, 64], "schedule": "pingpong"}),
    ("float16", (256, 256, 128), {"tile": [128, 128, 64], "schedule": "pingpong", "epi_tile": [64, 16]}),
    ("float16", (200, 128, 64), {"tile": [128, 64, 64], "schedule": "cooperative"}),
    ("float32", (256, 132, 32), None),
]


@pytest.mark.parametrize("dtype,shape,config", DROPOUT_CASES,
                         ids=["default", "coop128x256", "pp128x128", "pp_epi64x16", "coop128x64_200rows", "tf32_n132"])
def test_dropout_mask_matches_philox_reference(dtype, shape, config):
    m, n, k = shape
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    w = relax.Var("w", relax.TensorType((n, k), dtype))
    seed = relax.Var("seed", relax.TensorType((2,), "uint32"))
    with bb.function("f", [x, w, seed]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
            d = bb.emit(relax.call_pure_packed(DROPOUT_EXTERN, y, seed, relax.prim_value(2),
                                               relax.prim_value(0.25), ty_args=y.ty))
            out = bb.emit_output(d)
        bb.emit_func_output(out)
    func = bb.get()["f"]
    rng = np.random.default_rng(1)
    arrays = [rng.uniform(-1, 1, (m, k)).astype(dtype), rng.uniform(-1, 1, (n, k)).astype(dtype),
              np.array([0x1234, 0xBEEF], dtype=np.uint32)]
    case = DROPOUT_CASES.index((dtype, shape, config))
    (d,) = run(offload(func, f"evt_gpu_dropout_{case}", config), arrays)
    expected = reference.evaluate(lower(from_function(func)), arrays)[0]
    assert ((d != 0) == (expected != 0)).all()
    np.testing.assert_allclose(d.astype(np.float32), expected.astype(np.float32), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("seed", range(8))
def test_random_epilogues_match_reference(seed):
    from test_codegen_random import random_partition

    func, arrays = random_partition(seed)
    partition = lower(from_function(func))
    if not (partition.gemm.a_k_major and partition.gemm.b_k_major):
        pytest.skip("tf32 kernels are TN only")
    got = run(offload(func, f"evt_gpu_random_{seed}"), arrays)
    for g, e in zip(got, reference.evaluate(partition, arrays)):  # tf32 main loop: loose tolerance
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=2e-2, atol=2e-2)


# Split-K and stream-K kernels keep their workspace between launches: each launch must leave the
# tile locks zero for the next (a lock left set would hang the next launch or add stale partial
# sums).  Four launches on fresh inputs, each against float64.  128x128 tiles of 256x256x4096 give
# few output tiles over a long K, so stream-K splits tiles among several units.  No column sum: an
# epilogue reduction has a workspace of its own, and such kernels take the per-launch workspace.
SPLIT_CASES = [
    {"tile": [128, 128, 64], "decomposition": "split_k", "splits": 2},
    {"tile": [128, 128, 64], "decomposition": "split_k", "splits": 3},
    {"tile": [128, 128, 64], "decomposition": "stream_k"},
    {"tile": [128, 256, 64], "cluster": [2, 1, 1], "decomposition": "stream_k"},
]


# A thin output (32 rows: XML-CNN's weight gradients) split 4 ways on 128-row tiles, rows 32..127 padding.
THIN_CASE = {"tile": [128, 64, 64], "decomposition": "split_k", "splits": 4}


@pytest.mark.parametrize("m,config", [(256, c) for c in SPLIT_CASES] + [(32, THIN_CASE)],
                         ids=["splitk2", "splitk3", "streamk", "streamk128x256_2x1", "thin_splitk4"])
def test_split_k_workspace_is_reused_across_launches(m, config):
    func = bias_gelu_func(m=m, n=256, k=4096, dtype="bfloat16", column_sum=False)
    vm = offload(func, f"evt_gpu_{config['decomposition']}_{config.get('splits', 1)}_{config['tile'][1]}_{m}", config)
    rng = np.random.default_rng(2)
    for _ in range(4):
        x, w, b = (torch.tensor(rng.uniform(-1, 1, s), dtype=torch.bfloat16) for s in ((m, 4096), (256, 4096), (256,)))
        g, y = run(vm, [t.float().numpy().astype(reference.NP_DTYPES["bfloat16"]) for t in (x, w, b)])
        y64 = x.double() @ w.double().T
        g64 = torch.nn.functional.gelu(y64 + b.double())
        np.testing.assert_allclose(y.astype(np.float64), y64.numpy(), rtol=2e-2, atol=0.5)
        np.testing.assert_allclose(g.astype(np.float64), g64.numpy(), rtol=2e-2, atol=0.5)
