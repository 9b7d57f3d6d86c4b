"""How well a field matches the truth, scale by scale: the cross-correlation coefficient r(k).

Why this measure: a reconstruction is judged per Fourier scale, because the evolved field keeps the
initial field's large-scale modes almost intact and scrambles its small ones. ``r(k) = P_ab(k) /
sqrt(P_aa(k) P_bb(k))`` is 1 where ``a`` is a perfect (rescaled) copy of ``b`` in that shell and 0
where the two are unrelated; ``1 - r`` is the decorrelation a reconstruction has to remove.

Shells are measured in units of the box's fundamental frequency ``k_f = 2π/L`` (a mode's |n| on the
integer lattice), so volumes whose boxes differ in Mpc/h (the generator ties L to H_0) share the same
modes per bin; ``k = |n|·k_f`` in h/Mpc follows from each box's size. The mean mode (n = 0) is left out.
"""

from __future__ import annotations

import numpy as np


def mode_lengths(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(|n|, weight)`` over the ``rfftn`` layout of an n³ grid, both float64 and flattened.

    The weight counts each stored mode with its conjugate twin: 2 for the half-plane ``0 < n_z < n/2``,
    1 for the planes the real transform stores once (n_z = 0 and, for even n, the Nyquist plane).
    """
    full = np.fft.fftfreq(n, d=1.0 / n)
    half = np.fft.rfftfreq(n, d=1.0 / n)
    length = np.sqrt(full[:, None, None] ** 2 + full[None, :, None] ** 2 + half[None, None, :] ** 2)
    weight = np.full(half.shape, 2.0)
    weight[0] = 1.0
    if n % 2 == 0:
        weight[-1] = 1.0
    return length.ravel(), np.broadcast_to(weight, length.shape).ravel()


def shell_edges(n: int, width: float = 2.0) -> np.ndarray:
    """Shell edges in units of k_f from 0 to the Nyquist frequency ``n/2``, ``width`` apart."""
    if n < 4:
        raise ValueError(f"a field needs at least 4 voxels per side to have shells; got {n}")
    return np.arange(0.0, n / 2 + 1e-9, width)


class Shells:
    """The shells of an n³ grid, binned once: which stored mode falls in which shell, with its weight.

    Scoring many fields against one truth then costs one transform per field and one bincount per
    pair (:meth:`transform`, :meth:`sums`), with no mode lengths recomputed.
    """

    def __init__(self, n: int, edges: np.ndarray) -> None:
        self.n, self.edges = n, edges
        length, weight = mode_lengths(n)
        which = np.digitize(length, edges) - 1
        self.inside = (length > 0) & (which >= 0) & (which < len(edges) - 1)
        self.index, self.weight = which[self.inside], weight[self.inside]

    def transform(self, a: np.ndarray) -> np.ndarray:
        """The modes of a real n³ field inside the shells (float64 ``rfftn``, flattened)."""
        if a.shape != (self.n,) * 3:
            raise ValueError(f"cross_power needs cubes of shape {(self.n,) * 3}, got {a.shape}")
        return np.fft.rfftn(np.asarray(a, dtype=np.float64)).ravel()[self.inside]

    def sums(self, fa: np.ndarray, fb: np.ndarray) -> np.ndarray:
        """Per shell ``[Σ Re(a_k b_k*), Σ |a_k|², Σ |b_k|²]`` of two :meth:`transform` results."""
        bins = len(self.edges) - 1
        return np.stack([np.bincount(self.index, weights=self.weight * v, minlength=bins)
                         for v in ((fa * fb.conj()).real, np.abs(fa) ** 2, np.abs(fb) ** 2)])


def cross_power(a: np.ndarray, b: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Per shell the sums ``[Σ Re(a_k b_k*), Σ |a_k|², Σ |b_k|²]`` over its modes, shape (3, bins).

    Sums rather than means, so spectra of several fields add up before a ratio is taken.
    """
    if a.shape != b.shape or a.ndim != 3 or len(set(a.shape)) != 1:
        raise ValueError(f"cross_power needs two cubes of the same shape, got {a.shape} and {b.shape}")
    shells = Shells(a.shape[0], edges)
    return shells.sums(shells.transform(a), shells.transform(b))


def correlation(sums: np.ndarray) -> np.ndarray:
    """r per shell from :func:`cross_power` sums (NaN in a shell without modes)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums[0] / np.sqrt(sums[1] * sums[2])


def shell_centres(edges: np.ndarray) -> np.ndarray:
    """Middle of each shell, in units of k_f."""
    return 0.5 * (edges[1:] + edges[:-1])
