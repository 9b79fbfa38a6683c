# galloc N_GB GRAPH(0/1): TVM's own CUDA pipeline on a step of two N-GB intermediates; device memory used
import sys, tvm, tvm_ffi
from tvm import relax
from tvm.script import relax as R
n_gb, graph = float(sys.argv[1]), sys.argv[2] == "1"
rows = int(n_gb * 1e9 / 4096)
bb = relax.BlockBuilder()
x = relax.Var("x", relax.TensorType((1024,), "float32"))
with bb.function("main", [x]):
    with bb.dataflow():
        a = bb.emit(relax.op.broadcast_to(x, (rows, 1024)))
        w = bb.emit(relax.op.broadcast_to(relax.op.reshape(x, (1024, 1)), (1024, 1024)))
        b = bb.emit(relax.op.matmul(a, w))
        c = bb.emit(relax.op.matmul(b, w))
        d = bb.emit(relax.op.sum(c, axis=[0]))
        out = bb.emit_output(d)
    bb.emit_func_output(out)
mod = bb.get()
dev = tvm.cuda(0)
import torch
free0 = torch.cuda.mem_get_info()[0]
used = lambda: round((free0 - torch.cuda.mem_get_info()[0]) / 1e9, 2)
for name in ("vm.builtin.cuda_graph.run_or_capture", "vm.builtin.cuda_graph.get_cached_alloc", "vm.builtin.alloc_storage"):
    orig = tvm_ffi.get_global_func(name)
    def wrap(*args, _orig=orig, _name=name):
        torch.cuda.synchronize(); before = used(); out = _orig(*args); torch.cuda.synchronize()
        print(f"  {_name.split('.')[-1]}: {before} -> {used()} GB", flush=True); return out
    tvm_ffi.register_global_func(name, wrap, override=True)
with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": graph}):
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
vm = relax.VirtualMachine(ex, dev)
xs = tvm.runtime.tensor(__import__("numpy").ones(1024, "float32"), dev)
try:
    for i in range(2):
        r = vm["main"](xs); dev.sync(); print(f"graph={graph} {n_gb} GB x2: after call {i + 1} used {used()} GB, out {r.numpy()[0]}", flush=True)
except Exception as err:
    print(f"graph={graph} failed: {str(err)[-200:]} used {used()}", flush=True)
