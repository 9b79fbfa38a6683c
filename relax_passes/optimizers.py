"""Optimizers whose update is emitted as Relax ops inside the training step.

Each optimizer is a frozen dataclass with the hyper-parameters of its torch.optim twin and
two methods: `slots` (per-parameter state tensors, zero-initialised) and `update`, which
emits the new parameter and state for one parameter.  Semantics follow torch.optim
(``foreach``-free reference formulas) so a compiled step tracks torch's trajectory.
"""

from __future__ import annotations

import dataclasses

from tvm import relax
from tvm.relax import op as R


def _c(value: float, dtype: str = "float32") -> relax.Constant:
    return relax.const(value, dtype)


@dataclasses.dataclass(frozen=True)
class SGD:
    """torch.optim.SGD: weight decay, momentum with dampening, Nesterov."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def slots(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def update(self, bb: relax.BlockBuilder, p, g, state: dict, step) -> tuple:
        if self.weight_decay:
            g = bb.emit(R.add(g, R.multiply(p, _c(self.weight_decay))))
        new_state = {}
        if self.momentum:
            buf = state["momentum_buffer"]
            damped = R.multiply(g, _c(1.0 - self.dampening)) if self.dampening else g
            buf = bb.emit(R.add(R.multiply(buf, _c(self.momentum)), damped))
            if self.dampening:  # torch starts the buffer at g itself, undamped
                buf = bb.emit(R.where(R.equal(step, _c(1.0)), g, buf))
            new_state["momentum_buffer"] = buf
            g = bb.emit(R.add(g, R.multiply(buf, _c(self.momentum)))) if self.nesterov else buf
        return bb.emit(R.subtract(p, R.multiply(g, _c(self.lr)))), new_state


@dataclasses.dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW (decoupled weight decay, bias correction, no amsgrad)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def slots(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def update(self, bb: relax.BlockBuilder, p, g, state: dict, step) -> tuple:
        b1, b2 = self.betas
        if self.weight_decay:
            p = bb.emit(R.multiply(p, _c(1.0 - self.lr * self.weight_decay)))
        m = bb.emit(R.add(R.multiply(state["exp_avg"], _c(b1)), R.multiply(g, _c(1.0 - b1))))
        v = bb.emit(
            R.add(R.multiply(state["exp_avg_sq"], _c(b2)), R.multiply(R.multiply(g, g), _c(1.0 - b2)))
        )
        bc1 = R.subtract(_c(1.0), R.power(_c(b1), step))
        bc2 = R.subtract(_c(1.0), R.power(_c(b2), step))
        step_size = bb.emit(R.divide(_c(self.lr), bc1))
        denom = bb.emit(R.add(R.divide(R.sqrt(v), R.sqrt(bc2)), _c(self.eps)))
        new_p = bb.emit(R.subtract(p, R.multiply(step_size, R.divide(m, denom))))
        return new_p, {"exp_avg": m, "exp_avg_sq": v}


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """torch.amp.GradScaler's policy: skip steps with inf/nan grads and back off, grow the
    scale after `growth_interval` clean steps."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def from_torch_optimizer(opt) -> SGD | AdamW:
    """The equivalent tvm_evt optimizer of a torch.optim.SGD / AdamW instance (group 0)."""
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
