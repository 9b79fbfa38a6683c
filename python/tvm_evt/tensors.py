"""torch ↔ TVM tensors of a compiled step: zero-copy DLPack conversion and the checked
arguments of a step's inputs (shared by `training.TrainingStep` and `distributed.DataParallelStep`)."""

from __future__ import annotations

from typing import Sequence

import tvm

from .errors import InputMismatchError
from .frontend import NCHW_TO_NHWC, ImportedModel


def to_tvm(t, device):
    """torch tensor → TVM tensor on `device`, zero-copy through DLPack when possible."""
    if device.dlpack_device_type() == 2 and t.device.type != "cuda":  # kDLCUDA
        t = t.to(f"cuda:{device.index}")
    elif device.dlpack_device_type() == 1 and t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    try:
        return tvm.runtime.from_dlpack(t)
    except Exception:  # a view at an offset TVM finds misaligned (it asks for 64 bytes): copy
        return tvm.runtime.from_dlpack(t.clone())


def to_torch(x):
    """TVM tensor → torch tensor sharing its memory."""
    import torch

    return torch.from_dlpack(x)


def input_arguments(imported: ImportedModel, inputs: Sequence, device) -> list:
    """The step's inputs as TVM tensors on `device`, after checking each against the shape and
    dtype the step was compiled for (`InputMismatchError` naming the input otherwise)."""
    specs, names = imported.input_specs, imported.input_names
    if len(inputs) != len(specs):
        raise InputMismatchError(
            f"training step takes {len(specs)} inputs ({', '.join(names)}), got {len(inputs)}"
        )
    out = []
    for i, (name, t, (shape, dtype)) in enumerate(zip(names, inputs, specs)):
        got_dtype = str(t.dtype).replace("torch.", "")
        if tuple(t.shape) != shape or got_dtype != dtype:
            raise InputMismatchError(
                f"input '{name}': expected shape {list(shape)} dtype {dtype}, "
                f"got shape {list(t.shape)} dtype {got_dtype}"
            )
        if imported.takes_channels_last(i):  # NHWC memory: in place when t is channels-last
            t = t.permute(*NCHW_TO_NHWC)
        out.append(to_tvm(t, device))
    return out
