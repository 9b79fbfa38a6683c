"""GPU: where(relu6 mask(y), depthwise dgrad, 0) as two kernels (dgrad, then the select) against
one (SelectInDepthwiseDgrad), bf16, MobileNetV2's shapes at batch 128; outputs compared."""
import json, os, sys, time
import numpy as np
import torch
import tvm
from tvm import relax
import tvm_evt  # noqa: F401
from tvm_evt.relax_passes.ops import conv_op, depthwise_conv_op as dwc
from tvm_evt.bench_e2e import time_steps

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
SHAPES = [(128, 112, 32, 3, 1), (128, 112, 96, 3, 2), (128, 56, 144, 3, 1), (128, 56, 144, 3, 2),
          (128, 28, 192, 3, 1), (128, 14, 576, 3, 1), (128, 7, 960, 3, 1)]
bf = "bfloat16"


def module():
    bb = relax.BlockBuilder()
    for i, (n, h, c, r, s) in enumerate(SHAPES):
        g = conv_op.Geometry((r // 2,) * 4, (s, s), (1, 1))
        p = g.out((h, h), (r, r))[0]
        dy = relax.Var("dy", relax.TensorType((n, p, p, c), bf))
        w = relax.Var("w", relax.TensorType((c, r, r, 1), bf))
        y = relax.Var("y", relax.TensorType((n, h, h, c), bf))
        with bb.function(f"f{i}", [dy, w, y]):
            with bb.dataflow():
                dx = bb.emit(dwc.depthwise_conv2d_dgrad(dy, w, g, (n, h, h, c)))
                keep = bb.emit(relax.op.logical_and(relax.op.greater(y, relax.const(0.0, bf)),
                                                    relax.op.less(y, relax.const(6.0, bf))))
                out = bb.emit_output(relax.op.where(keep, dx, relax.const(0.0, bf)))
            bb.emit_func_output(out)
    return bb.get()


vms = {}
for mode in ("two", "one"):
    os.environ["TVM_EVT_ENABLE"] = "depthwise_select" if mode == "one" else ""
    t = time.time()
    vms[mode] = relax.VirtualMachine(tvm.compile(module(), target=CUDA, relax_pipeline="evt"), tvm.cuda())
    print(mode, "built", round(time.time() - t, 1), flush=True)
rows = []
for i, (n, h, c, r, s) in enumerate(SHAPES):
    p = conv_op.Geometry((r // 2,) * 4, (s, s), (1, 1)).out((h, h), (r, r))[0]
    dy = torch.randn(n, p, p, c, device="cuda").bfloat16()
    w = torch.randn(c, r, r, 1, device="cuda").bfloat16()
    y = (torch.rand(n, h, h, c, device="cuda") * 10 - 2).bfloat16()
    args = [tvm.runtime.from_dlpack(t) for t in (dy, w, y)]
    outs = {m: torch.from_dlpack(vms[m][f"f{i}"](*args)).clone() for m in vms}
    same = bool(torch.equal(outs["one"], outs["two"]))
    ms = {}
    for m in vms:
        f = vms[m][f"f{i}"]
        step = lambda f=f: f(*args)
        for _ in range(5):
            step()
        ms[m] = float(np.median(time_steps(step, 30)))
    rows.append({"shape": [n, h, c, r, s], "ms_two_kernels": ms["two"], "ms_one": ms["one"], "equal": same})
    print(rows[-1], flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "select_dgrad.json"), "w"), indent=1)
print("sum two", sum(r["ms_two_kernels"] for r in rows), "one", sum(r["ms_one"] for r in rows))
