"""hybridpar.flops against torch's FlopCounterMode, the published CosmoFlow figures and hand counts.

What is checked against what:
* forward and backward matmul-type FLOPs == ``torch.utils.flop_counter.FlopCounterMode`` (within 0.1 %,
  in practice exact) on the CosmoFlow model at 128^3, LBANN's CosmoFlow variant at 512^3 and conv stacks
  with strides, dilation, 'same' padding, pooling, batch norm, 1d/2d convs and transposed convs; both
  counted on the meta device at batch 1, so nothing large is allocated;
* the published CosmoFlow costs: 68.9 GFLOP forward and ~192 GFLOP per training sample at 128^3,
  ~1.35 TFLOP forward at 512^3 (LBANN), and 8,907,556 parameters;
* grouped convs: FlopCounterMode (torch 2.13) over-counts their weight gradient by ``groups``, so its
  backward is compared with ``input_grad + groups * weight_grad`` and our weight gradient with the
  correct formula;
* count_sharded: the ranks' conv FLOPs add up to the unsharded count; halo bytes equal hand counts.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hybridpar import flops
from hybridpar.flops.counter import meta_copy
from hybridpar.geometry import HaloError


def cosmoflow_128() -> nn.Sequential:
    """The MLPerf HPC CosmoFlow model (5 conv blocks, dense 32768 -> 128 -> 64 -> 4)."""
    layers: list[nn.Module] = []
    channels = 4
    for filters in (32, 64, 128, 256, 512):
        layers += [nn.Conv3d(channels, filters, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
        channels = filters
    layers += [nn.Flatten(), nn.Linear(32768, 128), nn.LeakyReLU(0.3), nn.Dropout(0.5), nn.Linear(128, 64),
               nn.LeakyReLU(0.3), nn.Dropout(0.5), nn.Linear(64, 4), nn.Tanh()]
    return nn.Sequential(*layers)


def lbann_cosmoflow(width: int = 512, batch_norm: bool = False) -> nn.Sequential:
    """LBANN's variant: log2(W) - 2 conv blocks, 16 * 2^i channels capped at 256, avg-pool k3 s2 p1."""
    layers: list[nn.Module] = []
    channels = 4
    for i in range(int(math.log2(width)) - 2):
        filters = min(16 * 2**i, 256)
        layers.append(nn.Conv3d(channels, filters, 3, padding=1, bias=not batch_norm))
        layers += [nn.BatchNorm3d(filters)] if batch_norm else []
        layers += [nn.LeakyReLU(0.3), nn.AvgPool3d(3, 2, 1)]
        channels = filters
    layers += [nn.Flatten(), nn.Linear(channels * 4**3, 2048), nn.LeakyReLU(0.3), nn.Dropout(0.5),
               nn.Linear(2048, 256), nn.LeakyReLU(0.3), nn.Dropout(0.5), nn.Linear(256, 4), nn.Tanh()]
    return nn.Sequential(*layers)


def torch_counts(model: nn.Module, shape: tuple[int, ...], input_grad: bool = False) -> tuple[int, int]:
    """FlopCounterMode's forward and backward totals, run on a meta copy of ``model``."""
    meta = meta_copy(model)
    x = torch.empty(shape, device="meta", requires_grad=input_grad)
    with FlopCounterMode(display=False) as fwd:
        y = meta(x)
    with FlopCounterMode(display=False) as bwd:
        y.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def assert_close(ours: int, theirs: int, rel: float = 1e-3) -> None:
    assert ours == pytest.approx(theirs, rel=rel), (ours, theirs)


