"""Synthetic dark-matter universes shaped like the ExaLearn/MLPerf CosmoFlow files, in pure numpy.

Why: the real data set is about 9,200 universes of 512³×4 int16 (9 TiB), which a newcomer, a CI job or a
laptop demo does not have. A universe here is cheap (a 128³ one takes about 0.4 s) yet carries the
physics that makes the four parameters learnable: the amplitude of clustering follows σ_8, its
scale dependence follows Ω_m (through the transfer function's turnover), n_s tilts it, and H_0 sets
the box in Mpc/h. The pipeline is the textbook one:

1. linear power spectrum ``P(k) = A kⁿˢ T²(k)``, ``T`` the Eisenstein & Hu (1998) no-wiggle transfer
   function, ``A`` fixed so that the rms of the field in top-hat spheres of 8 Mpc/h is σ_8;
2. a Gaussian random field with that spectrum on an N³ grid of a periodic box ``L = N·v·h`` Mpc/h, the
   voxel ``v`` fixed in Mpc (1/0.7 by default, so ``L = N·(H_0/70)``; ``voxel_mpc`` coarsens it)
   (white noise in real space, coloured in Fourier space, so it is real and deterministic per seed);
3. the field smoothed by a Gaussian of ~2 Mpc/h, so that the Zel'dovich approximation does not
   over-cross shells at the voxel scale (which would wash the clustering out again at late times
   and break "clustering grows with time");
4. the Zel'dovich displacement ``ψ_k = i k δ_k / k²`` (so that ``δ = -∇·ψ``), scaled by the linear
   growth factor ``D(z)`` at z = 3, 1.5, 0.5, 0, applied to one particle per voxel on the lattice;
5. nearest-grid-point counts, int16, mean exactly 1 per voxel, channels last: the ``full`` dataset.

Units: wavenumbers in h/Mpc, lengths in Mpc/h, ``P`` in (Mpc/h)³ with the convention
``<δ_k δ*_k'> = (2π)³ δ_D(k - k') P(k)``. Parameters travel as ``unitPar`` ``u ∈ [-1, 1]⁴`` with
physical = fiducial·(1 + 0.1·u), fiducial (Ω_m, σ_8, n_s, H_0) = (0.3, 0.8, 0.96, 70), as in the real set.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FIDUCIAL = (0.3, 0.8, 0.96, 70.0)
"""Fiducial (Ω_m, σ_8, n_s, H_0); ``unitPar`` u maps to fiducial·(1 + 0.1·u)."""
PARAM_NAMES = ("Omega_m", "sigma_8", "n_s", "H_0")
REDSHIFTS = (0.0, 0.5, 1.5, 3.0)
"""Snapshot redshifts of the four channels, in the order of the real data set."""
OMEGA_B = 0.049
"""Baryon density, held fixed (the real set varies only the four parameters above)."""
T_CMB = 2.7255
SIGMA_R = 8.0
"""Radius (Mpc/h) of the top-hat sphere σ_8 is defined in."""
SMOOTHING = 2.0
"""Gaussian smoothing radius (Mpc/h) applied to the linear field before displacing particles."""
VOXEL_MPC = 1.0 / 0.7
"""Default voxel side in Mpc (1 Mpc/h at the fiducial H_0): fixed in Mpc, so the box in Mpc/h follows H_0."""

Seed = int | Sequence[int]
"""Anything ``numpy.random.SeedSequence`` accepts as entropy: an int or a sequence of ints."""


@dataclass(frozen=True)
class Cosmology:
    """The four parameters CosmoFlow regresses, in physical units (H_0 in km/s/Mpc)."""

    omega_m: float = FIDUCIAL[0]
    sigma_8: float = FIDUCIAL[1]
    n_s: float = FIDUCIAL[2]
    h0: float = FIDUCIAL[3]

    @classmethod
    def from_unit(cls, unit: Sequence[float] | np.ndarray) -> Cosmology:
        """The cosmology of a ``unitPar`` vector ``u`` (physical = fiducial·(1 + 0.1·u))."""
        u = np.asarray(unit, dtype=np.float64)
        if u.shape != (4,):
            raise ValueError(f"unitPar must have shape (4,) (Omega_m, sigma_8, n_s, H_0), got {u.shape}")
        phys = np.asarray(FIDUCIAL) * (1.0 + 0.1 * u)
        return cls(*(float(p) for p in phys))

    def to_unit(self) -> np.ndarray:
        """The ``unitPar`` vector (float32, shape (4,)) of this cosmology."""
        phys = np.array([self.omega_m, self.sigma_8, self.n_s, self.h0])
        return ((phys / np.asarray(FIDUCIAL) - 1.0) / 0.1).astype(np.float32)

    @property
    def h(self) -> float:
        """Dimensionless Hubble parameter H_0 / (100 km/s/Mpc)."""
        return self.h0 / 100.0


def box_size(n: int, h0: float, voxel_mpc: float = VOXEL_MPC) -> float:
    """Box side in Mpc/h for ``n`` voxels of ``voxel_mpc`` Mpc: ``n·voxel_mpc·h``; by default ``n·(H_0/70)``,
    a fixed n/0.7 Mpc whatever h is. A coarser voxel covers the same box with fewer voxels (a 64³
    universe of 2/0.7 Mpc voxels spans the box of a default 128³ one at an eighth of the cost)."""
    return n * voxel_mpc * h0 / 100.0


def eisenstein_hu_nowiggle(k: np.ndarray, omega_m: float, h: float, omega_b: float = OMEGA_B,
                           t_cmb: float = T_CMB) -> np.ndarray:
    """Eisenstein & Hu (1998, ApJ 496, 605) zero-baryon-oscillation transfer function, eqs. 26, 28-31.

    ``k`` in h/Mpc. Chosen over BBKS because it keeps the baryon suppression of small-scale power
    (which makes the spectrum's shape depend on Ω_m) without the BAO wiggles a 128 Mpc/h box cannot
    resolve anyway.
    """
    k = np.asarray(k, dtype=np.float64)
    omh2, obh2 = omega_m * h * h, omega_b * h * h
    fb = omega_b / omega_m
    theta = t_cmb / 2.7
    s = 44.5 * np.log(9.83 / omh2) / np.sqrt(1.0 + 10.0 * obh2 ** 0.75)  # sound horizon, Mpc
    alpha = 1.0 - 0.328 * np.log(431.0 * omh2) * fb + 0.38 * np.log(22.3 * omh2) * fb * fb
    gamma = omega_m * h * (alpha + (1.0 - alpha) / (1.0 + (0.43 * k * h * s) ** 4))
    q = k * theta * theta / gamma
    l0 = np.log(2.0 * np.e + 1.8 * q)
    c0 = 14.2 + 731.0 / (1.0 + 62.5 * q)
    return l0 / (l0 + c0 * q * q)


def tophat_window(x: np.ndarray) -> np.ndarray:
    """Fourier transform of a unit-volume sphere, ``3 (sin x - x cos x) / x³`` (series below x = 1e-3)."""
    x = np.asarray(x, dtype=np.float64)
    small = np.abs(x) < 1e-3
    xs = np.where(small, 1.0, x)
    w = 3.0 * (np.sin(xs) - xs * np.cos(xs)) / xs ** 3
    return np.where(small, 1.0 - x * x / 10.0, w)


def _log_k_grid(k_min: float = 1e-5, k_max: float = 1e3, n: int = 8192) -> np.ndarray:
    return np.geomspace(k_min, k_max, n)


def _integrate(y: np.ndarray, x: np.ndarray) -> float:
    """Trapezoid rule (numpy renamed ``trapz`` across versions; this works on all of them)."""
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2.0)


class PowerSpectrum:
    """Linear matter power spectrum at z = 0, ``A kⁿˢ T²(k)`` in (Mpc/h)³, normalised to σ_8.

    The amplitude is found once, at construction, by integrating ``k³P(k)W²(kR)/(2π²)`` over ln k.
    """

    def __init__(self, cosmo: Cosmology) -> None:
        self.cosmo = cosmo
        self.amplitude = 1.0
        self.amplitude = cosmo.sigma_8 ** 2 / self.sigma(SIGMA_R) ** 2

    def __call__(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=np.float64)
        t = eisenstein_hu_nowiggle(k, self.cosmo.omega_m, self.cosmo.h)
        with np.errstate(divide="ignore"):
            p = self.amplitude * np.power(k, self.cosmo.n_s) * t * t
        return np.where(k > 0, p, 0.0)

    def sigma(self, radius: float) -> float:
        """rms linear overdensity in top-hat spheres of ``radius`` Mpc/h (σ_8 at radius 8)."""
        k = _log_k_grid()
        integrand = k ** 3 * self(k) * tophat_window(k * radius) ** 2 / (2.0 * np.pi ** 2)
        return float(np.sqrt(_integrate(integrand, np.log(k))))


def growth_factor(z: float | np.ndarray, omega_m: float) -> np.ndarray:
    """Linear growth factor of flat ΛCDM normalised to D(0) = 1 (Heath 1977 integral).

    ``D(a) ∝ E(a) ∫₀ᵃ da' / (a' E(a'))³`` with ``E(a)² = Ω_m a⁻³ + 1 - Ω_m``; radiation neglected,
    which is exact to well under a percent at z ≤ 3.
    """
    def unnormalised(a: float) -> float:
        x = np.linspace(0.0, a, 4097)[1:]
        e = np.sqrt(omega_m / x ** 3 + 1.0 - omega_m)
        y = 1.0 / (x * e) ** 3
        # (a E)^-3 -> (a/Ω_m)^{3/2} as a -> 0, so the integrand vanishes at 0: prepend that point.
        integral = _integrate(np.concatenate([[0.0], y]), np.concatenate([[0.0], x]))
        return float(np.sqrt(omega_m / a ** 3 + 1.0 - omega_m) * integral)

    zs = np.atleast_1d(np.asarray(z, dtype=np.float64))
    d0 = unnormalised(1.0)
    out = np.array([unnormalised(1.0 / (1.0 + zi)) / d0 for zi in zs])
    return out if np.ndim(z) else out[0]


def wavenumbers(n: int, box: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Broadcastable k-vector components (h/Mpc) of the ``rfftn`` layout of an n³ grid of side ``box``."""
    kf = 2.0 * np.pi / box
    kx = (np.fft.fftfreq(n, d=1.0 / n) * kf).astype(np.float32)
    kz = (np.fft.rfftfreq(n, d=1.0 / n) * kf).astype(np.float32)
    return kx[:, None, None], kx[None, :, None], kz[None, None, :]


def _rngs(seed: Seed) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent streams for the parameters and for the field, both fixed by ``seed``.

    Separate streams let a test hold the field's phases fixed while it varies a parameter.
    """
    params, field = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(params), np.random.default_rng(field)


def draw_unit_params(seed: Seed) -> np.ndarray:
    """``unitPar`` drawn uniformly in [-1, 1]⁴ (float32), deterministic per ``seed``."""
    return _rngs(seed)[0].uniform(-1.0, 1.0, size=4).astype(np.float32)


def linear_field_k(n: int, cosmo: Cosmology, seed: Seed, smoothing: float = 0.0,
                   voxel_mpc: float = VOXEL_MPC) -> np.ndarray:
    """Fourier modes (``rfftn`` layout, complex64) of the z = 0 Gaussian linear density field.

    Unit white noise ``w`` has ``<|w_k|²> = N³``; multiplying by ``sqrt(P(k)/ΔV)`` (ΔV the voxel volume)
    gives ``<|δ_k|²> = P N⁶/L³``, i.e. the estimator ``|δ_k|² L³/N⁶`` recovers ``P``. Drawing the
    noise in real space makes the field exactly real and the phases independent of the parameters.
    """
    box = box_size(n, cosmo.h0, voxel_mpc)
    noise = _rngs(seed)[1].standard_normal((n, n, n), dtype=np.float32)
    kx, ky, kz = wavenumbers(n, box)
    k = np.sqrt(kx * kx + ky * ky + kz * kz)
    amp = np.sqrt(PowerSpectrum(cosmo)(k) / (box / n) ** 3)
    if smoothing > 0:
        amp = amp * np.exp(-0.5 * (k * smoothing) ** 2)
    delta_k = np.fft.rfftn(noise)
    delta_k *= amp.astype(np.float32)
    return delta_k.astype(np.complex64, copy=False)


def linear_field(n: int, cosmo: Cosmology, seed: Seed, smoothing: float = 0.0,
                 voxel_mpc: float = VOXEL_MPC) -> np.ndarray:
    """The z = 0 linear density contrast on the grid (float32, n³), deterministic per ``seed``."""
    return real_field(linear_field_k(n, cosmo, seed, smoothing, voxel_mpc), n)


def real_field(delta_k: np.ndarray, n: int) -> np.ndarray:
    """The real n³ field (float32) of ``rfftn``-layout modes."""
    return np.fft.irfftn(delta_k, s=(n, n, n), axes=(0, 1, 2)).astype(np.float32)


@functools.lru_cache(maxsize=4)
def _shells(n: int, box: float, edges: tuple[float, ...]) -> tuple[np.ndarray, ...]:
    """The ``rfftn`` modes' |k|, shell index, in-a-shell mask, count (at least 1) and mean |k| per shell:
    the same for every field of one grid, so worked out once per (n, box, edges) (many crops share one)."""
    kx, ky, kz = wavenumbers(n, box)
    k = np.sqrt(kx.astype(np.float64) ** 2 + ky.astype(np.float64) ** 2 + kz.astype(np.float64) ** 2)
    k = np.broadcast_to(k, (n, n, n // 2 + 1)).ravel()
    which = np.digitize(k, edges) - 1
    inside = (which >= 0) & (which < len(edges) - 1)
    bins = len(edges) - 1
    count_safe = np.maximum(np.bincount(which[inside], minlength=bins).astype(np.float64), 1)
    k_mean = np.bincount(which[inside], weights=k[inside], minlength=bins) / count_safe
    out = (k, which, inside, count_safe, k_mean)
    for a in out:
        a.setflags(write=False)
    return out


def measure_power(delta: np.ndarray, box: float, edges: np.ndarray,
                  power: PowerSpectrum | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shell-averaged power of a real field: (mean k, measured P, P expected over the same modes).

    The expected value averages ``power`` over exactly the modes in each shell (``None``: zeros), so a
    comparison carries no binning bias. Shells are ``edges[i] <= |k| < edges[i+1]`` in h/Mpc.
    """
    n = delta.shape[0]
    dk = np.fft.rfftn(delta.astype(np.float64))
    k, which, inside, count_safe, k_mean = _shells(n, float(box), tuple(float(e) for e in edges))
    bins = len(edges) - 1
    p = (np.abs(dk) ** 2).ravel() * box ** 3 / n ** 6
    p_mean = np.bincount(which[inside], weights=p[inside], minlength=bins) / count_safe
    expected = np.zeros(bins)
    if power is not None:
        expected = np.bincount(which[inside], weights=power(k[inside]), minlength=bins) / count_safe
    return k_mean, p_mean, expected


def zeldovich_displacement(delta_k: np.ndarray, n: int, box: float) -> np.ndarray:
    """Displacement field ψ (3, n, n, n) float32, in Mpc/h, with ``ψ_k = i k δ_k / k²`` (so ``δ = -∇·ψ``)."""
    kx, ky, kz = wavenumbers(n, box)
    k2 = kx * kx + ky * ky + kz * kz
    k2[0, 0, 0] = 1.0  # the mean mode carries no displacement (δ_0 = 0 after the next line)
    scaled = delta_k / k2
    scaled[0, 0, 0] = 0.0
    psi = np.empty((3, n, n, n), dtype=np.float32)
    for axis, ka in enumerate((kx, ky, kz)):
        psi[axis] = np.fft.irfftn(1j * ka * scaled, s=(n, n, n), axes=(0, 1, 2))
    return psi


def ngp_counts(psi: np.ndarray, growth: float, cell: float) -> np.ndarray:
    """int16 counts of the lattice particles moved by ``growth·ψ``, nearest grid point, periodic.

    One particle starts at each voxel centre, so the mean count is exactly 1 per voxel.
    """
    n = psi.shape[1]
    lattice = np.arange(n, dtype=np.float32)
    shift = np.float32(growth / cell)
    flat = np.zeros(psi.shape[1:], dtype=np.int64)
    for axis in range(3):
        pos = psi[axis] * shift
        pos += lattice.reshape([n if a == axis else 1 for a in range(3)])
        idx = np.rint(pos).astype(np.int64) % n
        flat *= n
        flat += idx
    counts = np.bincount(flat.ravel(), minlength=n ** 3)
    if counts.max() > np.iinfo(np.int16).max:
        raise OverflowError(f"a voxel holds {counts.max()} particles, more than int16 can count")
    return counts.astype(np.int16).reshape(n, n, n)


def make_universe(n: int, unit_par: Sequence[float] | np.ndarray, seed: Seed,
                  redshifts: Sequence[float] = REDSHIFTS, smoothing: float = SMOOTHING,
                  voxel_mpc: float = VOXEL_MPC) -> np.ndarray:
    """One universe as the real ``full`` dataset: (n, n, n, len(redshifts)) int16, channels last.

    Deterministic for a given ``(n, unit_par, seed)``; the field's phases depend on ``seed`` only, so
    universes that share a seed differ only through their parameters.
    """
    return _evolve(n, unit_par, seed, redshifts, smoothing, voxel_mpc, keep_linear=False)[0]


def make_universe_and_linear(n: int, unit_par: Sequence[float] | np.ndarray, seed: Seed,
                             redshifts: Sequence[float] = REDSHIFTS,
                             smoothing: float = SMOOTHING,
                             voxel_mpc: float = VOXEL_MPC) -> tuple[np.ndarray, np.ndarray]:
    """``(full, linear)``: the universe of :func:`make_universe` and the field that made it.

    ``linear`` (n, n, n) float32 is the z = 0 linear density contrast, smoothed exactly as the field
    whose Zel'dovich displacements moved the particles: the truth a reconstruction of the initial
    conditions aims at (modes the smoothing removed left no trace in the counts).
    """
    full, linear = _evolve(n, unit_par, seed, redshifts, smoothing, voxel_mpc, keep_linear=True)
    assert linear is not None
    return full, linear


def _evolve(n: int, unit_par: Sequence[float] | np.ndarray, seed: Seed, redshifts: Sequence[float],
            smoothing: float, voxel_mpc: float, keep_linear: bool) -> tuple[np.ndarray, np.ndarray | None]:
    if n < 2:
        raise ValueError(f"universe size must be at least 2 voxels, got {n}")
    cosmo = Cosmology.from_unit(unit_par)
    if voxel_mpc <= 0:
        raise ValueError(f"voxel side must be positive, got {voxel_mpc} Mpc")
    box = box_size(n, cosmo.h0, voxel_mpc)
    delta_k = linear_field_k(n, cosmo, seed, smoothing, voxel_mpc)
    psi = zeldovich_displacement(delta_k, n, box)
    growth = np.atleast_1d(growth_factor(np.asarray(redshifts, dtype=np.float64), cosmo.omega_m))
    full = np.empty((n, n, n, len(redshifts)), dtype=np.int16)
    for c, d in enumerate(growth):
        full[..., c] = ngp_counts(psi, float(d), box / n)
    return full, real_field(delta_k, n) if keep_linear else None


def universe_from_seed(n: int, seed: Seed, **kwargs: object) -> tuple[np.ndarray, np.ndarray]:
    """``(full, unitPar)`` with the parameters drawn from ``seed`` too."""
    unit = draw_unit_params(seed)
    return make_universe(n, unit, seed, **kwargs), unit  # type: ignore[arg-type]
