"""What a config's network takes in memory, reckoned from its sizes before anything is built.

Why: a config's numbers are only checked from below by their types and ranges, and a network is
allocated as it is built, so ``model.dense: [1e9]`` or ``data.sample_size: 4096`` (a first dense layer of
a billion features) would be hundreds of GB of weights asked of the allocator, and a traceback, before
anything said which key. A config file and the configuration an export carries
(``cosmoflow.model.build_model_from_export``) both pass :func:`memory_problem`: the network's weights, and
one sample's largest activation on each spatial part of the grid, must fit in this machine's memory, or
one :class:`~cosmoflow.config.ConfigError` line names the key that makes them large and the largest
value of it that fits (:mod:`cosmoflow.config` raises it; this module imports no config code).

The reckoning is arithmetic on the sizes (float32, conv kernels k³, the layers :func:`cosmoflow.model.
build_model` and :class:`cosmoflow.unet.UNet3d` make), not a build on the meta device: a count such as
``model.n_conv`` is checked first (:mod:`cosmoflow.config`), so nothing here loops over an absurd one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Config = Any
"""A :class:`cosmoflow.config.Config`: that module imports this one to bound its sizes, so this one imports
no config code, not even for its annotations (an import cycle otherwise)."""

WORD = 4  # bytes of a float32
KERNEL = 27  # a k3 conv's weights per input and output channel


@dataclass(frozen=True)
class Need:
    """Bytes a network needs: its weights, and one sample's largest activation per spatial part."""

    weights: int
    activation: int


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def spatial_parts(parallel: dict[str, Any]) -> int | None:
    """Ranks one sample is split over (``parallel.grid.spatial``'s product); None when the grid leaves it
    to the world size (a -1) or does not say it in numbers."""
    grid = parallel.get("grid") if isinstance(parallel, dict) else None
    spatial = grid.get("spatial", [1, 1, 1]) if isinstance(grid, dict) else [1, 1, 1]
    if not isinstance(spatial, list) or not all(type(n) is int and n >= 1 for n in spatial):
        return None
    return math.prod(spatial)


