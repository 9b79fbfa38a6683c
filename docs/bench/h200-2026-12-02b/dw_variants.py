"""bench_tir's variants of the depthwise weight gradient on EfficientNet's 5x5 shapes at batch 128."""
import sys, time
import torch
from torch import nn
from tvm_evt import bench_tir, models
from tvm_evt.training import hopper_target

import os
VARIANTS = os.environ["VARIANTS"].split(";") if os.environ.get("VARIANTS") else ["depthwise_conv_op.TARGET_THREADS=67584",
            "depthwise_conv_op.COLUMN_PARTIALS=0",
            "depthwise_conv_op.COLUMN_PARTIALS=0 depthwise_conv_op.TARGET_THREADS=67584",
            "depthwise_conv_op.COLUMN_PARTIALS=0 depthwise_conv_op.TARGET_THREADS=33792",
            "depthwise_conv_op.COLUMN_PARTIALS=0 depthwise_conv_op.TX=16 depthwise_conv_op.TY=8"]
SHAPES = eval(os.environ["SHAPES"]) if os.environ.get("SHAPES") else [(14, 480, 5, 1), (14, 672, 5, 1), (28, 240, 5, 1), (7, 1152, 5, 1)]
deadline = time.time() + float(sys.argv[1])
target = hopper_target()
for h, c, r, st in SHAPES:
    p = (h + 2 * (r // 2) - r) // st + 1
    model = nn.Sequential(nn.Conv2d(c, c, r, stride=st, padding=r // 2, groups=c, bias=False), nn.Flatten(), nn.Linear(c * p * p, 10))
    x = torch.randn(128, c, h, h).contiguous(memory_format=torch.channels_last)
    entry = models.ZooEntry(model.to(memory_format=torch.channels_last), lambda x=x: (x, torch.randint(0, 10, (128,))),
                            nn.functional.cross_entropy, "dw", num_targets=1)
    kernels = bench_tir.scheduled_kernels("", match=r"depthwise_conv2d_wgrad|^sum\d+$|^fused_cast\d+_(transpose\d+_)?reshape", entry=entry, settings=VARIANTS)
    print(f"== {h}x{h}x{c} {r}x{r}/{st}", flush=True)
    for variant, funcs in kernels.items():
        total = 0.0
        cells = []
        for name, f in sorted(funcs.items()):
            if time.time() > deadline:
                print("deadline"); sys.exit(0)
            ms, nbytes = bench_tir.time_kernel(f, target)
            total += ms
            cells.append(f"{name[:48]} {[int(d) for d in f.params[-1].shape]} {ms*1e3:.1f}us")
        print(f"  {str(variant)[:90]:90s} total {total*1e3:7.1f} us | " + " | ".join(cells), flush=True)
