"""neuraloperator's FNO on split volumes (the optional extra ``neuraloperator``; skipped without it).

Their ``SpectralConv`` against :class:`hybridpar.nn.neuralop.DistSpectralConv` on every grid of 1-8
ranks the layer suites use, odd and uneven extents, forward and backward in float64; their positional
grid against the split one; ``hp.parallelize(neuralop.models.FNO(...))`` trained three SGD steps split
(2, 1, 1) and (2, 2, 1) against one process; what does not split, refused in one line naming it.

Theirs collects the mixed modes in a complex64 buffer whatever the input's dtype; the split layer keeps
the input's precision. The float64 reference is therefore theirs with that buffer complex128
(:func:`_their_buffer_in_float64`), to 1e-10; against theirs as shipped, to float32's rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from distributed import GRIDS, flat_grids, grid_ids
from layer_cases import Failures, steps_match

pytest.importorskip("neuralop", reason="the optional extra neuraloperator is not installed")

# (input shape, n_modes, separable): odd, even and uneven extents; n_modes beyond an extent (D of 5
# with 6 modes: theirs slices its weight to the modes there are); odd n_modes (asymmetric about k = 0)
CASES = [((2, 2, 7, 6, 5), (4, 4, 4), False), ((1, 3, 5, 9, 8), (6, 5, 5), False),
         ((1, 2, 4, 5, 6), (3, 4, 6), True), ((1, 1, 8, 8, 8), (8, 8, 8), False)]


class _Complex128Buffer:
    """``torch`` as neuraloperator's spectral convolution module sees it, but for its mode buffer:
    ``torch.zeros(..., dtype=torch.cfloat)`` made complex128."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, dtype=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, dtype=torch.complex128 if dtype == torch.cfloat else dtype, **kwargs)


@contextlib.contextmanager
def _their_buffer_in_float64() -> Iterator[None]:
    import neuralop.layers.spectral_convolution as theirs

    saved, theirs.torch = theirs.torch, _Complex128Buffer()
    try:
        yield
    finally:
        theirs.torch = saved