def test_cosmoflow_128_matches_flop_counter_and_published_figures():
    model = cosmoflow_128()
    count = flops.count(model, (1, 4, 128, 128, 128))
    fwd, bwd = torch_counts(model, (1, 4, 128, 128, 128))
    assert_close(count.forward, fwd)
    assert_close(count.backward, bwd)
    assert count.forward / 1e9 == pytest.approx(68.9, rel=2e-3)
    assert count.total / 1e9 == pytest.approx(192.1, rel=2e-3)
    assert count.params == 8_907_556 == sum(p.numel() for p in model.parameters())
    first = count.per_layer[0]
    assert first.type == "Conv3d" and first.input_grad == 0 and first.weight_grad == first.forward
    assert all(layer.input_grad == layer.forward for layer in count.per_layer[1:] if layer.forward)
    # pooling and activations are reported apart from the FlopCounterMode-compatible figures
    pool = count.by_name()["2"]
    assert pool.forward == 0 and pool.forward_other == 32 * 64**3 * 8
    assert count.forward_other > 0
    # the original model is untouched (still real, on the CPU)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_lbann_cosmoflow_512_matches_flop_counter():
    with torch.device("meta"):
        model = lbann_cosmoflow(512, batch_norm=True)
    count = flops.count(model, (1, 4, 512, 512, 512))
    fwd, bwd = torch_counts(model, (1, 4, 512, 512, 512))
    assert_close(count.forward, fwd)
    assert_close(count.backward, bwd)
    assert count.forward / 1e12 == pytest.approx(1.35, rel=5e-3)
    assert sum(layer.type == "Conv3d" for layer in count.per_layer) == 7
    assert count.per_layer[-9].input_shape == (1, 256, 4, 4, 4)  # the flatten: 16384 -> 2048


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv_stack_with_strides_dilation_padding_pooling_and_transposed():
    model = nn.Sequential(
        nn.Conv3d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv3d(8, 8, (3, 5, 3), padding=(1, 2, 0), dilation=(2, 1, 1)), nn.BatchNorm3d(8), nn.ELU(),
        nn.Conv3d(8, 12, 4, padding="same", bias=False),
        nn.MaxPool3d(3, stride=2, padding=1, ceil_mode=True),
        nn.ConvTranspose3d(12, 6, 3, stride=2, padding=1, output_padding=1),
        nn.AvgPool3d(2), nn.ConvTranspose3d(6, 4, 2, stride=2, dilation=2),
        nn.AdaptiveAvgPool3d(2), nn.Flatten(), nn.Linear(32, 5),
    )
    shape = (2, 3, 20, 18, 22)
    count = flops.count(model, shape)
    fwd, bwd = torch_counts(model, shape)
    assert_close(count.forward, fwd)
    assert_close(count.backward, bwd)
    assert count.per_layer[0].input_grad == 0


def test_conv1d_conv2d_and_input_requiring_grad():
    model = nn.Sequential(nn.Conv2d(3, 6, 3, stride=(1, 2), dilation=2), nn.Tanh(), nn.Flatten(2),
                          nn.Conv1d(6, 4, 5, padding="same"), nn.Flatten(), nn.Linear(4 * 5 * 63, 3))
    shape = (3, 3, 9, 130)
    count = flops.count(model, shape, input_requires_grad=True)
    fwd, bwd = torch_counts(model, shape, input_grad=True)
    assert_close(count.forward, fwd)
    assert_close(count.backward, bwd)
    assert count.per_layer[0].input_grad == count.per_layer[0].forward


def test_grouped_conv_weight_grad_uses_the_correct_formula():
    """FlopCounterMode (torch 2.13) ignores groups in the weight gradient: it over-counts by ``groups``."""
    groups = 4
    model = nn.Sequential(nn.Conv3d(8, 16, 3, padding=1), nn.Conv3d(16, 32, 3, padding=1, groups=groups))
    shape = (2, 8, 6, 6, 6)
    count = flops.count(model, shape)
    fwd, bwd = torch_counts(model, shape)
    grouped = count.per_layer[1]
    correct = 2 * 2 * 6**3 * 32 * (16 // groups) * 27
    assert grouped.forward == grouped.weight_grad == grouped.input_grad == correct
    assert_close(count.forward, fwd)
    first = count.per_layer[0]
    assert_close(first.weight_grad + grouped.input_grad + groups * grouped.weight_grad, bwd)


def test_frozen_layer_has_no_weight_grad_and_its_successor_no_input_grad():
    model = nn.Sequential(nn.Conv3d(2, 4, 3), nn.ReLU(), nn.Conv3d(4, 4, 3))
    model[0].requires_grad_(False)
    count = flops.count(model, (1, 2, 8, 8, 8))
    _, bwd = torch_counts(model, (1, 2, 8, 8, 8))
    assert count.per_layer[0].weight_grad == 0 and count.per_layer[2].input_grad == 0
    assert count.backward == bwd == count.per_layer[2].weight_grad


def test_huge_input_is_counted_without_allocating():
    """A 1 x 4 x 2048^3 input would take 128 GiB; on the meta device it takes nothing."""
    model = nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.LeakyReLU(0.3), nn.AvgPool3d(3, 2, 1))
    count = flops.count(model, (1, 4, 2048, 2048, 2048))
    assert count.forward == 2 * 2048**3 * 8 * 4 * 27
    assert count.per_layer[0].activation_bytes == 8 * 2048**3 * 4


