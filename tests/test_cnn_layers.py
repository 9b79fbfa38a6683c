"""Convolutional layers as torchvision writes them (torchvision's wheel does not load on the CPU
torch build, so they are written here after its definitions): under the default rewrites every
one compiles on the CPU route and its loss and every gradient equal torch fp32 — the 7x7/2 stem,
depthwise convolutions (direct kernels: ``tvm_evt.depthwise_conv2d``), grouped ones that stay
convolutions, stride-2 downsamples, dilation; and torchvision's other ``norm_layer`` choices: group
norm, instance norm, batch norm without running statistics; and upsampling as an FPN's top-down step
and a segmentation head write it (``F.interpolate``, nearest and bilinear), and as a U-Net's decoder
does (``ConvTranspose2d``, with circular padding after)."""
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvm_evt

GRAD_TOL = 1e-4  # of the largest gradient's norm


def _stem(width: int = 16) -> nn.Module:  # torchvision.models.resnet: conv1, bn1, relu, maxpool
    return nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1))


class _BasicBlock(nn.Module):  # torchvision.models.resnet.BasicBlock with a 1x1/2 downsample
    def __init__(self, cin: int, cout: int, stride: int = 1, groups: int = 1, dilation: int = 1,
                 norm=nn.BatchNorm2d):  # (torchvision's norm_layer)
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, dilation, dilation=dilation, groups=groups, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class _Bottleneck(nn.Module):  # torchvision.models.resnet.Bottleneck (v1.5: the stride on the 3x3)
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def resnet(block: str, layers: tuple[int, ...], classes: int = 1000, width: int = 64) -> nn.Module:
    """torchvision.models.resnet.ResNet: the stem, four stages of `layers` blocks (widths `width`,
    2x, 4x, 8x; the first block of stages 2-4 strided), global average pooling and the head.
    ``resnet("basic", (2, 2, 2, 2))`` is resnet18, ``resnet("bottleneck", (3, 4, 6, 3))`` resnet50."""
    stages, cin = [], width
    for i, n in enumerate(layers):
        planes = width * 2**i
        blocks = []
        for j in range(n):
            stride = 2 if i > 0 and j == 0 else 1
            if block == "basic":
                blocks.append(_BasicBlock(cin, planes, stride))
                cin = planes
            else:
                blocks.append(_Bottleneck(cin, planes, stride))
                cin = planes * _Bottleneck.expansion
        stages.append(nn.Sequential(*blocks))
    return _classifier(nn.Sequential(_stem(width), *stages), cin, classes)


def resnet18(classes: int = 1000) -> nn.Module:
    return resnet("basic", (2, 2, 2, 2), classes)


def resnet50(classes: int = 1000) -> nn.Module:
    return resnet("bottleneck", (3, 4, 6, 3), classes)


class _InvertedResidual(nn.Module):  # torchvision.models.mobilenetv2.InvertedResidual
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class _SqueezeExcitation(nn.Module):  # torchvision.ops.SqueezeExcitation as mobilenetv3 uses it
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        scale = self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1))))
        return x * F.hardsigmoid(scale)


def _mobilenet_v3_block(cin: int, hidden: int, cout: int, stride: int) -> nn.Module:
    """torchvision.models.mobilenetv3.InvertedResidual with SE and hard-swish (no residual)."""
    return nn.Sequential(
        nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(),
        nn.Conv2d(hidden, hidden, 5, stride, 2, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(),
        _SqueezeExcitation(hidden, 8), nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))


class _TopDown(nn.Module):
    """torchvision.ops.FeaturePyramidNetwork's top-down step (the coarser map upsampled to the
    finer one's size, nearest, added to its lateral 1x1), then a bilinear x1.5 (``F.interpolate``
    as segmentation heads use it; not an integer factor)."""

    def __init__(self, cin: int, width: int):
        super().__init__()
        self.down, self.lateral = nn.Conv2d(cin, width, 3, 2, 1), nn.Conv2d(cin, width, 1)
        self.out = nn.Conv2d(width, width, 3, 1, 1)

    def forward(self, x):
        coarse = F.relu(self.down(x))
        fine = self.lateral(x) + F.interpolate(coarse, size=x.shape[-2:], mode="nearest")
        return F.interpolate(self.out(fine), scale_factor=1.5, mode="bilinear", align_corners=False)


class _UNetUp(nn.Module):
    """A U-Net decoder step (segmentation_models' and diffusers' ``Upsample`` with a transposed
    convolution): the coarse map doubled by ``ConvTranspose2d(2, stride 2)``, concatenated with
    the skip, then a 3x3 convolution with circular padding (periodic boundaries); a second
    transposed convolution with output padding and dilation."""

    def __init__(self, cin: int, width: int):
        super().__init__()
        self.down = nn.Conv2d(cin, width, 3, 2, 1)
        self.up = nn.ConvTranspose2d(width, width, 2, 2)
        self.fuse = nn.Conv2d(width + cin, width, 3, 1, 1, padding_mode="circular")
        self.up2 = nn.ConvTranspose2d(width, width, 3, 2, 2, output_padding=1, dilation=2, groups=2)

    def forward(self, x):
        coarse = F.relu(self.down(x))
        return self.up2(F.relu(self.fuse(torch.cat([self.up(coarse), x], 1))))


