"""Helpers shared by the training tests: torch references and error measures."""

from __future__ import annotations

import copy

import torch


def rel_err(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grad_err(a, b, scale: float) -> float:
    """‖a−b‖ / max(‖b‖, 1e-3·scale): relative error, except for gradients that vanish in
    exact arithmetic (a key bias under softmax), where only rounding noise is left to compare
    and the yardstick is a thousandth of the model's overall gradient norm."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / max(float(b.norm()), 1e-3 * scale, 1e-30))


def no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    return model


def torch_loss_and_grads(entry, inputs):
    """Loss and {name: grad} of a zoo entry by torch autograd, on a copy of its model."""
    module = copy.deepcopy(entry.training_module()).train()
    loss = module(*inputs)
    loss.backward()
    model = module.model if hasattr(module, "loss_fn") else module
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, model


def assert_step_matches_torch(step, entry, inputs, torch_inputs=None, tol: float = 1e-4) -> None:
    """The compiled `step`'s loss and gradients on `inputs` against torch autograd's on
    `torch_inputs` (the same `inputs` by default), each gradient by `grad_err`."""
    ref_loss, ref_grads, _ = torch_loss_and_grads(entry, inputs if torch_inputs is None else torch_inputs)
    loss, grads = step.loss_and_grads(*inputs)
    assert rel_err(loss, ref_loss) <= tol
    assert set(ref_grads) <= set(grads), set(ref_grads) - set(grads)
    scale = float(torch.stack([g.double().norm() for g in ref_grads.values()]).norm())
    errs = {n: grad_err(grads[n], g, scale) for n, g in ref_grads.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{worst}: {errs[worst]:.3g}"