def _float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model.double()``, complex parameters too (``Module.double`` leaves complex64 as it is)."""
    model.double()
    for p in model.parameters():
        if p.is_complex():
            p.data = p.data.to(torch.complex128)
    return model


def _conv_body(rank: int, world: int, shape3: tuple[int, int, int]) -> None:
    from neuralop.layers.embeddings import GridEmbeddingND
    from neuralop.layers.spectral_convolution import SpectralConv

    import hybridpar as hp
    from hybridpar.nn.neuralop import DistGridEmbeddingND, DistSpectralConv

    fails = Failures()
    grid = hp.ProcessGrid(spatial=shape3)
    for shape, n_modes, separable in CASES:
        desc = f"grid {shape3} input {shape} n_modes {n_modes}{' separable' if separable else ''}"
        g = torch.Generator().manual_seed(sum(shape) + sum(n_modes))
        torch.manual_seed(sum(shape))
        cout = shape[1] if separable else 3
        ref = _float64(SpectralConv(shape[1], cout, n_modes, separable=separable))
        with torch.no_grad():
            ref.bias.normal_(generator=g)
        ours = DistSpectralConv(ref, grid=grid)
        ours.load_state_dict(ref.state_dict())
        if list(ours.state_dict()) != list(ref.state_dict()):
            fails.append(f"{desc}: state keys {list(ours.state_dict())} != {list(ref.state_dict())}")
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        w = torch.randn((shape[0], cout, *shape[2:]), dtype=torch.float64, generator=g)
        xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        with _their_buffer_in_float64():
            want = ref(xr)
        got = hp.gather(ours(hp.scatter(xg, grid)), grid)
        (want * w).sum().backward()
        (got * w).sum().backward()
        fails.check(f"{desc} forward", got.detach(), want.detach())
        fails.check(f"{desc} input gradient", xg.grad, xr.grad)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
            fails.check(f"{desc} {name} gradient", q.grad, p.grad)
        with torch.no_grad():  # theirs as shipped: the same to float32's rounding (its complex64 buffer)
            fails.check(f"{desc} forward against theirs as shipped", got, ref(x), 1e-5)
    # the positional grid: the global grid's coordinates at this rank's voxels, to the bit
    emb = GridEmbeddingND(2, dim=3, grid_boundaries=[[0.0, 1.0], [-1.0, 2.0], [0.5, 0.75]])
    x = torch.randn(2, 2, 7, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    if not torch.equal(hp.gather(DistGridEmbeddingND(emb, grid=grid)(hp.scatter(x, grid)), grid), emb(x)):
        fails.append(f"grid {shape3}: the split GridEmbeddingND differs from theirs")
    fails.raise_if_any(rank)


@pytest.mark.parametrize("world,shape3", flat_grids(GRIDS), ids=grid_ids(flat_grids(GRIDS)))
def test_spectral_conv_and_grid_embedding_match_theirs(pools, world, shape3):
    pools(world).run(_conv_body, shape3, timeout=300)


# ---------------------------------------------------------------------- FNO by parallelize
def _fno(**kwargs) -> torch.nn.Module:
    from neuralop.models import FNO

    torch.manual_seed(0)
    args = dict(n_modes=(4, 4, 4), in_channels=1, out_channels=1, hidden_channels=4, n_layers=2,
                positional_embedding=None)
    return _float64(FNO(**{**args, **kwargs}))


def _train_body(rank: int, world: int, spec: dict, kwargs: dict) -> None:
    """Three SGD steps (momentum) of ``hp.parallelize(FNO)`` against one process: every loss, every
    parameter (complex included) and the predictions."""
    import warnings

    import torch.nn.functional as F

    import hybridpar as hp

    fails = Failures()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 1, 9, 8, 6, dtype=torch.float64, generator=g)
    y = torch.randn(2, 1, 9, 8, 6, dtype=torch.float64, generator=g)
    ref, model = _fno(**kwargs), _fno(**kwargs)
    model.load_state_dict(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # but for: run by module swapping, their forward reads x.shape[2:]
        warnings.filterwarnings("ignore", message=".*(Running it by module swapping|reads the spatial ext)")
        engine = hp.parallelize(model, hp.ParallelSpec.from_dict(spec), loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    with _their_buffer_in_float64(), warnings.catch_warnings():
        warnings.simplefilter("error")  # complex gradients reduced beside real ones, silently
        steps_match(fails, str(spec), engine, opt, ref, ref_opt, (x_local, y_local), (x, y), F.mse_loss)
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            fails.check(f"{spec} {name} after 3 steps", q.detach(), p.detach(), 1e-9)
        state = engine.full_state_dict()
        want_state = ref.state_dict()
        if list(state) != list(want_state):
            fails.append(f"{spec}: full_state_dict keys {list(state)} != the model's {list(want_state)}")
        for k, v in want_state.items():  # their _metadata (constructor arguments) included
            if isinstance(v, torch.Tensor):
                fails.check(f"{spec} full_state_dict {k}", state.get(k), v, 1e-9)
            elif state.get(k) != v:
                fails.append(f"{spec} full_state_dict {k}: {state.get(k)} != {v}")
        engine.eval()
        ref.eval()
        with torch.no_grad():
            want = ref(x)
            got = engine.predict(x_local)
    rows = slice(engine.grid.data_index * (x.shape[0] // engine.grid.data),
                 (engine.grid.data_index + 1) * (x.shape[0] // engine.grid.data))
    fails.check(f"{spec} predict", got, want[rows])
    fails.raise_if_any(rank)


# what of theirs does not split, and what its one line must say
REFUSED = [({"factorization": "tucker"}, ["fno_blocks.convs.0 (SpectralConv)", "factorization='tucker'",
                                          "use factorization=None"]),
           ({"resolution_scaling_factor": 1.5}, ["fno_blocks.convs.0 (SpectralConv)",
                                                 "resolution_scaling_factor=[1.5, 1.5, 1.5]",
                                                 "use resolution_scaling_factor=None"]),
           # FNO pads in its own forward (DomainPadding.pad, a method): the F.pad runs split, the crop that
           # undoes it (x[..., a:-b], indexing into the volume's dims) is refused
           ({"domain_padding": 0.25}, ["model (FNO)", "indexing into the volume's dims at padding.py",
                                       "outside any layer"])]


def _refused_body(rank: int, world: int, cases: list[dict]) -> list[str]:
    import warnings

    import torch.nn.functional as F

    import hybridpar as hp

    said = []
    x = torch.randn(2, 1, 8, 8, 6, dtype=torch.float64)
    for kwargs in cases:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
                engine = hp.parallelize(_fno(**kwargs), spec, loss_fn=F.mse_loss)
                engine.train_step(*engine.shard_batch(x, x))
            said.append("ran")
        except Exception as err:  # noqa: BLE001 (the message is what is tested)
            said.append(str(err))
    return said


def test_what_does_not_split_is_refused_in_one_line(pools):
    said = pools(2).run(_refused_body, [kwargs for kwargs, _ in REFUSED], timeout=120)[0]
    for (kwargs, words), line in zip(REFUSED, said, strict=True):
        assert "\n" not in line and all(w in line for w in words), f"FNO({kwargs}): {line}"


# their defaults but for the positional embedding: a "linear" FNO skip, a soft-gating channel-MLP skip;
# then the positional grid (split), and "identity" skips with a separable weight
MODELS = [({}, 2), ({"positional_embedding": "grid"}, 4),
          ({"fno_skip": "identity", "channel_mlp_skip": "linear", "separable": True}, 4)]
SPECS = {2: [{"grid": {"spatial": [2, 1, 1]}}, {"grid": {"data": 2}}], 4: [{"grid": {"spatial": [2, 2, 1]}},
                                                    {"grid": {"data": 2, "spatial": [2, 1, 1]}}]}


@pytest.mark.parametrize("world,spec,kwargs", [(w, s, k) for k, w in MODELS for s in SPECS[w]],
                         ids=lambda v: str(v).replace(" ", "") if isinstance(v, dict) else str(v))
def test_fno_trains_split_as_in_one_process(pools, world, spec, kwargs):
    pools(world).run(_train_body, spec, kwargs, timeout=300)


def test_refusals_of_the_layer_and_the_installed_convention():
    """One line per spectral convolution the split version does not compute as theirs; the check of
    how the installed version puts its modes back (2.0.0: ``fftshift`` twice, a shift on odd extents)."""
    from neuralop.layers.spectral_convolution import SpectralConv

    from hybridpar.nn.neuralop import refusal, rolls_odd_extents

    assert refusal(SpectralConv(2, 2, (4, 4, 4))) is None
    for kwargs, words in [({"complex_data": True}, "complex_data=False"),
                          ({"fno_block_precision": "mixed"}, "use 'full'"),
                          ({"n_modes": (4, 4)}, "a 2-D spectral convolution"),
                          ({"factorization": "cp"}, "factorization='cp'")]:
        conv = SpectralConv(2, 2, **{"n_modes": (4, 4, 4), **kwargs})
        assert words in refusal(conv), refusal(conv)

    class Shifted(SpectralConv):
        def forward(self, x, output_shape=None):
            return super().forward(x, output_shape)

    assert "its own forward" in refusal(Shifted(2, 2, (4, 4, 4)))
    import neuralop

    if neuralop.__version__ == "2.0.0":
        assert rolls_odd_extents(SpectralConv) is True
