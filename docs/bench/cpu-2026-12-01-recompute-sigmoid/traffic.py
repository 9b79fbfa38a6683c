import sys
sys.argv = ["eff.py"]
src = open("docs/bench/cpu-2026-12-01-recompute-sigmoid/replica.py").read().split("cuda = hopper_target()")[0]
g = {}
exec(compile(src, "eff", "exec"), g)
from tvm_evt import tuning
from tvm_evt.training import hopper_target
rows = tuning.kernel_traffic(g["graph"].mod, hopper_target())
tir = [r for r in rows if r["kind"] == "tir"]
print("tir kernels", len(tir), "MB", round(sum(r["bytes"] for r in tir) / 1e6, 1), "all MB", round(sum(r["bytes"] for r in rows) / 1e6, 1))
