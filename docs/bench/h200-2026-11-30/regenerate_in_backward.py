"""RegenerateInBackward on the GPU: a BERT-Large layer (zoo, SDPA, dropout 0.1) in bf16, batch 16 x 512,
built with and without it: the same losses step after step (same masks), step times, saved bytes."""
import copy, json, os, sys, time
import torch
import tvm_evt
from tvm_evt import models, pipeline

def build(regenerate):
    os.environ[pipeline.ENABLE_ENV if regenerate else pipeline.DISABLE_ENV] = "regenerate"
    os.environ.pop(pipeline.DISABLE_ENV if regenerate else pipeline.ENABLE_ENV, None)
    torch.manual_seed(0)
    e = models.bert_layer(batch=16, seq=512, hidden=1024, heads=16, use_sdpa=True)
    x = e.example_inputs()
    t = time.perf_counter()
    s = tvm_evt.compile_training(copy.deepcopy(e.model), x, loss_fn=e.loss_fn, precision="bf16",
                                 optimizer=tvm_evt.optim.AdamW(lr=1e-4))
    return s, [t_.cuda() for t_ in x], time.perf_counter() - t

out = {}
steps = {}
for regen in (True, False):
    s, x, c = build(regen)
    mr = s.memory_report(*x)
    losses = [float(s(*x)) for _ in range(3)]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(20):
        ev[0].record(); s(*x); ev[1].record(); torch.cuda.synchronize(); ts.append(ev[0].elapsed_time(ev[1]))
    ts.sort()
    saved = sum(a["bytes"] for a in mr["saved_activations"])
    out[str(regen)] = {"compile_s": c, "losses": losses, "median_ms": ts[10], "saved_bytes": saved,
                       "planned_peak": mr["planned_peak_bytes"], "measured": mr.get("measured_peak_bytes")}
    print(regen, out[str(regen)], flush=True)
    del s
print("same losses:", out["True"]["losses"] == out["False"]["losses"])
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "regen.json"), "w"), indent=1)
