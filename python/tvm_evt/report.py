"""The partition report of a training graph, and a picture of it.

``training_report(mod)`` runs the target-independent phases of the ``evt`` pipeline (graph passes
and the partitioner, whose solution comes from the cache once compiled) on ``train_step`` and
returns::

    {"partitions": [{"symbol", "ops": ["relax.matmul", ...], "bytes_saved", "matmul"}, ...],
     "unfused_matmuls": [{"var", "shape", "dtype", "reason"}, ...],
     "solve_seconds": float, "method": "ilp" | "cache" | "greedy" | "mixed", ...,
     "attention": [{"op": "forward" | "backward", "shape": [B, H, Sq, Sk], "kv_heads", "head_dim", "dtype", "causal",
                    "dropout", "kernel": bool, "reason"}, ...],
     "convolutions": [{"op": "fprop" | "dgrad" | "wgrad", "x": [N, H, W, C], "w": [K, R, S, C],
                       "dtype", "kernel": bool, "reason"[, "kind": "depthwise"]}, ...]}

where ``attention`` lists the fused attention calls (SDPA as imported, ``FuseAttention``'s; ``kv_heads`` below
H: grouped-query attention, each key/value head read by H / kv_heads query heads) and whether the CUDA
route runs each as a flash-attention kernel (``kernel``) or, with ``reason``, as plain ops, and
``convolutions`` the ``tvm_evt.conv2d*`` calls (``implicit_conv``) and whether it runs each as an
implicit-GEMM kernel or, with ``reason``, as im2col + GEMM (``OffloadConv``), the depthwise ones
(``tvm_evt.depthwise_conv2d*``, direct kernels: ``"kind": "depthwise"``), and the convolutions left
as TVM's own ops (grouped ones, and their gradients), which run as TVM kernels.

``draw(mod, path)`` writes a PNG (matplotlib): one row per kernel in execution order, GEMM + EVT
partitions as labelled boxes, the ops TVM keeps as grey dots, data edges between them.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .pipeline import enabled, front_passes
from .relax_passes.partition.partition_evt import CODEGEN, partition_report


def partitioned(mod: tvm.IRModule, function: str = "train_step", target: tvm.target.Target | None = None) -> tvm.IRModule:
    """``mod`` after the graph passes and the partitioner (``function`` only), as compiled for
    `target` (``pipeline.front_passes``)."""
    return tvm.transform.Sequential(front_passes(functions=(function,), target=target))(mod)


def _calls_of(func: relax.Function, names) -> list[relax.Call]:
    """The calls of `func` to the ops named in `names`, in post order."""
    calls = []
    relax.analysis.post_order_visit(func.body, lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) and e.op.name in names else None)
    return calls


def attention_calls(func: relax.Function) -> list[dict]:
    """The fused attention calls of `func`, and whether the flash-attention kernels take each."""
    from .codegen.errors import Unsupported
    from .codegen.frontend.attention_call import BACKWARD_OP, TENSOR_ARGS, attention_of_call

    calls = _calls_of(func, TENSOR_ARGS)
    rows = []
    for call in calls:
        q, k = call.args[0].ty, call.args[1].ty
        row = {"op": "backward" if call.op.name == BACKWARD_OP else "forward",
               "shape": [int(d) for d in q.shape][:3] + [int(k.shape[2])], "kv_heads": int(k.shape[1]),
               "head_dim": int(q.shape[3]),
               "dtype": str(q.dtype)}
        try:
            if not enabled("flash_attention"):
                raise Unsupported("the flash-attention kernels are switched off (TVM_EVT_DISABLE)")
            spec = attention_of_call(call)
            row.update(causal=spec.causal, dropout=spec.dropout, kernel=True, reason=None)
        except Unsupported as err:
            row.update(kernel=False, reason=err.reason)
        rows.append(row)
    return rows


def conv_calls(func: relax.Function) -> list[dict]:
    """The ``tvm_evt.conv2d*`` calls of `func`, and whether the implicit-GEMM kernels take each."""
    from .codegen.frontend.conv_call import OPS
    from .relax_passes.lower.offload_conv import kernel_spec, stride_phases

    calls = _calls_of(func, OPS)
    rows = []
    for whole in calls:
        phases = stride_phases(whole)  # a strided dgrad: a row per stride phase, which says so
        for call in phases or [whole]:
            spec, reason = kernel_spec(call)
            row = {"op": OPS[call.op.name], "dtype": str(call.args[0].ty.dtype)}
            if spec is not None:
                row.update(x=list(spec.x), w=list(spec.w))
            if phases:
                row["stride_phase_of"] = [int(d) for d in whole.args[3].values]
            rows.append({**row, "kernel": reason is None, "reason": reason})
    return rows + depthwise_calls(func) + tvm_conv_calls(func)


def depthwise_calls(func: relax.Function) -> list[dict]:
    """The ``tvm_evt.depthwise_conv2d*`` calls of `func`: each runs as a direct kernel (``kind``)."""
    from .relax_passes.ops.depthwise_conv_op import OPS, depthwise_shapes

    calls = _calls_of(func, OPS)
    rows = []
    for call in calls:
        x, w, _, _ = depthwise_shapes(call)
        rows.append({"op": OPS[call.op.name], "dtype": str(call.args[0].ty.dtype), "x": list(x), "w": list(w),
                     "groups": x[3], "kernel": True, "kind": "depthwise", "reason": None})
    return rows


TVM_CONVS = ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv2d_transpose")


def tvm_conv_calls(func: relax.Function) -> list[dict]:
    """The convolutions of `func` left as TVM's own ops (grouped ones, and their
    gradients): they run as TVM kernels, not as implicit-GEMM or CUTLASS ones; a row each saying so."""
    calls = _calls_of(func, TVM_CONVS)
    rows = []
    for call in calls:
        groups = int(call.attrs.groups)
        why = f"groups={groups}, which the implicit-GEMM kernels do not take" if groups != 1 else \
            "left a convolution by Conv2dToMatmul (its layout or window)"
        rows.append({"op": call.op.name.rsplit(".", 1)[-1], "dtype": str(call.args[0].ty.dtype),
                     "x": [int(d) for d in call.args[0].ty.shape], "w": [int(d) for d in call.args[1].ty.shape],
                     "groups": groups, "kernel": False, "reason": f"a TVM kernel: {why}"})
    return rows


def training_report(mod: tvm.IRModule, function: str = "train_step", target: tvm.target.Target | None = None) -> dict:
    part = partitioned(mod, function, target)
    report = partition_report(part).get(function, {})
    return {**report, "attention": attention_calls(part[function]), "convolutions": conv_calls(part[function])}


def draw(mod: tvm.IRModule, path: str, function: str = "train_step", title: str = "") -> str:
    """Draw the partitioned ``function`` of an already partitioned ``mod`` into ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # optional dependency: pip install matplotlib
        raise ImportError("report_png needs matplotlib (pip install matplotlib)") from err
    func = mod[function]
    kernels, producer = [], {}
    for block in func.body.blocks:
        for b in block.bindings:
            value = getattr(b, "value", None)
            if not isinstance(value, relax.Call):
                if isinstance(value, relax.TupleGetItem) and value.tuple_value in producer:
                    producer[b.var] = producer[value.tuple_value]
                continue
            callee = mod[value.op] if isinstance(value.op, tvm.ir.GlobalVar) else None
            is_evt = isinstance(callee, relax.Function) and callee.attrs and callee.attrs.get("Codegen") == CODEGEN
            if is_evt:
                ops = _partition_ops(callee)
                label = "GEMM+" + ",".join(_short(o) for o in ops if o not in ("relax.matmul",
                                                                                   "relax.permute_dims", "relax.reshape"))
            else:
                label = _short(value.op.name if isinstance(value.op, tvm.ir.Op) else str(value.op))
            deps = set()
            for arg in _vars(value):
                if arg in producer:
                    deps.add(producer[arg])
            producer[b.var] = len(kernels)
            kernels.append((label, is_evt, sorted(deps)))
    n = len(kernels)
    height = max(4.0, 0.16 * n)
    fig, ax = plt.subplots(figsize=(12, height))
    # x: evt partitions in the left column, TVM ops on the right; y: execution order
    xs = [0.0 if evt else 1.0 for _, evt, _ in kernels]
    for k, (_, _, deps) in enumerate(kernels):
        for d in deps:
            ax.plot([xs[d], xs[k]], [-d, -k], color="#bbbbbb", linewidth=0.4, zorder=1)
    for k, (label, evt, _) in enumerate(kernels):
        if evt:
            ax.text(xs[k], -k, label[:90], fontsize=6, va="center", ha="left", zorder=3,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="#ffd27f", edgecolor="#c07000"))
        else:
            ax.scatter([xs[k]], [-k], s=6, color="#777777", zorder=2)
            ax.text(xs[k] + 0.02, -k, label, fontsize=4, va="center", color="#555555")
    n_evt = sum(1 for _, evt, _ in kernels if evt)
    ax.set_title(title or f"{function}: {n_evt} GEMM+EVT partitions (left), {n - n_evt} TVM ops (right)")
    ax.set_xlim(-0.1, 1.6)
    ax.set_ylim(-n, 1)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _partition_ops(func: relax.Function) -> list[str]:
    ops = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            ops.append(expr.op.name)

    relax.analysis.post_order_visit(func, visit)
    return ops


def _short(name: str) -> str:
    return name.replace("relax.nn.", "").replace("relax.", "")


def _vars(expr):
    out = []
    relax.analysis.post_order_visit(expr, lambda e: out.append(e) if isinstance(e, relax.Var) else None)
    return out
