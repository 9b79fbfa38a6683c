"""compile_training: a PyTorch model in, a compiled training step out.

The training graph is built by `relax_passes` in this order:

1. import (`frontend.from_torch`): ``main(*inputs, *params, *buffers) -> (loss, *new_buffers)``;
2. `check_differentiable`: every op between a parameter and the loss has a gradient rule;
3. `RecognizeActivations`: activations written out as elementwise ops (a tanh GELU) as their op;
   `LowerDropout`: training-mode dropout as a Philox mask, seeded per step;
   `ExpandSmallPower`: x**2 as x*x (TVM's CUDA pow is NaN for negative bases);
   `Conv2dToMatmul`: convolutions as im2col GEMMs (TVM has no GPU conv2d schedule; opt-in NHWC);
   `FuseAttention`: the attention core as one ``tvm_evt.attention`` op (flash attention; bf16/fp16);
   `GroupAttentionHeads`: key/value heads repeated over query heads as the op's grouped-query form;
   `PadAttentionKeys`: attention key lengths padded to a multiple of 16 (CUTLASS alignment; opt-in);
4. `AutoMixedPrecision` (+ `ScaleLoss` for fp16) when precision is not fp32;
5. ``relax.transform.Gradient``: ``main_adjoint``;
6. `AppendOptimizer`: ``train_step`` = forward + backward + update, one dataflow graph; under mixed
   precision the weights it casts for its GEMMs are kept as bf16/fp16 copies the update writes;
7. build for the target (llvm on CPU, CUDA on a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
import warnings
from typing import Sequence

import numpy as np
import tvm
from tvm import relax

from .codegen.frontend.attention_call import DTYPES as FLASH_DTYPES
from .codegen.frontend.attention_call import HEAD_DIMS as FLASH_HEAD_DIMS
from .errors import InputMismatchError, UnsupportedOpError
from .frontend import ImportedModel, from_torch
from .logs import quiet_known_warnings
from .memory import PlannedStepKeeper
from .pipeline import PIPELINE_NAME, enabled, graph_capture  # registers relax_pipeline="evt"
from .relax_passes._rewrite import sub_expressions
from .relax_passes.training import gradient_rules  # noqa: F401  (registers the gradient rules)
from .relax_passes.partition.rematerialize import BUDGET_ATTR
from .relax_passes.partition.rematerialize import REPORT_ATTR as REMAT_REPORT_ATTR
from .relax_passes.training.append_optimizer import AppendOptimizer, StepLayout
from .relax_passes.training.auto_mixed_precision import AutoMixedPrecision, ScaleLoss
from .relax_passes.training.cancel_transposes import CancelTransposes
from .relax_passes.training.conv2d_to_matmul import Conv2dToMatmul
from .relax_passes.training.convert_conv_layout import ConvertConvLayout
from .relax_passes.training.expand_small_power import ExpandSmallPower
from .relax_passes.training.fold_norm_affine import FoldNormAffine
from .relax_passes.training.recognize_rms_norm import RecognizeRMSNorm
from .relax_passes.training.fuse_attention import FuseAttention
from .relax_passes.training.group_attention_heads import GroupAttentionHeads
from .relax_passes.training.fuse_batch_norm import FuseBatchNorm
from .relax_passes.training.lower_dropout import SEED_PARAM, LowerDropout
from .relax_passes.training.pad_attention_keys import PadAttentionKeys
from .relax_passes.training.recognize_activations import RecognizeActivations
from .relax_passes.training.split_fused_projection import SplitFusedProjection
from .relax_passes.training.optimizers import SGD, AdamW, DynamicLossScale, from_torch_optimizer
from .tensors import input_arguments, to_torch, to_tvm

PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
# the precisions whose attention the flash-attention kernels compute (FuseAttention runs for these)
FLASH_PRECISIONS = tuple(p for p, dtype in PRECISIONS.items() if dtype in FLASH_DTYPES)


# ---------------------------------------------------------------------------- targets


# LLVM's SLP vectorizer (the LLVM inside apache-tvm 0.27.0.post1) can emit invalid IR for the
# unscheduled loops our CPU kernels are: silu -> multiply -> sum over a (4, 5, 2) tensor fails
# module verification with "Instruction does not dominate all uses" (at -O0 too; 40 elements
# as (40,) or (8, 5) build). TVM applies a target's cl-opt while it builds and restores it after.
LLVM_OPTIONS = ("-vectorize-slp=false",)


def cpu_target() -> dict:
    """The llvm target every CPU build uses (see LLVM_OPTIONS)."""
    return {"kind": "llvm", "cl-opt": list(LLVM_OPTIONS)}


def hopper_target() -> tvm.target.Target:
    """The H100/H200 target (sm_90a) that the analysis and per-kernel timing tools build for."""
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def default_target() -> dict:
    """CUDA (with the GPU's arch) when a GPU is present, else `cpu_target`."""
    dev = tvm.cuda(0)
    if dev.exist:
        major, minor = (int(x) for x in dev.compute_version.split("."))
        arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
        return {"kind": "cuda", "arch": arch}
    return cpu_target()


def as_target(target) -> tvm.target.Target:
    """``target`` (None for `default_target`, "llvm", "cuda", a dict, a tag or a Target) as a
    Target; an llvm target gets LLVM_OPTIONS added to its own cl-opt."""
    if target is None:
        target = default_target()
    if isinstance(target, str) and target in ("llvm", "cuda"):
        target = {"kind": target}
    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    if target.kind.name != "llvm":
        return target
    options = [str(o) for o in target.attrs.get("cl-opt", [])]
    missing = [o for o in LLVM_OPTIONS if o not in options]
    return tvm.target.Target({**target.export(), "cl-opt": options + missing}) if missing else target


# --------------------------------------------------------------- differentiability check


def check_differentiable(imported: ImportedModel) -> None:
    """Raise `UnsupportedOpError` for the first op on a parameter→loss path that has no
    gradient rule, naming the aten op and torch module it came from; a `TypeError` naming the
    parameters that are bfloat16."""
    func = imported.mod["main"]
    num_input = len(imported.input_names)
    params = func.params[num_input : num_input + len(imported.param_names)]
    bf16 = [name for name, p in zip(imported.param_names, params) if str(p.ty.dtype) == "bfloat16"]
    if bf16:  # TVM's Gradient: "Only Tensors of floating point dtype ... can require gradients"
        listed = ", ".join(repr(n) for n in bf16[:3]) + (f" and {len(bf16) - 3} more" if len(bf16) > 3 else "")
        raise TypeError(f"parameters {listed} are bfloat16: tvm_evt differentiates float32 and float16 "
                        "parameters (TVM's Gradient takes no bfloat16 ones); keep the model in float32 "
                        "(model.float()) and pass precision='bf16', which computes in bf16 with float32 "
                        "master weights")
    tainted = set(params)
    bindings = [b for block in func.body.blocks for b in block.bindings]
    origins = imported.origins
    pending = []  # bindings whose origin is the next recorded one
    for binding in bindings:
        value = binding.value
        if any(isinstance(u, relax.Var) and u in tainted for u in sub_expressions(value)):
            tainted.add(binding.var)
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                if value.op.get_attr("FPrimalGradient") is None:
                    pending.append(value.op.name)
        if pending and binding.var in origins:
            origin = origins[binding.var]
            raise UnsupportedOpError(
                origin.aten_op, origin.module_path, f"no gradient rule for {pending[0]}"
            )
    if pending:
        raise UnsupportedOpError(pending[0], "", "no gradient rule")


def _differentiate(mod: tvm.IRModule, params: list, imported: ImportedModel) -> tvm.IRModule:
    """TVM's ``Gradient`` of ``main``'s loss.  It differentiates every op the loss depends on, the
    labels' side included (a ``remainder`` of the targets that weighs the loss, say), which
    `check_differentiable`'s parameter paths do not cover; an op there without a rule is
    re-raised as `UnsupportedOpError` naming its aten op and module instead of TVM's InternalError."""
    try:
        return relax.transform.Gradient("main", require_grads=params, target_index=0)(mod)
    except Exception as err:  # pylint: disable=broad-except  (TVM raises InternalError here)
        missing = re.search(r"FPrimalGradient has not been registered for (\S+)", str(err))
        refused = re.search(r"gradient of ((?:relax|tvm_evt)\.\S+): ([^\n]+)", str(err))  # a rule's GradientRuleError
        if missing is not None:
            op, why = missing.group(1), f"no gradient rule for {missing.group(1)}"
        elif refused is not None:
            op, why = refused.group(1), f"its gradient rule refuses it: {refused.group(2).strip()}"
        else:
            raise
        raise UnsupportedOpError(*_origin_of(imported, op), why) from None


def _origin_of(imported: ImportedModel, op_name: str) -> tuple[str, str]:
    """(aten op, module path) of the bindings of the imported ``main`` that call `op_name` (the
    origin recorded for each, or for the converter output it is part of); where several modules
    call it, their paths joined with "or" (Gradient does not say which call failed)."""
    found, origins = False, []
    for block in imported.mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            found = found or (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                              and value.op.name == op_name)
            if found and binding.var in imported.origins:
                origins.append(imported.origins[binding.var])
                found = False
    if not origins:
        return op_name, ""
    paths = list(dict.fromkeys(o.module_path for o in origins))
    return origins[0].aten_op, " or ".join(paths)


# --------------------------------------------------------------------- graph building


def _resolve_optimizer(optimizer):
    if optimizer is None:
        return SGD(lr=1e-3)
    if isinstance(optimizer, (SGD, AdamW)):
        return optimizer
    return from_torch_optimizer(optimizer)


@dataclasses.dataclass
class TrainingGraph:
    """The Relax training module (main, main_adjoint, train_step) and how to call it."""

    mod: tvm.IRModule
    layout: StepLayout
    loss_scale: DynamicLossScale | None
    has_seed: bool
    inplace: bool = False  # train_step writes the new parameters and slots over its arguments


def build_training_module(imported: ImportedModel, optimizer, precision: str = "fp32",
                          inplace: bool = False, weight_copies: bool | None = None) -> TrainingGraph:
    """Steps 2-6 of the module docstring; `inplace`: the optimizer update writes over the parameters
    and slots train_step is given (``AppendOptimizer``; not with fp16's dynamic loss scaling);
    `weight_copies`: the step keeps the bf16/fp16 casts of its weights, written by the update
    (``AppendOptimizer``; None: ``pipeline.OPTIONAL["weight_copies"]``)."""
    if inplace and precision == "fp16":
        raise ValueError("inplace=True (which cuda_graph=True implies): fp16 steps scale their loss dynamically "
                         "and must keep the old parameters when the gradients overflow; use bf16 or fp32, or "
                         "inplace=False")
    mod, loss_scale, has_seed = build_adjoint_module(imported, precision)
    n_p = len(imported.param_names)
    overwrites = [imported.buffer_names.index(name) for name in imported.mutated_buffers]
    if weight_copies is None:
        weight_copies = enabled("weight_copies")
    appender = AppendOptimizer(_resolve_optimizer(optimizer), n_p, loss_scale, inplace=inplace, overwrites=overwrites,
                               weight_copies=weight_copies)
    mod = appender(mod)
    return TrainingGraph(mod, appender.layout, loss_scale, has_seed, inplace)


def build_adjoint_module(imported: ImportedModel, precision: str = "fp32"):
    """Steps 2-5 of the module docstring: (the module with ``main`` and ``main_adjoint``, the
    dynamic loss scale of fp16 or None, whether the graph takes a dropout seed)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    check_differentiable(imported)
    passes = [
        # a GELU written out as arithmetic (transformers' gelu_new) as the op (pipeline.OPTIONAL)
        *([RecognizeActivations()] if enabled("activations") else []),
        LowerDropout(),
        ExpandSmallPower(),
        # an RMS norm written out (transformers' LlamaRMSNorm) as relax.nn.rms_norm, whose gradient
        # is one row kernel on CUDA (pipeline.OPTIONAL)
        *([RecognizeRMSNorm()] if enabled("rms_norm") else []),
        # a layer norm's scale and shift into the weights of the matmuls it feeds (pipeline.OPTIONAL),
        # before the split: one scaled weight and one shift per fused projection
        *([FoldNormAffine()] if enabled("fold_norm") else []),
        # a linear layer whose output is split along its features as one per piece (pipeline.OPTIONAL)
        *([SplitFusedProjection()] if enabled("split_projection") else []),
        # convolutions (and the batch norms and ReLUs between them) in NHWC: opt-in, pipeline.OPTIONAL
        *([ConvertConvLayout()] if enabled("nhwc") else []),
        # channels-last inputs (frontend._take_channels_last) meet the convolutions' NHWC
        *([CancelTransposes()] if any(imported.channels_last) else []),
        # NHWC convolutions with overlapping windows as tvm_evt.conv2d (implicit-GEMM kernels on
        # CUDA) where the step is bf16/fp16 (pipeline.OPTIONAL); the rest as im2col + GEMM
        # and depthwise ones as tvm_evt.depthwise_conv2d, direct kernels (pipeline.OPTIONAL)
        Conv2dToMatmul(implicit=enabled("implicit_conv") and precision in FLASH_PRECISIONS,
                       depthwise=enabled("depthwise")),
        relax.transform.CanonicalizeBindings(),
        relax.transform.DeadCodeElimination(),
        # the attention core as one tvm_evt.attention op where the flash-attention kernels can take
        # it (bf16/fp16, their head dimensions; pipeline.OPTIONAL); elsewhere the unfused graph keeps
        # PadAttentionKeys' CUTLASS-aligned keys.  It needs the canonical bindings above (no tuple
        # round trips between the softmax and LowerDropout's mask)
        *([FuseAttention(head_dims=FLASH_HEAD_DIMS)] if enabled("flash_attention") and precision in FLASH_PRECISIONS
          else []),
        # keys and values repeated over groups of query heads (transformers' repeat_kv) as the
        # attention op's grouped-query operands: the kernels read each head for its whole group
        GroupAttentionHeads(),
        # key lengths that are not a multiple of 16 (197) to one: CUTLASS-aligned GEMMs (opt-in: pipeline.OPTIONAL)
        *([PadAttentionKeys()] if enabled("pad_keys") else []),
    ]
    low = PRECISIONS[precision]
    loss_scale = None
    if low is not None:
        passes.append(AutoMixedPrecision(low))
        if low == "float16":
            loss_scale = DynamicLossScale()
            passes.append(ScaleLoss())
    if enabled("batch_norm"):  # after the casts: the op reads the low-precision activation
        passes.append(FuseBatchNorm())
    mod = tvm.transform.Sequential(passes)(imported.mod)
    main = mod["main"]
    n_in, n_p = len(imported.input_names), len(imported.param_names)
    params = list(main.params[n_in : n_in + n_p])
    if not params:
        raise ValueError("the model has no trainable parameters")
    mod = _differentiate(mod, params, imported)
    return mod, loss_scale, any(p.name == SEED_PARAM for p in main.params)


# ---------------------------------------------------------------------------- runtime


class TrainingStep:
    """A compiled training step.  ``step(*inputs)`` runs forward, backward and the update
    and returns the loss; see `loss_and_grads`, `parameters`, `load_parameters`."""

    def __init__(self, imported: ImportedModel, graph: "TrainingGraph", executable, target,
                 compile_seconds: float, seed: int = 0, build_adjoint=None):
        layout, loss_scale = graph.layout, graph.loss_scale
        self.imported = imported
        self.graph = graph
        self.target = target
        self.layout = layout
        self.compile_seconds = compile_seconds
        self.device = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)
        self.vm = relax.VirtualMachine(executable, self.device)
        self._train = self.vm["train_step"]
        # main_adjoint (loss_and_grads): in `executable` where it was built with the step, else built
        # by `build_adjoint()` (an executable) when first called
        self._adjoint = self._entry(self.vm, "main_adjoint")
        self._adjoint_vm, self._build_adjoint = None, build_adjoint
        # the dropout RNG state (seed, counter) lives on the device: train_step returns the next
        # one, so no step starts with a host-to-device copy (TVM synchronises the device after one)
        self._rng = None
        if graph.has_seed:
            self._rng = tvm.runtime.tensor(np.array([int(seed) & 0xFFFFFFFF, 0], dtype="uint32"), self.device)
        self._params = [self._tensor(v) for v in imported.param_values.values()]
        self._buffers = {k: self._tensor(v) for k, v in imported.buffer_values.items()}
        zeros = lambda p: tvm.runtime.tensor(np.zeros(p.shape, dtype=p.dtype), self.device)
        self._slots = [zeros(self._params[i]) for _ in layout.slots for i in range(layout.num_params)]
        self._step = self._scalar(0.0)
        self._ran = False  # train_step or main_adjoint has run (memory_report measures a first run)
        self.planned_function = None  # train_step as the build planned its memory (compile_training keeps it)
        self.captures_graphs = False  # built as CUDA graphs: the plan's storages are allocated once and kept
        self._scaler = []
        if loss_scale is not None:
            self._scaler = [self._scalar(loss_scale.init_scale), self._scalar(0.0)]
        self._copies = [to_tvm(self._cast_parameter(i, dtype), self.device) for i, dtype in layout.copies]

    # -- helpers
    @staticmethod
    def _entry(vm, name: str):
        return vm[name] if vm.module.implements_function(name) else None

    def _scalar(self, value: float):
        return tvm.runtime.tensor(np.array(value, dtype="float32"), self.device)

    def _tensor(self, t):
        # an in-place step writes over its parameters: they must be its own, not views of the caller's
        return to_tvm(t.detach().clone() if self.graph.inplace else t.detach(), self.device)

    def _cast_parameter(self, index: int, dtype: str):
        """Parameter `index` cast to `dtype`, a torch tensor on the device (a weight copy,
        ``StepLayout.copies``)."""
        import torch

        return to_torch(self._params[index]).to(getattr(torch, dtype))

    def _state(self) -> list:
        """train_step's arguments after the inputs, parameters and buffers."""
        return self._slots + [self._step] + self._scaler + self._copies

    def _check_inputs(self, inputs: Sequence) -> list:
        return input_arguments(self.imported, inputs, self.device)

    def _rest(self) -> list:
        rest = [self._buffers[n] for n in self.imported.buffer_names]
        return rest + ([self._rng] if self._rng is not None else [])

    def _write_buffers(self, new_buffers) -> None:
        for name, value in zip(self.imported.mutated_buffers, new_buffers):
            self._buffers[name] = value

    # -- public API
    def __call__(self, *inputs):
        args = self._check_inputs(inputs) + self._params + self._rest() + self._state()
        out = self._train(*args)
        self._ran = True
        lay = self.layout
        i = 1
        self._params = [out[i + k] for k in range(lay.num_params)]
        i += lay.num_params
        self._write_buffers([out[i + k] for k in range(lay.num_new_buffers)])
        i += lay.num_new_buffers
        self._slots = [out[i + k] for k in range(lay.num_slot_tensors)]
        i += lay.num_slot_tensors
        self._step = out[i]
        i += 1
        self._scaler = [out[i + k] for k in range(len(self._scaler))]
        i += len(self._scaler)
        self._copies = [out[i + k] for k in range(len(self._copies))]
        if lay.advances_seed:
            self._rng = out[len(out) - 1]
        return to_torch(out[0])

    def loss_and_grads(self, *inputs):
        """(loss, {param_name: grad}) without updating anything."""
        args = self._check_inputs(inputs) + self._params + self._rest()
        if self.layout.loss_scaling:
            args.append(self._scalar(1.0))
        if self._adjoint is None:
            if self._build_adjoint is None:
                raise RuntimeError("loss_and_grads: this step's executable has no main_adjoint and no way to build it")
            self._adjoint_vm = relax.VirtualMachine(self._build_adjoint(), self.device)
            self._adjoint = self._adjoint_vm["main_adjoint"]
        out = self._adjoint(*args)
        self._ran = True
        loss, grads = out[0][0], out[1]
        names = self.imported.param_names
        return to_torch(loss), {n: to_torch(grads[k]) for k, n in enumerate(names)}

    def parameters(self) -> dict:
        """{name: tensor} of the current parameters (and buffers, e.g. BatchNorm statistics): torch
        views of the step's tensors, which an in-place step (``inplace``/``cuda_graph``) goes on
        writing over; ``.clone()`` them to keep a snapshot."""
        params = {n: to_torch(v) for n, v in zip(self.imported.param_names, self._params)}
        params.update({n: to_torch(v) for n, v in self._buffers.items()})
        return params

    def load_parameters(self, state_dict: dict) -> None:
        """Load parameters/buffers by torch name (e.g. a model's ``state_dict()``)."""
        names = self.imported.param_names
        unknown = [k for k in state_dict if k not in names and k not in self._buffers]
        if unknown:
            raise KeyError(f"unknown parameter names: {unknown[:5]}")
        for k, v in state_dict.items():
            if k in self._buffers:
                self._replace(self._buffers, k, v)
            else:
                idx = names.index(k)
                want = tuple(self._params[idx].shape)
                if tuple(v.shape) != want:
                    raise InputMismatchError(f"parameter '{k}': expected shape {list(want)}, got {list(v.shape)}")
                self._replace(self._params, idx, v)
                for c, (i, dtype) in enumerate(self.layout.copies):
                    if i == idx:  # its weight copy, made again from the value loaded
                        self._replace(self._copies, c, self._cast_parameter(i, dtype))

    def _replace(self, store, key, value) -> None:
        """``store[key] = value``; an in-place step copies `value` into the tensor it has instead
        (a captured CUDA graph reads that tensor's memory, whatever tensor the step is given)."""
        if self.graph.inplace:
            store[key].copyfrom(to_tvm(value.detach(), self.device))  # the copy is the step's own
        else:
            store[key] = self._tensor(value)

    def report(self) -> dict:
        """EVT partitions of ``train_step``: {"partitions": [{"ops", "bytes_saved", ...}],
        "unfused_matmuls", "solve_seconds", ...} (see `tvm_evt.report`)."""
        from .report import training_report

        report = training_report(self.graph.mod, target=self.target)
        # SDPA calls the importer wrote out as plain ops (a mask computed from the inputs, say)
        unfused = [{"op": "sdpa", "module": f["module"], "kernel": False, "reason": f["reason"]}
                   for f in self.imported.attention_fallbacks]
        return {**report, "attention": report["attention"] + unfused}

    def report_png(self, path: str) -> str:
        """Draw the partitioned ``train_step`` into the PNG ``path`` (needs matplotlib)."""
        from .report import draw, partitioned

        return draw(partitioned(self.graph.mod, target=self.target), path)

    def memory_report(self, *inputs) -> dict:
        """Bytes by category (parameters, gradients, optimizer state, activations saved for the
        backward, ...) and live bytes over the step, from ``train_step``'s memory plan as this step's
        target builds it (see `tvm_evt.memory`).  Given `inputs` on CUDA, a step that has not run yet
        runs once on them and ``measured_peak_bytes`` is what the device then holds for it: the
        arguments plus the growth of the device memory in use over that run (TVM's pooled allocator
        keeps what it allocated; the CUTLASS and attention kernels' own workspaces, freed after
        their launch, are not in it)."""
        from .memory import device_used_bytes, memory_plan, memory_report

        func = self.planned_function  # kept from the build; else the build's passes run again up to the plan
        if func is None:
            func = memory_plan(runtime_module(self.graph.mod), self.target, self.captures_graphs)
        notes = ["workspaces are not in the plan: the CUTLASS kernels allocate theirs around each launch "
                 "(cudaMallocAsync) or keep one per kernel, the flash-attention backward allocates its own"]
        measured = None
        if inputs and not self._ran:
            before = device_used_bytes(self.device)
            if before is not None:  # the state the step holds already; the run copies the inputs in
                state = self._params + self._rest() + self._state()
                held = sum(int(np.prod(a.shape, dtype=np.int64)) * tvm.runtime.DataType(a.dtype).itemsize
                           for a in state)
                self(*inputs)
                self.device.sync()
                measured = held + device_used_bytes(self.device) - before
            else:
                notes.append(f"no measured peak: TVM reports no memory use for {self.device}")
        report = memory_report(func, self.layout, measured, notes, storages_kept=self.captures_graphs)
        decided = func.attrs.get(REMAT_REPORT_ATTR) if func.attrs else None
        report["rematerialized"] = json.loads(str(decided)) if decided is not None else None
        return report

    def memory_report_png(self, path: str, *inputs) -> str:
        """Draw `memory_report` (bytes by category, live bytes over the step) into the PNG ``path``
        (needs matplotlib)."""
        from .memory import draw

        return draw(self.memory_report(*inputs), path)

    @property
    def step_count(self) -> int:
        return int(self._step.numpy())


ENTRY_FUNCTIONS = ("main", "main_adjoint", "train_step")


def runtime_module(mod: tvm.IRModule, *functions: str) -> tvm.IRModule:
    """`functions` of the training module (``train_step`` where none is named) as one build takes
    them, without its other entry functions: `compile_training` builds ``train_step`` and
    `TrainingStep.loss_and_grads` builds ``main_adjoint`` when first called.  Built together, every
    pass of the pipeline would run on both: most of a warm compile's time."""
    functions = functions or ("train_step",)
    unknown = set(functions) - set(ENTRY_FUNCTIONS)
    if unknown:
        raise ValueError(f"runtime_module: {sorted(unknown)} not among the training module's {ENTRY_FUNCTIONS}")
    kept = {gv: f for gv, f in mod.functions_items() if gv.name_hint in functions or gv.name_hint not in ENTRY_FUNCTIONS}
    mod = tvm.IRModule(kept, attrs=mod.attrs)
    return relax.transform.DeadCodeElimination(entry_functions=list(functions))(mod)


def captures_graphs(target: tvm.target.Target, precision: str, cuda_graph: bool | None) -> bool:
    """Does `compile_training` build this step as CUDA graphs? `cuda_graph` as given there."""
    if cuda_graph is None:
        cuda_graph = enabled("cuda_graph") and precision != "fp16"
    return target.kind.name == "cuda" and cuda_graph


def _build(mod: tvm.IRModule, target: tvm.target.Target, tuning_dir=None):
    """`mod` built by the evt pipeline (with the tuning results of `tuning_dir`, if given)."""
    if tuning_dir is None:
        return tvm.compile(mod, target=target, relax_pipeline=PIPELINE_NAME)
    from .tuned import compile_tuned

    return compile_tuned(mod, target, tuning_dir)


def compile_training(
    model,
    example_inputs: Sequence,
    loss_fn=None,
    optimizer=None,
    target=None,
    precision: str = "fp32",
    seed: int = 0,
    tuning_dir=None,
    inplace: bool = False,
    cuda_graph: bool | None = None,
    data_parallel: bool = False,
    zero: bool = False,
    bucket_mb: float = 25.0,
    overlap: bool = False,
    process_group=None,
    memory_budget: int | str | None = None,
):
    """Compile forward + backward + optimizer update of `model` into one training step.

    `target=None` picks CUDA when a GPU is present, else llvm; `optimizer` defaults to
    ``SGD(lr=1e-3)`` and may be a tvm_evt optimizer or a torch.optim.SGD/AdamW instance.
    With `loss_fn`, the last input is the loss target. `tuning_dir`: a work directory of
    `tvm_evt.tuning.tune` (scripts/tune.py) whose MetaSchedule database and CUTLASS choices to use.
    `inplace`: the update writes the new parameters and optimizer slots over the old ones (one copy
    of that state on the device instead of two; the step keeps them in the same tensors); not fp16.
    `cuda_graph`: on CUDA, the step runs in place and TVM's ``RewriteCUDAGraph`` captures its
    kernels into CUDA graphs, replayed by later steps (those that read the step's inputs or make its
    loss run outside them). None: on unless ``TVM_EVT_DISABLE=cuda_graph`` or fp16 (whose loss
    scaler keeps the old parameters on an overflow, so its update cannot run in place).

    `data_parallel`: this process is one rank of `process_group` (None: torch.distributed's default
    group, which ``init_process_group`` set up under torchrun) and `example_inputs` are its shard
    of the batch; returns a `tvm_evt.distributed.DataParallelStep`, which averages the gradients
    across the ranks in buckets of about `bucket_mb` MiB, all-reduced after the backward, each
    bucket's update as soon as its all-reduce is done; `overlap`: the backward cut into one
    function per bucket, each bucket all-reduced as soon as the backward has produced it (the
    communication overlaps the rest of the backward, but the fusions across the cuts are lost:
    slower on the transformers measured, ``tvm_evt.distributed``). `zero`: ZeRO-1, each rank keeps and updates the optimizer
    state of its shard of the parameters (reduce-scatter, update, all-gather).  fp32 and bf16, not
    ``inplace`` or ``cuda_graph`` (off by default with data_parallel).

    `memory_budget`: bytes the step may hold at its peak (arguments, saved activations,
    temporaries), or ``"auto"`` (90 % of the device memory free now); forward values are then
    recomputed in the backward instead of kept where the estimated peak would exceed it
    (``relax_passes/partition/rematerialize.py``; ``step.memory_report()["rematerialized"]`` says
    which).  A budget no plan meets raises `MemoryBudgetError` naming the smallest one that can be.
    fp32 and bf16 steps, not data-parallel.
    """
    start = time.perf_counter()
    tgt = as_target(target)
    if zero and not data_parallel:
        raise ValueError("zero=True shards the optimizer state across data-parallel ranks: it needs data_parallel=True")
    if data_parallel and memory_budget is not None:
        raise ValueError("memory_budget is not supported with data_parallel=True yet: the data-parallel step is "
                         "split into functions the rematerialisation does not plan across")
    if data_parallel:
        return _compile_data_parallel(model, example_inputs, loss_fn, optimizer, tgt, precision, seed, tuning_dir,
                                      inplace, cuda_graph, zero, bucket_mb, overlap, process_group, start)
    graphs = captures_graphs(tgt, precision, cuda_graph)
    budget = resolve_memory_budget(memory_budget, tgt, precision)
    imported = from_torch(model, example_inputs, loss_fn)
    graph = build_training_module(imported, optimizer, precision, inplace=inplace or graphs)
    if budget is not None:
        graph.mod["train_step"] = graph.mod["train_step"].with_attr(BUDGET_ATTR, budget)
    keeper = PlannedStepKeeper()  # the memory plan as the build makes it, for memory_report
    with graph_capture() if graphs else contextlib.nullcontext(), keeper.watching(), quiet_known_warnings():
        executable = _build(runtime_module(graph.mod), tgt, tuning_dir)

    def build_adjoint():
        with quiet_known_warnings():
            return _build(runtime_module(graph.mod, "main_adjoint"), tgt, tuning_dir)

    step = TrainingStep(imported, graph, executable, tgt, time.perf_counter() - start, seed=seed,
                        build_adjoint=build_adjoint)
    step.planned_function = keeper.function
    step.captures_graphs = graphs
    if budget is not None and step.planned_function is not None:
        _check_plan(step, budget)
    return step


def _check_plan(step: "TrainingStep", budget: int) -> None:
    """Warn when the built step's memory plan holds more than `budget` at its peak: the
    rematerialisation meets the budget on its estimate of the step before kernels are fused and
    memory is planned, which the plan can exceed."""
    from .memory import memory_report

    planned = memory_report(step.planned_function, step.layout, storages_kept=step.captures_graphs)["planned_peak_bytes"]
    if planned > budget:
        warnings.warn(f"compile_training: train_step's memory plan holds {planned / 1e6:,.1f} MB at its peak, over "
                      f"memory_budget={budget / 1e6:,.1f} MB (the rematerialisation met the budget on its estimate of "
                      f"the step before fusion and memory planning); a budget {(planned - budget) / 1e6:,.1f} MB lower "
                      "would aim under it", stacklevel=3)


def resolve_memory_budget(memory_budget, target: tvm.target.Target, precision: str) -> int | None:
    """`compile_training`'s `memory_budget` in bytes (None: no budget)."""
    if memory_budget is None:
        return None
    if precision == "fp16":
        raise ValueError("memory_budget with precision='fp16': the loss is unscaled after the backward, so the step has "
                         "no forward/backward boundary the rematerialisation can read; use bf16 or fp32")
    if memory_budget == "auto":
        return int(0.9 * free_device_bytes(target))
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, np.integer)) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes or 'auto', got {memory_budget!r}")
    return int(memory_budget)


