"""ResNet-50's stem max pool backward (128x112x112x64 bf16, channels-last, 3x3/2 pad 1): our two
kernels (first tap, gather) as VectorizedElementwise schedules them vs torch's backward kernel."""
import json, os, sys
import torch, tvm
import torch.nn.functional as F
sys.path.insert(0, "tests")
from _te_kernels import CUDA, schedule
from tvm_evt.relax_passes.ops import max_pool_op
from tvm_evt.relax_passes.lower.vectorized_elementwise import VectorizedElementwise

def med(fn, refresh, iters=30, warm=5):
    for _ in range(warm):
        refresh(); fn()
    ts = []
    for _ in range(iters):
        refresh()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

N, H, C = 128, 112, 64
win = max_pool_op.Window((3, 3), (2, 2), (1, 1), (1, 1, 1, 1), (1, 2))
xs, ys = [N, H, H, C], [N, H // 2, H // 2, C]
first_t = max_pool_op.first_tap_tensors(xs, ys, win, "bfloat16")
gather_t = max_pool_op.gather_tensors(xs, ys, win, "bfloat16", "int8")
libs = {n: tvm.compile(schedule(t, VectorizedElementwise()), target=tvm.target.Target(CUDA)) for n, t in
        (("first", first_t), ("gather", gather_t))}
x = torch.randn(N, C, H, H, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
y, idx = torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
dy = torch.randn_like(y)
nhwc = lambda t: t.permute(0, 2, 3, 1)
first = torch.empty(ys, device="cuda", dtype=torch.int8)
dx = torch.empty(xs, device="cuda", dtype=torch.bfloat16)
d = tvm.runtime.from_dlpack
run_first = lambda: libs["first"]["main"](d(nhwc(x)), d(nhwc(y)), d(first))
run_gather = lambda: libs["gather"]["main"](d(nhwc(dy)), d(first), d(dx))
run_first(); run_gather(); torch.cuda.synchronize()
want = torch.ops.aten.max_pool2d_with_indices_backward(dy, x, [3, 3], [2, 2], [1, 1], [1, 1], False, idx)
err = float((dx.float() - nhwc(want).float()).norm() / nhwc(want).float().norm())
refresh = lambda: (dy.normal_(), dx.fill_(float("nan")))
out = {"rel_err_vs_torch": err,
       "first_ms": med(run_first, refresh), "gather_ms": med(run_gather, refresh),
       "torch_backward_ms": med(lambda: torch.ops.aten.max_pool2d_with_indices_backward(dy, x, [3, 3], [2, 2], [1, 1], [1, 1], False, idx), refresh),
       "torch_forward_with_indices_ms": med(lambda: torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False), lambda: None)}
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "maxpool.json"), "w"), indent=1)
