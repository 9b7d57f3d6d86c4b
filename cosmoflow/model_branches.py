"""The heads that take spectrum features beside the convolutional summaries: a P(k) branch of the input
(:class:`PowerSpectrumBranch`), and a start at the volume study's reference (:class:`RidgeStarted`, a
ridge probe beside a head that learns the residual), with the standardisations they use.

Why apart from the network (:mod:`cosmoflow.model`): each wraps a built ``Sequential``, cut at its first
dense layer, and so needs nothing of how it was built; :func:`cosmoflow.model.build_model` applies them
when asked (``power_spectrum``, ``ridge_start``), and :mod:`cosmoflow.model` re-exports their names.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

SpectrumStats = Literal["batch", "running"]
RidgeProbe = Literal["trained", "fixed"]


class RunningStandardize(nn.BatchNorm1d):
    """Standardises features with running statistics in training too, not with the batch's: for
    features no parameter moves (the P(k) branch's), where the running statistics converge to the
    training set's, as a ridge regression standardises.

    Why: BatchNorm1d expresses each sample against the others of its replica's batch. With crops that
    is hundreds of samples; with whole universes it is a handful (eight at 64³), so the features the
    head regresses on carry the noise of a few samples' mean and spread, and a comparison between input
    sizes is decided by batch size rather than by volume. Each training batch updates the running mean
    and variance first (a cumulative average with ``momentum=None``, the default here; else a
    cumulative one for the first ``1/momentum`` batches, then an exponential one), which then normalise.
    The statistics carry no gradient; the engine averages them over data-parallel replicas after each
    step as it does BatchNorm's; evaluation is BatchNorm's. Not for a trunk's features: those move as
    it trains and lagging statistics let them grow unchecked (a head so standardised saturated its
    tanh within an epoch)."""

    def __init__(self, features: int, momentum: float | None = None) -> None:
        super().__init__(features, momentum=momentum)
        _register_running_standardize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.track_running_stats and x.shape[0] > 1:
            with torch.no_grad():
                self.num_batches_tracked += 1
                factor = 1.0 / self.num_batches_tracked.to(self.running_mean.dtype)
                if self.momentum is not None:
                    factor = factor.clamp(min=self.momentum)
                self.running_mean.lerp_(x.mean(0).to(self.running_mean.dtype), factor)
                self.running_var.lerp_(x.var(0).to(self.running_var.dtype), factor)
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False,
                                        0.0, self.eps)


def _register_running_standardize() -> None:
    """Tell hybridpar that :class:`RunningStandardize` is BatchNorm1d's layer (a dense head layer with
    a norm's FLOPs): its forward is BatchNorm's arithmetic with other statistics, but hybridpar takes a
    subclass with a forward of its own for a layer it does not know (no FLOP formula, a warning per
    count) until it is registered. Here, not at import: the app's models import no engine otherwise."""
    import hybridpar as hp  # noqa: PLC0415

    if hp.nn.lookup(RunningStandardize) is None:
        bn = hp.nn.lookup(nn.BatchNorm1d)
        hp.nn.register(RunningStandardize, role=bn.role, op=bn.op, flops=bn.flops)


class PowerSpectrumBranch(nn.Module):
    """CosmoFlow with a power-spectrum branch (CNN + P(k) hybrids: Ntampaka et al. 2020, Min et al.
    2024): P(k) of each input channel in shells ``shell_width`` apart up to the Nyquist frequency and
    two beyond it (:meth:`edges`), log-compressed and standardised (over the batch, or with the training
    set's statistics: ``stats``), beside the convolutional summaries at the head.
    The first channel's log P(k) is given as it is, every later channel's as its growth from the first,
    ``log P_c(k) - log P_0(k)``, shell by shell.

    Why: P(k) is the statistic a ridge regression beats the plain network with (the volume study's
    reference); given to the head, the network starts from it and the convolutions add what it
    misses. Why growth: the channels are snapshots of one universe at several redshifts, and the
    growth of structure between them is what depends on Omega_m. On the largest scales, where that
    growth is linear, the snapshots' log spectra are correlated at 0.93-0.99 across universes, so their
    difference is a fifth to a third of a standardised feature's spread: a direction a head trained for
    a few hundred steps barely finds (a ridge regression does, with almost no penalty). Standardised as
    a feature of its own it is as large as any other. The transform is linear and invertible, so
    nothing is lost. On a split volume the branch runs as ``hp.nn.DistPowerSpectrum`` (a distributed
    FFT)."""

    def __init__(self, trunk: nn.Sequential, head: nn.Sequential, in_channels: int, input_size: int,
                 shell_width: float = 2.0, stats: SpectrumStats = "batch") -> None:
        from hybridpar.nn import PowerSpectrum  # noqa: PLC0415 (the app's models import no engine otherwise)

        super().__init__()
        edges = self.edges(input_size, shell_width)
        self.trunk, self.head = trunk, head
        self.spectrum = PowerSpectrum(edges)
        if stats not in ("batch", "running"):
            raise ValueError(f"spectrum_stats must be 'batch' (BatchNorm1d) or 'running' "
                             f"(RunningStandardize), got {stats!r}")
        bins = in_channels * (len(edges) - 1)
        self.spectrum_norm = (nn.BatchNorm1d(bins, momentum=0.1) if stats == "batch"
                              else RunningStandardize(bins))

    @staticmethod
    def edges(input_size: int, shell_width: float = 2.0) -> list[float]:
        """Shells ``shell_width`` apart inside the Nyquist sphere, then two beyond it, to the faces'
        diagonals and to the corners (√3·N/2): the cube's corner modes hold the smallest scales, where
        the smoothing's cut-off (fixed in Mpc/h, so at an H_0-dependent wave number) shows."""
        half = input_size / 2
        inner = [0.5 + shell_width * i for i in range(int((half - 0.5) // shell_width) + 1)]
        return [*inner, half * math.sqrt(2), half * math.sqrt(3) + 1]

    @staticmethod
    def bins(input_size: int, shell_width: float = 2.0) -> int:
        return len(PowerSpectrumBranch.edges(input_size, shell_width)) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_power = torch.log1p(self.spectrum(x))                 # (N, C, bins)
        growth = log_power[:, 1:] - log_power[:, :1]              # later snapshots against the first
        spectrum = self.spectrum_norm(torch.cat([log_power[:, :1], growth], dim=1).flatten(1))
        return self.head(torch.cat([self.trunk(x), spectrum], dim=1))


def with_power_spectrum(model: nn.Sequential, input_size: int, in_channels: int,
                         stats: SpectrumStats = "batch") -> PowerSpectrumBranch:
    """``model`` cut at its first dense layer, which also takes the P(k) features."""
    layers = list(model)
    cut = next(i for i, m in enumerate(layers) if isinstance(m, nn.Linear))
    first = layers[cut]
    extra = in_channels * PowerSpectrumBranch.bins(input_size)
    layers[cut] = nn.Linear(first.in_features + extra, first.out_features)
    return PowerSpectrumBranch(nn.Sequential(*layers[:cut]), nn.Sequential(*layers[cut:]), in_channels,
                               input_size, stats=stats)


class Standardize(nn.Module):
    """``(f - mean) / scale`` with fixed buffers, the result in the buffers' dtype: the training set's
    standardisation of the reference's features (float64 in, the model's dtype out). A module of its own
    so that the engine runs it, like the probe, on the replicated features."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("scale", torch.ones(features))

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return ((f - self.mean) / self.scale).to(self.mean.dtype)


class FixedLinear(nn.Module):
    """A linear map whose weights are buffers: a ridge probe kept where the closed-form solve put it
    (``model.ridge_probe: fixed``). Why: fine-tuned with the rest, the ridge-started network's
    validation MAE rose above the reference's within an epoch (``volume_study_ridge_short``). The
    ridge's solution is regularised, its strength chosen by cross-validation; SGD on the squared error
    alone, eight universes a step, has no such penalty and moves the probe off it (the likely cause,
    not isolated). Kept fixed, only the residual (trunk and head) learns."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features))
        self.register_buffer("bias", torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RidgeStarted(nn.Module):
    """A CNN + P(k) hybrid that starts at the volume study's reference and learns the residual.

    ``forward(x) = probe(z) + head([trunk(x), z])``, with ``z`` the reference's features
    (:class:`cosmoflow.summaries.ReferenceFeatures`: log shell powers, mean, log variance, skewness per
    channel) standardised with the training set's statistics. :func:`start_at_ridge` sets the linear
    ``probe`` to the closed-form ridge solution on the training set (linear probing) and the head's
    output layer starts at zero, so before the first step the network predicts exactly what the
    reference does; training then moves the probe (fine-tuning) and teaches the trunk and head what the
    spectrum misses.

    Why: a head trained by SGD for the study's few hundred steps approaches but does not reach what the
    ridge gets from the same spectrum in one exact solve (the study's own probe needed about 4× its
    steps), so a network that had to learn the spectrum's regression first ended behind the reference at
    every size. Started at it, the network's comparison with the reference measures what the CNN adds.
    """

    def __init__(self, trunk: nn.Sequential, head: nn.Sequential, in_channels: int, input_size: int,
                 n_outputs: int, probe: RidgeProbe = "trained", cross: bool = False) -> None:
        from cosmoflow.summaries import ReferenceFeatures  # noqa: PLC0415 (imports the engine's layers)

        super().__init__()
        if probe not in ("trained", "fixed"):
            raise ValueError(f"ridge_probe must be 'trained' (fine-tuned) or 'fixed' (kept at the ridge "
                             f"solution), got {probe!r}")
        self.trunk, self.head = trunk, head
        self.features = ReferenceFeatures(input_size, in_channels, cross)
        self.standardize = Standardize(self.features.n_features)
        n = self.features.n_features
        self.probe = nn.Linear(n, n_outputs) if probe == "trained" else FixedLinear(n, n_outputs)

    def output_layer(self) -> nn.Linear:
        """The head's last Linear: zero at the start, so the residual starts at zero."""
        return [m for m in self.head if isinstance(m, nn.Linear)][-1]

    def zero_residual(self) -> None:
        """Head output layer and probe at zero: the model predicts 0 until :func:`start_at_ridge`."""
        with torch.no_grad():
            for layer in (self.output_layer(), self.probe):
                layer.weight.zero_()
                layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.standardize(self.features(x))
        return self.probe(z) + self.head(torch.cat([self.trunk(x), z], dim=1))


def with_ridge_start(model: nn.Sequential, input_size: int, in_channels: int,
                      probe: RidgeProbe = "trained", cross: bool = False) -> RidgeStarted:
    """``model`` cut at its first dense layer, which also takes the reference's features (``cross``:
    with the correlation between channels per shell)."""
    from cosmoflow.summaries import n_features  # noqa: PLC0415

    layers = list(model)
    cut = next(i for i, m in enumerate(layers) if isinstance(m, nn.Linear))
    first = layers[cut]
    layers[cut] = nn.Linear(first.in_features + n_features(in_channels, cross), first.out_features)
    n_outputs = [m for m in layers if isinstance(m, nn.Linear)][-1].out_features
    return RidgeStarted(nn.Sequential(*layers[:cut]), nn.Sequential(*layers[cut:]), in_channels, input_size,
                        n_outputs, probe, cross)


def start_at_ridge(model: RidgeStarted, fit: object) -> None:
    """Set ``model``'s standardisation and probe to a fitted reference (``reference.RidgeFit``:
    ``usable``, ``mean``, ``scale``, ``weights`` with the intercept last) and its residual to zero, so
    that it predicts what the reference predicts. Features the fit left out (constant over the
    training set) get mean 0, scale 1 and weight 0."""
    device = model.standardize.mean.device
    usable = torch.as_tensor(fit.usable, dtype=torch.bool, device=device)
    n = model.standardize.mean.numel()
    if usable.numel() != n or fit.weights.shape[1] != model.probe.out_features:
        raise ValueError(f"the ridge fit has {usable.numel()} features and {fit.weights.shape[1]} outputs; "
                         f"the model's probe takes {n} and gives {model.probe.out_features} (another input "
                         "size or channel count?)")
    model.zero_residual()
    with torch.no_grad():
        st, probe = model.standardize, model.probe
        dtype = st.mean.dtype
        st.mean.zero_()
        st.scale.fill_(1.0)
        st.mean[usable] = torch.as_tensor(fit.mean, dtype=dtype, device=device)
        st.scale[usable] = torch.as_tensor(fit.scale, dtype=dtype, device=device)
        w = torch.as_tensor(fit.weights, dtype=probe.weight.dtype, device=device)
        probe.weight[:, usable] = w[:-1].T
        probe.bias.copy_(w[-1])
