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


def torch_cuda_step(entry, inputs, autocast: bool):
    """Loss and {name: float64 gradient} by torch on the GPU, on a copy of the entry's model: in
    fp32, or under bf16 autocast."""
    module = copy.deepcopy(entry.training_module()).cuda().train()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = module(*[t.cuda() for t in inputs])
    loss.float().backward()
    model = module.model if hasattr(module, "loss_fn") else module
    return loss.float().cpu(), {n: p.grad.double().cpu() for n, p in model.named_parameters() if p.grad is not None}


AMP_SLACK = 1.5  # our bf16 gradients may be this much further from fp32 than autocast's


def assert_bf16_step_close(step, entry, inputs) -> tuple[float, float]:
    """A bf16 step's loss and gradients on `inputs` against torch in fp32, with torch's own bf16
    autocast as the yardstick: on a tiny batch-norm net (statistics over 512 positions) autocast
    itself is 2-4 % off fp32, so a fixed bound against the autocast result would compare two noises.
    Returns the two errors of all gradients together (ours, autocast's) against fp32."""
    loss, grads = step.loss_and_grads(*[t.cuda() for t in inputs])
    grads = {n: g.double().cpu() for n, g in grads.items()}
    ref_loss, ref_grads = torch_cuda_step(entry, inputs, autocast=False)
    amp_loss, amp_grads = torch_cuda_step(entry, inputs, autocast=True)
    assert rel_err(loss.cpu(), ref_loss) <= max(2e-2, 1.5 * rel_err(amp_loss, ref_loss)), (float(loss), float(ref_loss))
    assert set(ref_grads) <= set(grads), set(ref_grads) - set(grads)
    names = sorted(ref_grads)
    flat = lambda gs: torch.cat([gs[n].flatten() for n in names])
    largest = max(float(g.norm()) for g in ref_grads.values())
    errs = {n: (grad_err(grads[n], ref_grads[n], 100 * largest), grad_err(amp_grads[n], ref_grads[n], 100 * largest))
            for n in names}
    worst = sorted(errs.items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1e-3))[:5]  # (ours, autocast's)
    ours, autocast = rel_err(flat(grads), flat(ref_grads)), rel_err(flat(amp_grads), flat(ref_grads))
    assert ours <= max(2e-2, AMP_SLACK * autocast), (ours, autocast, worst)
    assert all(e <= max(5e-2, 2 * AMP_SLACK * a) for e, a in errs.values()), worst
    return ours, autocast


# the error of every gradient, relative to the largest gradient's norm
GRAD_TOL = 1e-4


def matches_torch(module, inputs, loss_fn=None) -> tuple[dict, dict]:
    """Compile `module` (its loss: ``loss_fn(module(*inputs[:-1]), inputs[-1])``, or the module's
    own output without `loss_fn`) for the CPU; its loss and every gradient equal torch fp32's.
    Returns (our gradients, the module's parameters with torch's gradients)."""
    import tvm_evt

    step = tvm_evt.compile_training(module, inputs, loss_fn=loss_fn, target="llvm")
    loss, grads = step.loss_and_grads(*inputs)
    module.zero_grad()
    ref = loss_fn(module(*inputs[:-1]), inputs[-1]) if loss_fn else module(*inputs)
    ref.backward()
    params = dict(module.named_parameters())
    assert abs(float(loss) - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    assert set(grads) == set(params)
    largest = max(p.grad.norm() for p in params.values())
    for name, p in params.items():
        err = float((grads[name] - p.grad).norm() / largest)
        assert err <= GRAD_TOL, f"{name}: {err:.2e}"
    return grads, params
