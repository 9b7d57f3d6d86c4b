"""The layers a 3D U-Net needs against torch.nn on the gathered tensors (float64, relative error <= 1e-10):
DistUpsample / dist_interpolate, DistGroupNorm, DistInstanceNorm3d, the adaptive pools and the
DistBatchNorm3d fixes, on split grids of 1-8 ranks (one pytest test per grid and case family, sharing one
process group per world size; cases in new_layer_cases.py). Plus the registry's halo widths for Upsample,
which need no process group."""

from __future__ import annotations

import pytest
from torch import nn

from hybridpar.geometry import HaloError
from hybridpar.nn import registry

import distributed
import layer_cases
import new_layer_cases


@pytest.mark.parametrize("family", list(new_layer_cases.FAMILIES))
@pytest.mark.parametrize("world,shape", distributed.flat_grids(),
                         ids=distributed.grid_ids(distributed.flat_grids()))
def test_new_layers_match_torch(pools, world, shape, family):
    counts = pools(world).run(layer_cases.run_family, "new_layer_cases", shape, family, timeout=600)
    assert counts[0] > 0, f"no {family} case ran on grid {shape}"


def test_upsample_halos_and_roles():
    """The planner's view: Upsample resamples with small halos, a too fine split of a strong
    downsampling is a HaloError naming what fits; norms are pointwise; adaptive pools replicate."""
    up = nn.Upsample(scale_factor=2, mode="trilinear")
    entry = registry.lookup(up)
    assert entry.role == "resample"
    halos = entry.halo_widths(up, "up", (1, 4, 16, 16, 16), (1, 4, 32, 32, 32), (2, 1, 4))
    assert halos[1] == (0, 0)
    assert all(0 <= lo <= 1 and 0 <= hi <= 1 for lo, hi in halos)
    down = nn.Upsample(scale_factor=0.2, mode="nearest")
    with pytest.raises(HaloError, match="use a split of at most 2"):
        registry.lookup(down).halo_widths(down, "down", (1, 1, 13, 13, 13), (1, 1, 2, 2, 2), (3, 1, 1))
    for m in (nn.GroupNorm(2, 4), nn.InstanceNorm3d(4), nn.BatchNorm3d(4)):
        assert (registry.lookup(m).role, registry.lookup(m).op) == ("pointwise", "norm")
    for m in (nn.AdaptiveAvgPool3d(3), nn.AdaptiveMaxPool3d((1, None, 2)), nn.AdaptiveAvgPool3d(1)):
        assert registry.lookup(m).replicated_output(m)
