"""The CosmoFlow networks, checked against the published reference numbers.

* Defaults at 128³: exactly 8,907,556 parameters (MLPerf HPC reference) and 68.9 GFLOP forward
  (FlopCounterMode on the meta device, so nothing is computed); the layer list is flat and in the
  reference order, LeakyReLU slope 0.3, output tanh × 1.2.
* ``padding=1`` convolutions equal torch's ``padding='same'``.
* LBANN's 512³ variant: 7 conv layers, 16…256 channels, ≈1.35 TFLOP forward.
* The 64³ demo model runs forward and backward on CPU; invalid combinations fail with what would fit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from cosmoflow.model import OutputScale, build_lbann_model, build_model, count_parameters


def _forward_flops(model: nn.Module, size: int) -> tuple[float, torch.Size]:
    with torch.device("meta"):
        x = torch.empty(1, 4, size, size, size)
    with FlopCounterMode(display=False) as counter:
        y = model.to("meta")(x)
    return counter.get_total_flops(), y.shape


def test_reference_model_size_and_flops() -> None:
    with torch.device("meta"):
        model = build_model()
    assert count_parameters(model) == 8_907_556
    assert all(not isinstance(m, nn.Sequential) for m in model.children())
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["Conv3d", "LeakyReLU", "MaxPool3d"] * 5 + [
        "Flatten", "Linear", "LeakyReLU", "Dropout", "Linear", "LeakyReLU", "Dropout", "Linear", "Tanh",
        "OutputScale"]
    convs = [m for m in model if isinstance(m, nn.Conv3d)]
    assert [c.out_channels for c in convs] == [32, 64, 128, 256, 512]
    assert all(c.padding == (1, 1, 1) and c.kernel_size == (3, 3, 3) for c in convs)
    assert all(m.negative_slope == 0.3 for m in model if isinstance(m, nn.LeakyReLU))
    assert isinstance(model[-1], OutputScale) and model[-1].scale == 1.2
    assert model[16].in_features == 4 ** 3 * 512
    flops, shape = _forward_flops(model, 128)
    assert shape == (1, 4)
    assert flops / 1e9 == pytest.approx(68.9, abs=0.05)


def test_padding_one_is_same() -> None:
    torch.manual_seed(0)
    conv = build_model(16, n_conv=1, base_filters=3, dense=())[0]
    x = torch.randn(2, 4, 7, 8, 9)
    same = nn.functional.conv3d(x, conv.weight, conv.bias, padding="same")
    torch.testing.assert_close(conv(x), same)


def test_lbann_model() -> None:
    with torch.device("meta"):
        model = build_lbann_model()
    convs = [m for m in model if isinstance(m, nn.Conv3d)]
    assert [c.out_channels for c in convs] == [16, 32, 64, 128, 256, 256, 256]
    pools = [m for m in model if isinstance(m, nn.AvgPool3d)]
    assert len(pools) == 7 and pools[0].kernel_size == 3 and pools[0].stride == 2 and pools[0].padding == 1
    assert [m.out_features for m in model if isinstance(m, nn.Linear)] == [2048, 256, 4]
    flops, shape = _forward_flops(model, 512)
    assert shape == (1, 4) and flops / 1e12 == pytest.approx(1.35, abs=0.01)
    with torch.device("meta"):
        bn = build_lbann_model(128, batchnorm=True)
    assert sum(isinstance(m, nn.BatchNorm3d) for m in bn) == 5
    assert all(m.bias is None for m in bn if isinstance(m, nn.Conv3d))


def test_demo_model_forward_backward() -> None:
    torch.manual_seed(0)
    model = build_model(64, n_conv=4, base_filters=8)
    x = torch.log1p(torch.poisson(torch.ones(2, 4, 64, 64, 64)))
    y = model(x)
    assert y.shape == (2, 4) and bool((y.abs() < 1.2).all())
    nn.functional.mse_loss(y, torch.zeros_like(y)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("stats", ["batch", "running"])
def test_the_demo_models_flops_are_counted_without_a_warning(stats: str) -> None:
    """Every layer of the demo's model (the P(k) branch's standardisation included) has a FLOP formula:
    hybridpar counts it with no warning, and the spectrum's norm as BatchNorm1d's work."""
    import warnings

    import hybridpar as hp

    model = build_model(32, n_conv=2, base_filters=4, max_filters=8, dense=[8], global_pool=True,
                        head_norm=True, padding_mode="circular", power_spectrum=True, spectrum_stats=stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counted = hp.flops.count(model, (1, 4, 32, 32, 32))
    norm = counted.by_name()["spectrum_norm"]
    assert counted.unsupported == [] and norm.forward_other == 4 * norm.input_shape[0] * norm.input_shape[1]


def test_invalid_combinations() -> None:
    with pytest.raises(ValueError, match="input_size 100 is not divisible by 2\\^n_conv = 32 .* input sizes "
                                         "that fit: 96 or 128; n_conv that fit: 1, 2"):
        build_model(100)
    with pytest.raises(ValueError, match="input sizes that fit: 32"):
        build_model(16)
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        build_model(64, kernel_size=2)
    with pytest.raises(ValueError, match="pool must be 'max'"):
        build_model(64, pool="min")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="power-of-two input_size"):
        build_lbann_model(96)
    with pytest.raises(ValueError, match="init must be"):
        build_model(64, init="zeros")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["sgd", "lars", "adamw"])
def test_optimizer_for_a_stage_without_parameters(name: str) -> None:
    """A pipeline stage of pooling and activations only still gets a working optimizer."""
    from cosmoflow.config import OptimizerConfig
    from cosmoflow.optim import make_optimizer, set_lr

    opt = make_optimizer(OptimizerConfig(name=name), [], global_batch=8)
    set_lr(opt, 0.5)
    opt.step()
    opt.zero_grad()
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.5
    assert opt.state_dict()["param_groups"][0]["params"] == []


def test_running_standardize_uses_the_training_sets_statistics() -> None:
    """In training it normalises with the cumulative mean and variance of every batch so far, this one
    included, not with the batch's own: after a pass over the data the statistics are the data's, and
    one odd batch moves them by its share; evaluation is BatchNorm1d's."""
    from cosmoflow.model import RunningStandardize

    torch.manual_seed(0)
    data = torch.randn(64, 3, dtype=torch.float64) * torch.tensor([1.0, 5.0, 0.1], dtype=torch.float64) + 2
    norm = RunningStandardize(3).double()
    batches = data.split(4)
    for b in batches:
        norm(b)
    assert torch.allclose(norm.running_mean, data.mean(0))
    assert torch.allclose(norm.running_var, torch.stack([b.var(0) for b in batches]).mean(0))
    batch = data[:4] * 3                                  # a batch far off: it moves the statistics by 1/17
    out = norm(batch)
    want = (batch - norm.running_mean) / (norm.running_var + norm.eps).sqrt()
    assert torch.allclose(out, want) and not torch.allclose(out, torch.nn.functional.batch_norm(
        batch, None, None, training=True))
    assert torch.allclose(norm.running_mean, (16 * data.mean(0) + batch.mean(0)) / 17)
    ref = torch.nn.BatchNorm1d(3).double()
    ref.load_state_dict(norm.state_dict())
    norm.eval(), ref.eval()
    assert torch.allclose(norm(data), ref(data))
    x = data[:8].clone().requires_grad_()
    norm.train()
    norm(x).sum().backward()                              # no gradient through the statistics
    assert torch.allclose(x.grad, (norm.weight / (norm.running_var + norm.eps).sqrt()).expand(8, 3))


def test_power_spectrum_branch_shells_reach_the_corners() -> None:
    """The P(k) branch's shells: 2 apart inside the Nyquist sphere, then to the faces' diagonals and
    to the corners, so every mode of the cube but the zero mode is in a shell."""
    from cosmoflow.model import PowerSpectrumBranch

    for n in (4, 16, 64):
        edges = PowerSpectrumBranch.edges(n)
        assert edges[0] == 0.5 and edges[-1] > n / 2 * 3 ** 0.5 and edges == sorted(edges)
        assert PowerSpectrumBranch.bins(n) == len(edges) - 1
    model = build_model(16, 4, 2, 4, 8, dense=[8], dropout=0.0, global_pool=True, head_norm=True,
                        power_spectrum=True, spectrum_stats="running")
    assert model(torch.rand(3, 4, 16, 16, 16)).shape == (3, 4)
    with pytest.raises(ValueError, match="spectrum_stats must be 'batch'.*got 'sum'"):
        build_model(16, 4, 2, power_spectrum=True, spectrum_stats="sum")
