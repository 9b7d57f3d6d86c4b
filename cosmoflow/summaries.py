"""The summary statistics a ridge regression reads off an input: the one definition the volume study's
reference and the network's ridge-started P(k) branch both use.

Why one module: the network is to start exactly where the reference is (its linear probe holds the
ridge solution on these features), so the features the ridge was fitted on and the features the network
computes must be the same numbers, not two implementations that agree roughly. They are written with
torch layers the engine splits (``PowerSpectrum``, a pointwise :class:`Moments`, a global average), so
on a volume split over ranks the network computes them from its shards; the reference calls the same
module on one whole input.

Per input and channel: the log shell power of the channel in the shells :data:`SHELLS` (cycles per
voxel: the same physical shells at every input size; 0 for a shell the input is too small to hold), then
the channel's mean, log variance and skewness. The power is ``|X_k|²/d³`` (``X = rfftn(x)``, a box of
d voxels), averaged over the shell's modes each counted with its conjugate twin.

With ``cross``, after those: per pair of channels a < b and shell, their correlation coefficient
``r_ab = P_ab / sqrt(P_a P_b)`` (0 where the shell holds no mode or a channel has no power). Why: the
channels are snapshots of one universe at several redshifts, and how fast they decorrelate from each
other, scale by scale, follows how far matter moved in between, which each channel's own spectrum does
not record. The cross power comes from the same ``PowerSpectrum`` layer, as
``P_ab = (P_{a+b} - P_a - P_b) / 2`` of the pointwise pair sums :class:`PairSums` makes, so a split
volume computes it from its shards with no layer of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.nn import PowerSpectrum, register
from hybridpar.nn.formulas import elementwise_flops

SHELLS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 0.87)
"""Shell edges in cycles per voxel (0.87 ≈ √3/2 holds the grid's corners)."""
FLOOR = 1e-12
"""Power and variance below this are taken as this (a constant channel): their logs stay finite."""
MOMENTS = 3
"""Raw moments per channel, E[x], E[x²], E[x³]: what the mean, variance and skewness are made of."""


def held_shells(size: int) -> list[bool]:
    """Whether a ``size``³ input holds a mode of each shell of :data:`SHELLS` (its wave numbers are
    whole multiples of 1/size cycles per voxel, up to √3/2 at the corners)."""
    k = torch.arange(-(size // 2), size // 2 + 1, dtype=torch.float64)
    norms = torch.sqrt(k[:, None, None] ** 2 + k[None, :, None] ** 2 + k[None, None, :] ** 2).flatten()
    norms = norms[norms > 0] / size
    return [bool(((norms >= lo) & (norms < hi)).any()) for lo, hi in zip(SHELLS, SHELLS[1:])]


def features_per_channel() -> int:
    """Features of one channel: a log power per shell, then mean, log variance, skewness."""
    return len(SHELLS) - 1 + 3


def pairs(channels: int) -> list[tuple[int, int]]:
    """The channel pairs (a, b), a < b, in the order their cross features come."""
    return [(a, b) for a in range(channels) for b in range(a + 1, channels)]


def n_features(channels: int, cross: bool = False) -> int:
    """Features of an input of ``channels`` channels: :func:`features_per_channel` each, and with
    ``cross`` one correlation coefficient per channel pair and shell."""
    return channels * features_per_channel() + (len(pairs(channels)) * (len(SHELLS) - 1) if cross else 0)


class Moments(nn.Module):
    """``x`` (N, C, ...) to ``x, x², x³`` (N, 3C, ...) in float64, voxel by voxel, so that a global
    average of them gives each channel's raw moments (on a split volume too: the average is the
    engine's split global pooling). float64: the variance and skewness are differences of raw moments,
    which in float32 lose the digits a high-redshift channel's small variance lives in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float64)
        return torch.cat([x, x * x, x * x * x], dim=1)


register(Moments, role="pointwise", op="pointwise", flops=elementwise_flops)


class PairSums(nn.Module):
    """``x`` (N, C, ...) to ``x`` and the sums ``x_a + x_b`` of each channel pair of :func:`pairs`
    (N, C + C(C-1)/2, ...), voxel by voxel: their power spectra give the cross spectra."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        return torch.cat([x, *(x[:, a:a + 1] + x[:, b:b + 1] for a, b in pairs(c))], dim=1)


register(PairSums, role="pointwise", op="pointwise", flops=elementwise_flops)


class Summarize(nn.Module):
    """Shell powers (N, C·shells; with ``cross`` also the pair sums', (N, (C + pairs)·shells)) and raw
    moments (N, 3C) to the features (N, C·(shells + 3) [+ pairs·shells]), channel by channel: log power
    (0 where the input holds no mode of the shell), mean, log variance, skewness (0 for a channel whose
    variance is below :data:`FLOOR`); then each pair's correlation per shell. Works on replicated
    (whole-volume) values."""

    def __init__(self, size: int, channels: int, cross: bool = False) -> None:
        super().__init__()
        self.channels, self.volume, self.cross = channels, float(size) ** 3, cross
        self.register_buffer("held", torch.tensor(held_shells(size)), persistent=False)

    def forward(self, powers_and_moments: torch.Tensor) -> torch.Tensor:
        n, c, shells = powers_and_moments.shape[0], self.channels, self.held.numel()
        spectra = c + (len(pairs(c)) if self.cross else 0)
        all_power = powers_and_moments[:, :spectra * shells].reshape(n, spectra, shells).to(torch.float64) \
            / self.volume
        power = all_power[:, :c]
        raw = powers_and_moments[:, spectra * shells:].reshape(n, MOMENTS, c).to(torch.float64)
        m1, m2, m3 = raw[:, 0], raw[:, 1], raw[:, 2]
        var = m2 - m1 * m1
        third = m3 - 3 * m1 * m2 + 2 * m1 ** 3                      # E[(x - m1)³]
        flat = var <= FLOOR
        skew = torch.where(flat, torch.zeros_like(var), third / var.clamp_min(FLOOR) ** 1.5)
        log_power = torch.where(self.held, torch.log(power.clamp_min(FLOOR)), torch.zeros_like(power))
        stats = torch.stack([m1, torch.log(var.clamp_min(FLOOR)), skew], dim=2)
        own = torch.cat([log_power, stats], dim=2).flatten(1)
        if not self.cross:
            return own
        return torch.cat([own, self._correlations(all_power)], dim=1)

    def _correlations(self, power: torch.Tensor) -> torch.Tensor:
        """(N, pairs·shells): r_ab per shell from the channels' and the pair sums' powers."""
        c = self.channels
        out = []
        for j, (a, b) in enumerate(pairs(c)):
            pa, pb = power[:, a], power[:, b]
            both = pa * pb
            dead = (both <= FLOOR * FLOOR) | ~self.held
            r = (power[:, c + j] - pa - pb) / (2 * torch.sqrt(both.clamp_min(FLOOR * FLOOR)))
            out.append(torch.where(dead, torch.zeros_like(r), r))
        return torch.cat(out, dim=1)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, shells={self.held.numel()}" + (", cross" if self.cross else "")


class ReferenceFeatures(nn.Module):
    """The reference's features of a batch of ``size``³ inputs with ``channels`` channels: (N, C, d, d, d)
    to (N, :func:`n_features`) float64 (see the module doc). Every rank of a split volume gets all of
    them."""

    def __init__(self, size: int, channels: int, cross: bool = False) -> None:
        super().__init__()
        self.size, self.channels, self.cross = size, channels, cross
        self.pair_sums = PairSums() if cross else None
        self.spectrum = PowerSpectrum([e * size for e in SHELLS])   # edges in fundamental frequencies
        self.moments = Moments()
        self.average = nn.AdaptiveAvgPool3d(1)
        self.summarize = Summarize(size, channels, cross)

    @property
    def n_features(self) -> int:
        return n_features(self.channels, self.cross)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectra = x if self.pair_sums is None else self.pair_sums(x)
        power = self.spectrum(spectra).flatten(1).to(torch.float64)   # (N, spectra·shells), replicated
        raw = self.average(self.moments(x)).flatten(1)             # (N, 3C): E[x], E[x²], E[x³]
        return self.summarize(torch.cat([power, raw], dim=1))