class _ChannelShuffle(nn.Module):  # torchvision.models.shufflenetv2.channel_shuffle
    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    def forward(self, x):
        b, c, h, w = x.shape
        return x.view(b, self.groups, c // self.groups, h, w).transpose(1, 2).contiguous().view(b, c, h, w)


def _classifier(body: nn.Module, channels: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


MODELS = {
    "resnet_stem": lambda: _classifier(nn.Sequential(_stem(), _BasicBlock(16, 16)), 16),
    "basic_block_stride2": lambda: _classifier(_BasicBlock(8, 16, stride=2), 16),
    "resnext_grouped": lambda: _classifier(_BasicBlock(16, 16, groups=4), 16),
    "dilated": lambda: _classifier(_BasicBlock(8, 8, dilation=2), 8),
    # other norm_layers: group norm (timm's resnet*_gn), one without affine parameters; instance
    # norm; batch norm without running statistics (normalised over the batch, like training mode)
    "group_norm": lambda: _classifier(_BasicBlock(8, 16, stride=2, norm=lambda c: nn.GroupNorm(4, c)), 16),
    "group_norm_no_affine": lambda: _classifier(_BasicBlock(8, 8, norm=lambda c: nn.GroupNorm(2, c, affine=False)), 8),
    "instance_norm": lambda: _classifier(_BasicBlock(8, 8, norm=lambda c: nn.InstanceNorm2d(c, affine=True)), 8),
    "fpn_upsample": lambda: _classifier(nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), _TopDown(8, 8)), 8),
    "unet_up": lambda: _classifier(nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), _UNetUp(8, 8)), 8),
    "batch_norm_no_running_stats": lambda: _classifier(
        _BasicBlock(8, 16, stride=2, norm=lambda c: nn.BatchNorm2d(c, track_running_stats=False)), 16),
    "mobilenet_v2_blocks": lambda: _classifier(nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
        _InvertedResidual(8, 8, 1, 4), _InvertedResidual(8, 16, 2, 4)), 16),
    # a channel shuffle before a grouped convolution (NCHW after the shuffle's views); a circular
    # 3x3 and an adaptive average pool whose windows overlap (14 -> 3)
    "shuffle_grouped": lambda: _classifier(nn.Sequential(
        nn.Conv2d(3, 8, 3), _ChannelShuffle(2), nn.Conv2d(8, 8, 3, groups=2)), 8),
    "circular_odd_pool": lambda: _classifier(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding_mode="circular", padding=1), nn.AdaptiveAvgPool2d(3), nn.ReLU()), 8),
    "mobilenet_v3_blocks": lambda: _classifier(nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
        _mobilenet_v3_block(16, 32, 24, 2)), 24),
}


FROM_IMAGES = ("resnet_stem", "mobilenet_v2_blocks", "mobilenet_v3_blocks", "fpn_upsample", "unet_up",
               "shuffle_grouped", "circular_odd_pool")  # the models whose first layer takes 3 channels


def _in_channels(name: str, model: nn.Module) -> int:
    return 3 if name in FROM_IMAGES else model[0].conv1.in_channels


