"""scripts/bench_tir.py's kernels (no GPU): what it times is what ScheduleTIRForGPU schedules."""
import pytest
import tvm_ffi
from tvm import tirx

from tvm_evt import bench_tir


def _thread_loops(func) -> dict[str, int]:
    loops = {}

    def visit(node):
        if node.thread_binding is not None:
            loops[node.thread_binding.thread_tag] = int(node.extent)

    tvm_ffi.structural_walk(func.body, (tirx.For, visit))
    return loops


@pytest.mark.slow
def test_llama_loss_max_is_timed_under_our_rules_and_dlight_s():
    """``bench_tir.py hf_llama --match max --dlight --quick``'s kernels (45 s on 2 cores): the
    cross-entropy's max over the 32000 vocabulary, a block a row under our rules (RowReduction)
    and one thread a row under DLight's alone (Fallback, what it took before: 21.4 ms a step at
    batch 4 x 2048 on H200)."""
    kernels = bench_tir.scheduled_kernels("hf_llama", match="max", dlight=True, quick=True)
    assert set(kernels) == {None, bench_tir.DLIGHT}
    (name,) = kernels[None]
    assert set(kernels[bench_tir.DLIGHT]) == {name}
    ours, dlight = kernels[None][name], kernels[bench_tir.DLIGHT][name]
    assert [int(s) for s in ours.params[0].shape] == [512, 32000]  # --quick: batch 1 x seq 512
    assert _thread_loops(ours) == {"blockIdx.x": 512, "threadIdx.x": 64}
    assert _thread_loops(dlight) == {"blockIdx.x": 1, "threadIdx.x": 1024}
    assert all(int(f.attrs["tirx.is_scheduled"]) == 1 for f in (ours, dlight))
    assert not tvm_ffi.structural_equal(ours, dlight)


@pytest.mark.slow
def test_norm_blocks_variants_regroup_the_norm_gradient_rows():
    """``bench_tir.py hf_llama --quick --match rms_norm_grad --norm-blocks 32``: at --quick's 512
    rows the default (groups filling the GPU's 528 blocks) leaves no room for weight-gradient partials; at 32
    blocks a block walks 16 rows.  The knob is back at its default after."""
    from tvm_evt.relax_passes.lower import _row_kernel

    kernels = bench_tir.scheduled_kernels("hf_llama", match="rms_norm_grad", quick=True, norm_blocks=[32])
    assert kernels[None] and not any("_sum_dy_xhat" in name for name in kernels[None])
    assert kernels["blocks=32"] and all("_sum_dy_xhat_g16" in name for name in kernels["blocks=32"])
    assert _thread_loops(next(iter(kernels["blocks=32"].values())))["blockIdx.x"] == 32
    assert _row_kernel.GROUP_BLOCKS is None


def test_wgrad_threads_variants_cut_the_depthwise_weight_gradient_into_fewer_groups():
    """``bench_tir.py --wgrad-threads``: a 5x5 depthwise convolution's weight gradient, its first
    stage cut for the default thread target (groups of 4 of the 8 x 14 output lines: 28 groups) and
    for 224 threads in all (2 channel pairs' 32 threads a warp: groups of 16 lines, 7 groups); each
    stage's partial sums as many as its groups; with ``--wgrad-columns 0`` laid out [G, R, S, K].
    The knobs are back at their defaults after."""
    import torch
    from torch import nn

    from tvm_evt import models
    from tvm_evt.relax_passes.ops import depthwise_conv_op as dwc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 5, padding=2, groups=64, bias=False), nn.Flatten(), nn.Linear(64 * 14 * 14, 10))
    x = torch.randn(8, 64, 14, 14).contiguous(memory_format=torch.channels_last)
    entry = models.ZooEntry(model.to(memory_format=torch.channels_last), lambda: (x, torch.randint(0, 10, (8,))),
                            nn.functional.cross_entropy, "depthwise 5x5", num_targets=1)
    default = dwc.TARGET_THREADS, dwc.COLUMN_PARTIALS
    both = "depthwise_conv_op.TARGET_THREADS=224 depthwise_conv_op.COLUMN_PARTIALS=0"
    kernels = bench_tir.scheduled_kernels("", match="depthwise_conv2d_wgrad", entry=entry, wgrad_threads=[224],
                                          wgrad_columns=[0], settings=[both])
    shapes = {variant: [[int(d) for d in f.params[-1].shape] for f in funcs.values()] for variant, funcs in kernels.items()}
    assert shapes == {None: [[64, 5, 5, 28]], "wgrad_threads=224": [[64, 5, 5, 7]], "wgrad_columns=0": [[28, 5, 5, 64]],
                      both: [[7, 5, 5, 64]]}
    assert (dwc.TARGET_THREADS, dwc.COLUMN_PARTIALS) == default


@pytest.mark.parametrize("setting, error", [
    ("depthwise_conv_op.TARGET_THREADS", "is not module.NAME=value"),
    ("no_such_module.X=1", "names 0 modules"),
    ("depthwise_conv_op.NO_SUCH=1", "has no NO_SUCH"),
])
def test_settings_that_name_nothing_are_refused(setting, error):
    with pytest.raises(ValueError, match=error):
        bench_tir.parse_setting(setting)


def test_settings_parse_python_literals():
    from tvm_evt.relax_passes.lower import _row_kernel
    from tvm_evt.relax_passes.ops import depthwise_conv_op

    assert bench_tir.parse_setting("depthwise_conv_op.COLUMN_PARTIALS=None _row_kernel.GROUP_BLOCKS=264") == [
        (depthwise_conv_op, "COLUMN_PARTIALS", None), (_row_kernel, "GROUP_BLOCKS", 264)]
