import sys, json, collections, pickle
sys.path.insert(0, "tests")
import torch, torch.nn.functional as F, tvm
from test_cnn_layers import resnet50
from tvm_evt import optim
from tvm_evt.pipeline import phases
from tvm_evt.training import hopper_target, build_training_module, from_torch
from tvm_evt.unbuilt import evt_functions
from tvm_evt.codegen.frontend import from_function
from tvm_evt.codegen.passes import lower
torch.manual_seed(0)
model = resnet50(classes=1000).to(memory_format=torch.channels_last)
x = torch.randn(128, 3, 224, 224).contiguous(memory_format=torch.channels_last)
graph = build_training_module(from_torch(model, (x, torch.randint(0, 1000, (128,))), F.cross_entropy), optim.AdamW(lr=1e-4), "bf16")
cuda = hopper_target()
with cuda:
    ps = phases(cuda)
    names = [p.info.name for p in ps]
    mod = tvm.transform.Sequential(ps[:names.index("PrebuildKernels")])(graph.mod)
parts = {}
for gv, func in evt_functions(mod).items():
    p = lower(from_function(func, symbol=gv.name_hint))
    parts[gv.name_hint] = p
    g = p.gemm
    print(gv.name_hint, g.batch, g.m, g.n, g.k, g.layout_name, g.dtype_a, [ (d.shape, d.dtype) for d in p.outputs])
try:
    pickle.dump(parts, open(".gpurun/r50_now.pkl", "wb"))
    print("pickled")
except Exception as e:
    print("pickle failed", e)
mod.show(show_meta=False) if False else None
with open("/tmp/r50_mod_now.py", "w") as f:
    f.write(mod.script(show_meta=False))