def regress_need(cfg: Config) -> Need:
    """CosmoFlow's regressor (``model`` section): conv blocks, then the dense head."""
    m, size, channels = cfg.model, cfg.data.sample_size, cfg.data.channels
    weights, largest = 0, channels * size ** 3
    c_in, extent = channels, size
    for i in range(m.n_conv):
        c_out = min(m.base_filters * 2 ** i, m.max_filters)
        weights += c_in * c_out * KERNEL + 2 * c_out
        largest = max(largest, c_out * extent ** 3)
        c_in, extent = c_out, extent // 2
    features = c_in * (1 if m.global_pool else extent ** 3)
    if m.power_spectrum:
        features += channels * (size // 4 + 3)  # the P(k) shells (PowerSpectrumBranch.edges)
    for width in [*m.dense, 4]:
        weights += features * width + width
        features = width
    return Need(weights * WORD, largest * WORD)


def unet_need(cfg: Config) -> Need:
    """The reconstruction U-Net (``unet`` section): two k3 convs per level down and up, concatenated skips."""
    u, size = cfg.unet, cfg.data.sample_size
    chans = [min(u.width * 2 ** i, u.max_width) for i in range(u.levels)]
    prev, weights = cfg.data.channels + 4, 0  # + the displacement's channels, at most 4
    for c in chans:
        weights += (prev + c) * c * KERNEL
        prev = c
    for i in range(u.levels - 1):
        weights += (chans[i] + chans[i + 1] + chans[i]) * chans[i] * KERNEL
    largest = (chans[0] + chans[min(1, u.levels - 1)]) * size ** 3  # the full-resolution concatenation
    return Need(weights * WORD, largest * WORD)


def need(cfg: Config) -> Need:
    """What ``cfg``'s network needs (:func:`regress_need` or :func:`unet_need` by its task)."""
    return unet_need(cfg) if cfg.task == "reconstruct" else regress_need(cfg)


@dataclass(frozen=True)
class SizeKey:
    """A config key that sizes the network: its value, its default, and the values it may take
    (multiples of ``step`` from ``low``)."""

    name: str
    value: int
    default: int
    step: int = 1
    low: int = 1


def size_keys(cfg: Config, d: Config) -> list[SizeKey]:
    """The keys :func:`need` grows with, for ``cfg``'s task (``d``: the defaults, to compare with)."""
    if cfg.task == "reconstruct":
        u, du = cfg.unet, d.unet
        return [SizeKey("data.sample_size", cfg.data.sample_size, d.data.sample_size, 2 ** (u.levels - 1)),
                SizeKey("unet.width", u.width, du.width, u.groups, u.groups),
                SizeKey("unet.max_width", u.max_width, du.max_width, u.groups, u.width)]
    m, dm = cfg.model, d.model
    return [SizeKey("data.sample_size", cfg.data.sample_size, d.data.sample_size, 2 ** m.n_conv),
            SizeKey("model.base_filters", m.base_filters, dm.base_filters),
            SizeKey("model.max_filters", m.max_filters, dm.max_filters, low=m.base_filters),
            *(SizeKey(f"model.dense[{i}]", w, dm.dense[min(i, len(dm.dense) - 1)])
              for i, w in enumerate(m.dense))]


def with_value(cfg: Config, key: str, value: int) -> Config:
    """``cfg`` with one size key set to ``value`` (a copy; ``model.dense[i]`` sets one entry)."""
    section, _, field = key.partition(".")
    part = getattr(cfg, section)
    if field.startswith("dense["):
        i = int(field[6:-1])
        part = dataclasses.replace(part, dense=[*part.dense[:i], value, *part.dense[i + 1:]])
    else:
        part = dataclasses.replace(part, **{field: value})
    return dataclasses.replace(cfg, **{section: part})


def largest_fit(key: SizeKey, fits: Callable[[int], bool]) -> int | None:
    """The largest value of ``key`` below its own that ``fits`` (monotone: smaller fits sooner), or None."""
    lo, hi = -(-key.low // key.step), (key.value - 1) // key.step  # in multiples of the step
    if hi < lo or not fits(lo * key.step):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * key.step) else (lo, mid - 1)
    return lo * key.step


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:,.1f} GiB"


def memory_problem(cfg: Config, defaults: Config, memory: int | None = None) -> str | None:
    """A one-line message naming the size key to lower when ``cfg``'s network would not fit in ``memory``
    bytes (default: this machine's), its weights or one sample's largest activation per spatial part;
    None when it fits.

    Of the keys whose lowering alone would fit, the one furthest above its value in ``defaults`` is named
    (the one most likely set by mistake), with the largest value that fits.
    """
    memory = machine_memory() if memory is None else memory
    if memory is None:
        return None
    parts = spatial_parts(cfg.parallel)
    fits = lambda c: _over(c, memory, parts) is None  # noqa: E731
    over = _over(cfg, memory, parts)
    if over is None:
        return None
    keys = sorted(size_keys(cfg, defaults), key=lambda k: k.value / k.default, reverse=True)
    found = [(k, largest_fit(k, lambda v, k=k: fits(with_value(cfg, k.name, v)))) for k in keys]
    key, fit = next(((k, f) for k, f in found if f is not None), (keys[0], None))
    advice = (f"{key.name} of at most {fit} fits" if fit is not None
              else "no value of it alone fits; lower the other sizes too")
    return (f"{key.name}: {key.value} makes {over}, more than this machine's {_gib(memory)} of memory; "
            f"{advice}")


def _over(cfg: Config, memory: int, parts: int | None) -> str | None:
    """What of ``cfg``'s network exceeds ``memory`` (words for a message), or None when it fits."""
    n = need(cfg)
    if n.weights > memory:
        return f"the network's weights {_gib(n.weights)}"
    if parts is not None and n.activation // parts > memory:
        split = f" on each of its {parts} spatial parts" if parts > 1 else ""
        return f"one sample's largest activation {_gib(n.activation // parts)}{split}"
    return None