class DistConv3d(nn.Module):
    """A stand-in for a distributed layer: it names its torch counterpart in ``local_module``."""

    def __init__(self) -> None:
        super().__init__()
        self.local_module = nn.Conv3d(2, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local_module(x)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_wrappers_counted_once_and_unsupported_modules_reported():
    model = nn.Sequential(DistConv3d(), Scale())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = flops.count(model, (1, 2, 4, 4, 4))
    assert [(layer.name, layer.type) for layer in count.per_layer] == [("0", "DistConv3d"), ("1", "Scale")]
    assert count.forward == 2 * 4**3 * 3 * 2 * 27
    assert count.unsupported == ["1"] and any("no FLOP formula" in str(w.message) for w in caught)


def test_sharded_conv_flops_add_up_to_the_unsharded_count():
    model = cosmoflow_128()
    shape = (1, 4, 128, 128, 128)
    for split in ((2, 2, 2), (3, 1, 1), (2, 3, 1)):
        sharded = flops.count_sharded(model, shape, {"*": split})
        assert sharded.world == math.prod(split)
        for entry in sharded.per_layer:
            if entry.layer.type != "Conv3d":
                continue
            for attr in ("forward", "input_grad", "weight_grad"):
                assert sum(getattr(r, attr) for r in entry.ranks) == getattr(entry.layer, attr)
        assert sharded.total >= sharded.unsharded.total / sharded.world
        if split == (2, 2, 2):
            dense = sum(layer.total for layer in sharded.unsharded.per_layer if layer.type == "Linear")
            assert sharded.total == (sharded.unsharded.total - dense) // 8 + dense  # dense replicated
            assert sharded.imbalance == pytest.approx(1.0)


def test_halo_bytes_match_hand_counts():
    model = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.Conv3d(3, 5, 5, padding=2), nn.AvgPool3d(3, 2, 1))
    shape = (2, 2, 8, 8, 8)
    sharded = flops.count_sharded(model, shape, {"*": (2, 1, 1)})
    first, second, pool = sharded.per_layer
    # conv k3 p1 over a depth split of 8 into 4 + 4: one plane of 8 x 8 from the neighbour,
    # times batch 2, 2 input channels and 4 bytes; no halo gradient, as the input needs no grad
    assert [r.halo_bytes_forward for r in first.ranks] == [1 * 8 * 8 * 2 * 2 * 4] * 2
    assert [r.halo_bytes_backward for r in first.ranks] == [0, 0]
    # conv k5 p2: two planes of 3 channels, and the same volume of halo gradients back
    assert [r.halo_bytes_forward for r in second.ranks] == [2 * 8 * 8 * 2 * 3 * 4] * 2
    assert [r.halo_bytes_backward for r in second.ranks] == [2 * 8 * 8 * 2 * 3 * 4] * 2
    # avg-pool k3 s2 p1: outputs 0..1 read inputs -1..3 (own), outputs 2..3 read 3..7 (one plane)
    assert [r.halo_bytes_forward for r in pool.ranks] == [0, 1 * 8 * 8 * 2 * 5 * 4]
    # a 2 x 2 split: one plane along each split dim, faces of 4 x 8
    two = flops.count_sharded(model, shape, {"0": (2, 2, 1)}).per_layer[0]
    assert [r.halo_bytes_forward for r in two.ranks] == [2 * (4 * 8) * 2 * 2 * 4] * 4
    assert sharded.halo_bytes == max(r.halo_bytes for r in sharded.per_rank)


def test_sharded_transposed_conv_shows_redundant_work():
    model = nn.Sequential(nn.ConvTranspose3d(4, 4, 3, stride=2, padding=1))
    sharded = flops.count_sharded(model, (1, 4, 8, 8, 8), {"0": (2, 1, 1)})
    layer = sharded.per_layer[0]
    assert sum(r.forward for r in layer.ranks) > layer.layer.forward
    assert max(r.forward for r in layer.ranks) < layer.layer.forward


def test_sharded_errors_say_what_would_fit():
    model = cosmoflow_128()
    with pytest.raises(ValueError, match="no spatial dims"):
        flops.count_sharded(model, (1, 4, 128, 128, 128), {"16": (2, 1, 1)})
    with pytest.raises(ValueError, match="does not divide"):
        flops.count_sharded(model, (1, 4, 128, 128, 128), {"0": (2, 1, 1), "3": (3, 1, 1)})
    with pytest.raises(HaloError, match="use a split of at most"):
        flops.count_sharded(model, (1, 4, 128, 128, 128), {"12": (16, 1, 1)})
