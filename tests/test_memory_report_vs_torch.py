"""The memory report against torch's own accounting, on models transformers builds: the parameters,
their gradients and AdamW's two slots are the bytes torch allocates for them, exactly; the
activations the step keeps for its backward are at most the tensors torch's autograd saves for the
same forward (counted by storage, the parameters left out).  fp32 on llvm: both sides keep the same
dtype, so the bytes compare one for one."""
import pytest
import torch

from tvm_evt import compile_training, models
from tvm_evt.relax_passes.training.optimizers import AdamW

transformers = pytest.importorskip("transformers")

CASES = {
    "bert": lambda: models.hf_bert_mlm(batch=2, seq=32, layers=2, hidden=64, heads=4, vocab=256, dropout=0.1),
    "gpt2": lambda: models.hf_gpt2_lm(batch=2, seq=32, layers=2, hidden=64, heads=4, vocab=256, dropout=0.1),
}


def _torch_accounting(module: torch.nn.Module, inputs: tuple) -> dict:
    """Bytes of torch's own tensors for one AdamW step of `module`: parameters, gradients, AdamW's
    exp_avg and exp_avg_sq, and the storages autograd saves for the backward (not parameters)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(*inputs)
    loss.backward()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    opt.step()
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    return {"parameters": sum(nbytes(p) for p in module.parameters()),
            "gradients": sum(nbytes(p.grad) for p in module.parameters()),
            "optimizer_state": sum(nbytes(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")),
            "saved_activations": sum(saved.values())}


@pytest.mark.parametrize("name", sorted(CASES))
def test_categories_match_torchs_tensors(name):
    torch.manual_seed(0)
    entry = CASES[name]()
    step = compile_training(entry.training_module(), entry.example_inputs(), optimizer=AdamW(lr=1e-4), target="llvm")
    ours = step.memory_report()["categories"]
    torch.manual_seed(0)
    theirs = _torch_accounting(CASES[name]().training_module(), entry.example_inputs())
    for category in ("parameters", "gradients", "optimizer_state"):
        assert ours[category] == theirs[category], category  # tied embeddings: one parameter on both sides
    assert 0 < ours["saved_activations"] <= theirs["saved_activations"]
