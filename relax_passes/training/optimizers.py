"""Optimizers of the training step: the per-element update formula of each parameter.

Each optimizer is a frozen dataclass with the hyper-parameters of its torch.optim twin (and
``max_grad_norm``: the gradients clipped to that 2-norm over all of them first, as
``torch.nn.utils.clip_grad_norm_`` does before ``optimizer.step()``) and two methods: `slots`
(per-parameter state tensors, zero-initialised) and `elementwise`, which gives one element's new
parameter and state as float32 TIR expressions of the old ones, the gradient and the step count.
``optimizer_update`` builds every parameter's update into one kernel from it (a deep model's into
one a repeat of its layers).  Semantics follow torch.optim (``foreach``-free reference formulas) so a
compiled step tracks torch's trajectory.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx


def _c(value: float) -> tirx.PrimExpr:
    return tirx.const(value, "float32")


@dataclasses.dataclass(frozen=True)
class SGD:
    """torch.optim.SGD: weight decay, momentum with dampening, Nesterov."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    max_grad_norm: float | None = None  # torch.nn.utils.clip_grad_norm_ before the update (AppendOptimizer)

    def slots(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def elementwise(self, p, g, state: dict, step) -> tuple:
        if self.weight_decay:
            g = g + p * _c(self.weight_decay)
        new_state = {}
        if self.momentum:
            damped = g * _c(1.0 - self.dampening) if self.dampening else g
            buf = state["momentum_buffer"] * _c(self.momentum) + damped
            if self.dampening:  # torch starts the buffer at g itself, undamped
                buf = tirx.Select(step == _c(1.0), g, buf)
            new_state["momentum_buffer"] = buf
            g = g + buf * _c(self.momentum) if self.nesterov else buf
        return p - g * _c(self.lr), new_state


@dataclasses.dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW (decoupled weight decay, bias correction, no amsgrad)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float | None = None  # torch.nn.utils.clip_grad_norm_ before the update (AppendOptimizer)

    def slots(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def elementwise(self, p, g, state: dict, step) -> tuple:
        b1, b2 = self.betas
        if self.weight_decay:
            p = p * _c(1.0 - self.lr * self.weight_decay)
        m = state["exp_avg"] * _c(b1) + g * _c(1.0 - b1)
        v = state["exp_avg_sq"] * _c(b2) + g * g * _c(1.0 - b2)
        bc1 = _c(1.0) - tirx.power(_c(b1), step)
        bc2 = _c(1.0) - tirx.power(_c(b2), step)
        denom = tirx.sqrt(v) / tirx.sqrt(bc2) + _c(self.eps)
        return p - _c(self.lr) / bc1 * (m / denom), {"exp_avg": m, "exp_avg_sq": v}


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """torch.amp.GradScaler's policy: skip steps with inf/nan grads and back off, grow the
    scale after `growth_interval` clean steps."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def from_torch_optimizer(opt) -> SGD | AdamW:
    """The equivalent tvm_evt optimizer of a torch.optim.SGD / AdamW instance (group 0).  Gradient
    clipping is not the torch optimizer's: pass a tvm_evt optimizer with ``max_grad_norm``."""
    import torch

    group = opt.param_groups[0]
    if type(opt) is torch.optim.SGD:
        return SGD(
            lr=float(group["lr"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
        )
    if type(opt) is torch.optim.AdamW and not group.get("amsgrad", False):
        return AdamW(
            lr=float(group["lr"]),
            betas=tuple(float(b) for b in group["betas"]),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
        )
    raise NotImplementedError(
        f"optimizer {type(opt).__name__} (options {sorted(group)}) is not supported; "
        "use tvm_evt.optim.SGD or tvm_evt.optim.AdamW"
    )
