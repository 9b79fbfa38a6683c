"""codegen.bench_conv: the convolution benchmark's variants, emitted without a GPU."""
from __future__ import annotations

import pytest

from tvm_evt.codegen import bench_conv
from tvm_evt.codegen.backend.conv import MAX_SPLITS, emit_conv, splits, tile
from tvm_evt.codegen.errors import Unsupported


def test_each_kernel_is_timed_first_as_built_then_under_other_tiles_and_chunks():
    calls = bench_conv.case_calls("conv3_3x3")
    assert set(calls) == {"fprop", "dgrad", "wgrad"}
    wgrad = calls["wgrad"]
    found = bench_conv.variants(wgrad)
    assert found[0] == (tile(wgrad), splits(wgrad)) and len(set(found)) == len(found)
    assert {c for _, c in found} == {1, splits(wgrad) // 2, splits(wgrad), min(MAX_SPLITS, 2 * splits(wgrad))}
    assert {c for _, c in bench_conv.variants(calls["fprop"])} == {1}
    # 64 channels fill no 128-wide tile of a filter tap, nor 64 filters a 128-row one
    assert {t for t, _ in bench_conv.variants(bench_conv.case_calls("conv2_3x3")["wgrad"])} == {(64, 64, 64)}
    # ... whose forward and input gradient (401408 pixels, 64 channels) also try 256x64 tiles
    for kind in ("fprop", "dgrad"):
        assert (256, 64, 64) in {t for t, _ in bench_conv.variants(bench_conv.case_calls("conv2_3x3")[kind])}
    assert (256, 64, 64) not in {t for t, _ in bench_conv.variants(calls["fprop"])}  # 128 channels


def test_a_variant_is_its_own_source_and_names_its_tile_and_chunks():
    wgrad = bench_conv.case_calls("conv3_3x3")["wgrad"]
    built = emit_conv(wgrad)
    assert emit_conv(wgrad, tile(wgrad), splits(wgrad)) == built
    other = emit_conv(wgrad, (64, 128, 64), 4)
    assert other != built and "64x128x64, split 4" in other
    sources, refused = bench_conv.sources([wgrad])
    assert not refused and len(sources) == len(bench_conv.variants(wgrad))


def test_batch_chunks_are_for_weight_gradients_within_the_side_streams():
    calls = bench_conv.case_calls("conv3_3x3")
    with pytest.raises(Unsupported, match="weight gradients only"):
        emit_conv(calls["fprop"], chunks=2)
    with pytest.raises(Unsupported, match="batch chunks"):
        emit_conv(calls["wgrad"], chunks=MAX_SPLITS + 1)
