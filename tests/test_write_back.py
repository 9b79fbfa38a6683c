"""write_back: an in-place step's small state copied over its old tensors in one kernel."""
import numpy as np
import tvm

from tvm_evt.relax_passes.training import write_back
from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU

SPECS = [((), "float32"), ((300,), "float32"), ((2,), "uint32"), ((), "int64")]  # step, stats, seed, count


def test_portable_form_copies_over_its_destinations():
    func = write_back.primfunc(SPECS)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    rng = np.random.default_rng(0)
    make = lambda: [np.asarray(rng.integers(0, 1000, size=shape), dtype=dtype) for shape, dtype in SPECS]
    dst, src = make(), make()
    args = [tvm.runtime.tensor(a) for a in dst + src]
    lib["main"](*args)
    for got, want in zip(args[:len(SPECS)], src):
        np.testing.assert_array_equal(got.numpy(), want)


def test_gpu_form_is_one_kernel_and_builds():
    func = write_back.primfunc(SPECS)
    mod = tvm.IRModule({"write_back": func.with_attr("global_symbol", "write_back")})
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        gpu = ScheduleTIRForGPU()(mod)["write_back"]
    blocks = sum(-(-max(1, int(np.prod(shape))) // write_back.THREADS) for shape, _ in SPECS)
    text = gpu.script()
    assert int(gpu.attrs["tirx.is_scheduled"]) == 1 and len(gpu.params) == 2 * len(SPECS)
    assert text.count('thread="blockIdx.x"') == 1 and f"T.thread_binding({blocks}, thread=\"blockIdx.x\")" in text
    tvm.tirx.build(tvm.IRModule({"write_back": gpu}), target=target)  # no GPU needed


def test_emit_write_back_refuses_a_mismatched_pair():
    import pytest
    from tvm import relax

    a = relax.Var("a", relax.TensorType((4,), "float32"))
    b = relax.Var("b", relax.TensorType((4,), "float16"))
    with pytest.raises(ValueError, match="write_back: b is"):
        write_back.emit_write_back(relax.BlockBuilder(), [a], [b])
