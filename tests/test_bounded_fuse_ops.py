import numpy as np
import tvm
from tvm import relax

from tvm_evt.relax_passes.lower.bounded_fuse_ops import BoundedFuseOps


def _chain(n: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 32), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for i in range(n):
                y = bb.emit(relax.op.add(y, relax.const(float(i % 3), "float32")) if i % 2 else relax.op.tanh(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _fused(mod, fuse) -> tvm.IRModule:
    seq = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), fuse, relax.transform.FuseTIR()]
    return tvm.transform.Sequential(seq)(mod)


def _kernels(mod) -> int:
    """Kernel launches of ``main`` (equal fused functions are shared, so count the calls)."""
    return mod["main"].script().count("R.call_tir(")


def test_long_chain_is_cut_into_kernels_of_bounded_size():
    mod = _chain(80)
    assert _kernels(_fused(mod, relax.transform.FuseOps())) == 1  # TVM: one 80-op kernel
    bounded = _fused(mod, BoundedFuseOps(max_depth=16))
    assert _kernels(bounded) >= 5
    x = np.random.default_rng().standard_normal((64, 32)).astype("float32")
    outs = []
    for m in (_fused(mod, relax.transform.FuseOps()), bounded):
        ex = tvm.compile(m, target=tvm.target.Target({"kind": "llvm"}))
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_a_smaller_cap_in_the_pass_context_wins():
    mod = _chain(40)
    with tvm.transform.PassContext(config={"relax.FuseOps.max_depth": 8}):
        assert _kernels(_fused(mod, BoundedFuseOps(max_depth=32))) >= 5


def test_the_cuda_route_uses_it():
    from tvm_evt.pipeline import phases

    names = [p.info.name for p in phases(tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))]
    assert "BoundedFuseOps" in names and "FuseOps" not in names
