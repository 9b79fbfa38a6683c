"""``F.interpolate`` imported as takes with torch's coordinates (converters._make_upsample): loss and
gradients equal torch fp32 for nearest, nearest-exact and bilinear, by size or scale factor, up and
down, integer and not, with and without align_corners; and the rows the nearest mode picks are
torch's where TVM's resize2d would round half-pixel coordinates instead."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvm_evt
from tvm_evt.converters import _source_index

MODES = [dict(scale_factor=2, mode="nearest"), dict(size=(10, 11), mode="nearest"),
         dict(scale_factor=1.5, mode="nearest-exact"), dict(scale_factor=2, mode="bilinear"),
         dict(size=(10, 13), mode="bilinear"), dict(size=(5, 9), mode="bilinear", align_corners=True),
         dict(scale_factor=0.5, mode="bilinear"), dict(scale_factor=2.5, mode="bilinear", align_corners=False)]


class _Up(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.conv, self.kw = nn.Conv2d(3, 4, 3, padding=1), kw

    def forward(self, x):
        return F.interpolate(self.conv(x), **self.kw)


@pytest.mark.parametrize("kw", MODES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_interpolate_matches_torch(kw):
    torch.manual_seed(0)
    model, x = _Up(**kw), torch.randn(2, 3, 7, 6)
    y = torch.randn_like(model(x))
    step = tvm_evt.compile_training(copy.deepcopy(model), (x, y), loss_fn=F.mse_loss, target="llvm")
    loss, grads = step.loss_and_grads(x, y)
    ref = F.mse_loss(model(x), y)
    ref.backward()
    assert abs(float(loss) - ref.item()) <= 1e-5 * max(1.0, ref.item())
    largest = max(float(p.grad.norm()) for p in model.parameters())
    for n, p in model.named_parameters():
        assert float((grads[n] - p.grad).norm()) / largest <= 1e-5, n


def test_nearest_picks_torchs_rows_where_half_pixel_rounding_would_not():
    # 7 rows to 10: torch floors dst * 0.7; half-pixel rounding takes row 1 for output 1
    rows = _source_index(7, 10, None, align_corners=False, exact=False, linear=False)
    marked = torch.arange(7.0).reshape(1, 1, 7, 1)
    assert rows.tolist() == F.interpolate(marked, size=(10, 1), mode="nearest").flatten().tolist()
    assert np.round((np.arange(10) + 0.5) * 0.7 - 0.5).astype(int)[1] != int(rows[1])
