"""FoldNormAffine on the GPU: a layer (zoo BERT-Large layer 16 x 512, or GPT-2 medium block 8 x 1024),
bf16, built with and without the fold: losses, step time (CUDA events, fresh inputs, median of 30),
saved bytes, planned and measured peak."""
import copy, json, os, sys, time
import torch
import tvm_evt
from tvm_evt import models, pipeline

name = sys.argv[1]
make = {"bert": lambda: models.bert_layer(batch=16, seq=512, hidden=1024, heads=16, use_sdpa=True),
        "gpt2": lambda: models.gpt2_block(batch=8, seq=1024, hidden=1024, heads=16, use_sdpa=True),
        "vit": lambda: models.PRESETS["vit_b16_block"](batch=128)}[name]

def build(fold):
    os.environ.pop(pipeline.DISABLE_ENV, None)
    os.environ[pipeline.ENABLE_ENV] = "fold_norm" if fold else ""
    torch.manual_seed(0)
    e = make()
    x = e.example_inputs()
    t = time.perf_counter()
    s = tvm_evt.compile_training(copy.deepcopy(e.model), x, loss_fn=e.loss_fn, precision="bf16",
                                 optimizer=tvm_evt.optim.AdamW(lr=1e-4))
    return s, e, [t_.cuda() for t_ in x], time.perf_counter() - t

out = {}
for fold in (True, False):
    s, e, x, c = build(fold)
    n = sum(1 for blk in s.graph.mod["main"].body.blocks for b in blk.bindings
            if getattr(getattr(b.value, "op", None), "name", "") == "relax.nn.layer_norm" and not b.value.attrs.scale)
    mr = s.memory_report(*x)
    losses = [float(s(*x)) for _ in range(3)]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for i in range(35):
        xi = [t.clone().normal_() if t.is_floating_point() else t for t in x]
        ev[0].record(); s(*xi); ev[1].record(); torch.cuda.synchronize()
        if i >= 5: ts.append(ev[0].elapsed_time(ev[1]))
    ts.sort()
    saved = sum(a["bytes"] for a in mr["saved_activations"])
    out[str(fold)] = {"folded_layer_norms": n, "compile_s": c, "losses": losses, "median_ms": ts[len(ts) // 2],
                      "saved_bytes": saved, "planned_peak": mr["planned_peak_bytes"],
                      "measured": mr.get("measured_peak_bytes")}
    print(name, "fold" if fold else "nofold", out[str(fold)], flush=True)
    del s
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"fold_{name}.json"), "w"), indent=1)
