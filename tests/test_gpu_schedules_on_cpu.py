"""The CUDA route's TVM kernels, checked without a GPU.

Each kernel as ``ScheduleTIRForGPU`` schedules it for sm_90a, its thread bindings made serial loops,
is built for llvm and run against the same kernel before scheduling, on the same random inputs. A
schedule keeps the sequential meaning of the kernel it schedules (its thread bindings only say
where iterations run), so the two must agree; the serial form goes through the same TIR lowering
as the CUDA build, ``FlattenBuffer``'s index simplification included, which once rewrote a
depthwise input gradient's index wrongly for one shape (``test_depthwise_conv_op``: TVM 0.27's
``IterMapSimplify``). Kernels whose schedules cannot be serialized or built for llvm (explicit
synchronisation, DLight's GEMMs, cross-thread reductions) are skipped and counted.

fp32 steps: bf16 kernels built for llvm crashed here (heap corruption after a max-pool padding
kernel; not traced), and the GPU tier runs the bf16 kernels themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm

from tvm_evt import models, tuning
from tvm_evt.training import build_training_module, from_torch, runtime_module

from _te_kernels import run_on_llvm, serial
from test_cnn_layers import MODELS

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
UNSERIALIZABLE = ("storage_sync", "launch_thread", "thread_allreduce")  # explicit thread cooperation


def _cnn(name: str, batch: int, size: int, channels: int = 3):
    x = torch.randn(batch, channels, size, size).contiguous(memory_format=torch.channels_last)
    return from_torch(MODELS[name](), (x, torch.randint(0, 10, (batch,))), F.cross_entropy)


def _bert_layer():
    entry = models.ZOO["bert_layer"](batch=2, seq=24, hidden=64, heads=4)
    return from_torch(entry.model, entry.example_inputs(), entry.loss_fn)


STEPS = {"resnet_stem": lambda: _cnn("resnet_stem", 2, 32), "mobilenet_v2_blocks": lambda: _cnn("mobilenet_v2_blocks", 4, 32),
         "bert_layer": _bert_layer, "group_norm": lambda: _cnn("group_norm", 2, 16, channels=8),
         "fpn_upsample": lambda: _cnn("fpn_upsample", 2, 15)}


def _random(ty, rng) -> np.ndarray | None:
    shape, dtype = [int(s) for s in ty.shape.values], str(ty.dtype)
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    return rng.random(shape) < 0.5 if dtype == "bool" else None  # indices: no random values


@pytest.mark.parametrize("name", sorted(STEPS))
def test_scheduled_kernels_compute_what_the_kernels_do(name):
    torch.manual_seed(0)
    graph = build_training_module(STEPS[name](), None, "fp32")
    before, schedule = tuning.until_scheduling(CUDA)
    with CUDA:
        kernels = tvm.transform.Sequential(before)(runtime_module(graph.mod))
        scheduled = schedule(kernels)
    checked, skipped, wrong = [], {}, []
    for gv, func in kernels.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        form = scheduled[gv.name_hint]
        if any(word in form.script() for word in UNSERIALIZABLE):
            skipped[gv.name_hint] = "threads cooperate"
            continue
        rng = np.random.default_rng(0)
        arrays = [_random(ty, rng) for ty in func.ty.params]
        if any(a is None for a in arrays):
            skipped[gv.name_hint] = "integer operands"
            continue
        try:
            want, got = run_on_llvm(func, arrays), run_on_llvm(serial(form), arrays)
        except Exception as e:  # noqa: BLE001  (a form llvm does not build: counted, not checked)
            skipped[gv.name_hint] = str(e).strip().splitlines()[-1][:80]
            continue
        for w, g in zip(want, got):
            w, g = w.astype(np.float64), g.astype(np.float64)
            scale = max(1.0, float(np.nanmax(np.abs(w), initial=0)))  # sqrt and log of negatives: NaN in both
            if not np.allclose(g, w, rtol=1e-4, atol=1e-4 * scale, equal_nan=True):
                wrong.append(gv.name_hint)
                break
        checked.append(gv.name_hint)
    assert not wrong, wrong
    assert len(checked) >= 2 * len(skipped), (len(checked), skipped)