def free_device_bytes(target: tvm.target.Target) -> int:
    """Memory free now on `target`'s device: the GPU's (cudaMemGetInfo) or the host's available RAM."""
    if target.kind.name == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    import os

    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _compile_data_parallel(model, example_inputs, loss_fn, optimizer, tgt, precision, seed, tuning_dir, inplace,
                           cuda_graph, zero, bucket_mb, overlap, process_group, start):
    """`compile_training` with ``data_parallel=True``: `tvm_evt.distributed` builds and runs it."""
    from . import distributed

    if getattr(_resolve_optimizer(optimizer), "max_grad_norm", None) is not None:
        raise ValueError("data_parallel=True with an optimizer's max_grad_norm: the data-parallel step updates each "
                         "bucket as its all-reduce ends, before the norm over every gradient is known")
    if precision == "fp16":
        raise ValueError("data_parallel=True with precision='fp16': the dynamic loss scale would need one overflow "
                         "verdict across the ranks, which the data-parallel step does not compute; use bf16 or fp32")
    if inplace or cuda_graph:
        raise ValueError("data_parallel=True runs the step as several functions with collectives between them: "
                         "inplace=True and cuda_graph=True are not supported with it")
    distributed.process_group(process_group)  # a clear error before the compile when there is no group
    imported = from_torch(model, example_inputs, loss_fn)
    mod, _, has_seed = build_adjoint_module(imported, precision)
    return distributed.compile_data_parallel(imported, mod, _resolve_optimizer(optimizer), precision, tgt, has_seed,
                                             seed=seed, zero=zero, bucket_mb=bucket_mb, group=process_group,
                                             tuning_dir=tuning_dir, start=start, overlap=overlap)