def _torch_step(model, reference: dict, x, y) -> tuple:
    """(torch's fp32 loss, the parameters with their gradients, the largest gradient's norm) of
    `model` from the `reference` state (tracing ran the model once: batch-norm statistics moved)."""
    model.load_state_dict(reference)
    model.zero_grad()
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    params = dict(model.named_parameters())
    return ref, params, max(float(p.grad.norm()) for p in params.values())


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cnn_layers_match_torch(name, channels_last):
    torch.manual_seed(0)
    model = MODELS[name]()
    cin = _in_channels(name, model)
    x, y = torch.randn(2, cin, 15 if name == "fpn_upsample" else 16, 16), torch.randint(0, 10, (2,))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    step = tvm_evt.compile_training(model, (x, y), loss_fn=F.cross_entropy, target="llvm")
    loss, grads = step.loss_and_grads(x, y)
    ref, params, largest = _torch_step(model, reference, x, y)
    assert abs(float(loss) - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    for n, p in params.items():
        err = float((grads[n] - p.grad).norm()) / largest
        assert err <= GRAD_TOL, f"{n}: {err:.2e}"


@pytest.mark.parametrize("name", ["instance_norm", "batch_norm_no_running_stats", "group_norm", "unet_up"])
def test_normalisations_and_transposed_convolutions_compile_and_match_in_bf16(name):
    """Mixed precision keeps these norms in float32 (TVM legalises no bf16 instance norm: the bf16
    step did not compile, on the GPU as here); a transposed convolution runs bf16 into bf16 (its
    float32 result handed float32 gradients to bf16 values: Gradient failed on the dtypes); loss
    and gradients as bf16 allows."""
    torch.manual_seed(0)
    model = MODELS[name]()
    cin = _in_channels(name, model)
    x, y = torch.randn(4, cin, 16, 16), torch.randint(0, 10, (4,))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    step = tvm_evt.compile_training(model, (x, y), loss_fn=F.cross_entropy, target="llvm", precision="bf16")
    loss, grads = step.loss_and_grads(x, y)
    ref, params, largest = _torch_step(model, reference, x, y)
    assert abs(float(loss) - ref.item()) <= 2e-2 * max(1.0, abs(ref.item()))
    flat = lambda gs: torch.cat([gs[n].float().flatten() for n in params])  # noqa: E731
    assert float((flat(grads) - flat({n: p.grad for n, p in params.items()})).norm()) <= 5e-2 * largest


def test_stem_gemms_reach_cutlass_on_the_cuda_route():
    """A 7x7/2 stem on 3 channels, which the implicit-GEMM kernels refuse (C = 3), and a 10-class
    head, partitioned for sm_90a in bf16: every matmul is a CUTLASS partition (the head's N = 10
    through PadUnalignedMatmuls; without it, the one left to TVM), and the refusal is reported
    with its reason."""
    import tvm

    from tvm_evt.report import training_report

    torch.manual_seed(0)
    x = torch.randn(8, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    imported = tvm_evt.from_torch(MODELS["resnet_stem"](), (x, torch.randint(0, 10, (8,))), F.cross_entropy)
    graph = tvm_evt.build_training_module(imported, None, "bf16")
    report = training_report(graph.mod, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    assert report["unfused_matmuls"] == [], report["unfused_matmuls"]
    refused = [c for c in report["convolutions"] if not c["kernel"]]
    assert refused and all("C=3" in c["reason"] for c in refused), report["convolutions"]


def test_depthwise_convolutions_run_as_direct_kernels_and_grouped_ones_are_reported():
    """Partitioned for sm_90a in bf16: a MobileNetV2 block's depthwise convolutions and their two
    gradients are ``tvm_evt.depthwise_conv2d*`` calls, reported as direct kernels; a grouped
    (ResNeXt) convolution stays a TVM op, reported with the reason."""
    import tvm

    from tvm_evt.report import training_report

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    torch.manual_seed(0)
    rows = {}
    for name, cin in (("mobilenet_v2_blocks", 3), ("resnext_grouped", 16)):
        x = torch.randn(4, cin, 16, 16).contiguous(memory_format=torch.channels_last)
        imported = tvm_evt.from_torch(MODELS[name](), (x, torch.randint(0, 10, (4,))), F.cross_entropy)
        graph = tvm_evt.build_training_module(imported, None, "bf16")
        rows[name] = [c for c in training_report(graph.mod, target=cuda)["convolutions"] if c.get("groups", 1) != 1]
    depthwise = rows["mobilenet_v2_blocks"]
    assert sorted(c["op"] for c in depthwise) == ["dgrad", "dgrad", "fprop", "fprop", "wgrad", "wgrad"], depthwise
    assert all(c["kernel"] and c["kind"] == "depthwise" and c["dtype"] == "bfloat16" for c in depthwise), depthwise
    assert {tuple(c["w"]) for c in depthwise} == {(32, 3, 3, 1)}, depthwise  # hidden = 8 * 4, OHWI
    grouped = rows["resnext_grouped"]
    assert grouped and not any(c["kernel"] for c in grouped)
    assert all("groups=4" in c["reason"] for c in grouped), grouped


def test_convolution_forms_without_a_gradient_rule_are_refused_by_name():
    """A 3-D convolution (transposed 2-D ones train: ``unet_up``)."""
    from tvm_evt.errors import UnsupportedOpError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Conv3d(4, 8, 3, padding=1), torch.nn.ReLU()),
                                torch.nn.Flatten())
    inputs = torch.randn(2, 4, 6, 6, 6)
    target = torch.randn_like(model(inputs).detach())
    with pytest.raises(UnsupportedOpError, match=r"aten\.convolution\.default in module '0\.0': no gradient rule"):
        tvm_evt.compile_training(model, [inputs, target], loss_fn=F.mse_loss, target="llvm")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_bf16_cuda_routes_tvm_kernels_compile_with_nvcc(name):
    """Each model's bf16 step partitioned for sm_90a: its TVM kernels, as the CUDA route schedules
    them, print as CUDA that nvcc builds.  Found failing to build while the CPU route matched
    torch (MobileNetV3-small's on an H200, the others by this test): bf16 infinities printed as
    ``inff`` (MobileNetV3's hardsigmoid), a boolx8 select condition (circular padding's slice
    scatter), DLight's cross-thread reduction of a grouped NCHW convolution and the one-thread
    fallback's global buffers (the shuffle, the overlapping adaptive pool)."""
    from _te_kernels import assert_nvcc_builds, cuda_route_source
    from tvm_evt.training import build_training_module, from_torch

    torch.manual_seed(0)
    model = MODELS[name]()
    x = torch.randn(4, _in_channels(name, model), 16, 16).contiguous(memory_format=torch.channels_last)
    graph = build_training_module(from_torch(model, (x, torch.randint(0, 10, (4,))), F.cross_entropy), None, "bf16")
    assert_nvcc_builds(cuda_route_source(graph.mod))
