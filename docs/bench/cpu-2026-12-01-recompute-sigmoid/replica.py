import sys, collections
sys.path.insert(0, "tests")
import torch, torch.nn as nn, torch.nn.functional as F, tvm
from tvm import relax
from tvm_evt import optim
from tvm_evt.pipeline import phases
from tvm_evt.training import hopper_target, build_training_module, from_torch

class SE(nn.Module):
    def __init__(self, c, r):
        super().__init__(); self.reduce = nn.Conv2d(c, r, 1); self.expand = nn.Conv2d(r, c, 1)
    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(F.silu(self.reduce(s))))

class MBConv(nn.Module):
    def __init__(self, cin, cout, expand=6, k=3, stride=1):
        super().__init__()
        h = cin * expand
        self.pw = nn.Sequential(nn.Conv2d(cin, h, 1, bias=False), nn.BatchNorm2d(h), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(h, h, k, stride, k // 2, groups=h, bias=False), nn.BatchNorm2d(h), nn.SiLU())
        self.se = SE(h, max(1, cin // 4))
        self.pwl = nn.Sequential(nn.Conv2d(h, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.res = stride == 1 and cin == cout
    def forward(self, x):
        y = self.pwl(self.se(self.dw(self.pw(x))))
        return x + y if self.res else y

model = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.SiLU(), MBConv(32, 32), MBConv(32, 48, stride=2),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 10)).to(memory_format=torch.channels_last)
x = torch.randn(16, 3, 64, 64).contiguous(memory_format=torch.channels_last)
graph = build_training_module(from_torch(model, (x, torch.randint(0, 10, (16,))), F.cross_entropy), optim.AdamW(lr=1e-4), "bf16")
cuda = hopper_target()
with cuda:
    ps = phases(cuda)
    names = [p.info.name for p in ps]
    mod = tvm.transform.Sequential(ps[:names.index("PrebuildKernels")])(graph.mod)
    stop = names.index(sys.argv[1] if len(sys.argv) > 1 else "RecomputeElementwise")
    mod = tvm.transform.Sequential(ps[names.index("RunCodegen") + 1:stop + 1])(mod)
f = mod["train_step"] if "train_step" in [g.name_hint for g in mod.functions] else mod["main_adjoint"]
bindings = [b for blk in f.body.blocks for b in blk.bindings]
readers = collections.Counter()
for b in bindings:
    for v in relax.analysis.free_vars(b.value) if False else []:
        pass
uses = collections.defaultdict(list)
for b in bindings:
    if isinstance(b.value, relax.Call):
        for a in b.value.args:
            if isinstance(a, relax.Var):
                uses[a].append(b.value.op.name if isinstance(b.value.op, tvm.ir.Op) else str(b.value.op))
for b in bindings:
    if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op) and b.value.op.name == "relax.sigmoid":
        print(b.var, b.var.ty, "readers:", uses[b.var])
