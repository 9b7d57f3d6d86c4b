"""A layer's window along one dim, as one typed record: :class:`Window`.

Why: the halos a split layer exchanges, the planner's halo widths, ``explain``, the FLOP counter's
per-rank shares and the performance model's kernel shapes all follow from the same few numbers per
dim (kernel, stride, padding, dilation, ceil mode, padding mode, and for a transposed convolution its
output padding). A registry entry gives them once (``window=``, one record per dim D, H, W) and every
reader asks the record, so the description cannot drift between them; :meth:`Window.plans` is the one
place that picks ``geometry.window_plans`` or ``geometry.transposed_plans`` for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar import geometry
from hybridpar.geometry import HaloPlan

Windows = tuple["Window", ...]


@dataclass(frozen=True)
class Window:
    """One dim of a window layer: global output ``o`` reads inputs ``o*stride - pad_lo + j*dilation``
    for ``j`` in ``0..kernel-1`` (:mod:`hybridpar.geometry`'s convention).

    ``mode`` is what lies beyond the volume's faces: ``"zeros"`` (a fill: the Dist layer says which),
    ``"circular"`` (a periodic box: halos wrap around), ``"replicate"`` or ``"reflect"`` (edge voxels
    copied). A pad layer is a window of kernel 1 whose ``pad_lo``/``pad_hi`` may be negative (a crop).
    ``transposed`` marks a transposed convolution: its symmetric padding is ``pad_lo == pad_hi`` and
    ``output_padding`` adds voxels at the high end, as in ``torch.nn.ConvTranspose3d``.
    """

    kernel: int
    stride: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    dilation: int = 1
    ceil_mode: bool = False
    mode: str = "zeros"
    transposed: bool = False
    output_padding: int = 0

    def __post_init__(self) -> None:
        for name in ("kernel", "stride", "dilation", "pad_lo", "pad_hi", "output_padding"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Window: {name} must be an int, got {value!r}")
        for name in ("kernel", "stride", "dilation"):
            if getattr(self, name) < 1:
                raise ValueError(f"Window: {name} must be at least 1, got {getattr(self, name)}")
        object.__setattr__(self, "mode", geometry.padding_mode(self.mode))  # checked; "constant" is "zeros"
        if self.transposed:
            if self.pad_lo != self.pad_hi or self.pad_lo < 0 or self.ceil_mode or self.mode != "zeros":
                raise ValueError("Window: a transposed window has one non-negative padding (pad_lo == "
                                 f"pad_hi), zeros mode and no ceil mode, got {self}")
        elif self.output_padding:
            raise ValueError(f"Window: output_padding {self.output_padding} belongs to a transposed window "
                             "(transposed=True)")

    @property
    def span(self) -> int:
        """Input voxels one output reads, from the first to the last: ``dilation * (kernel - 1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    @property
    def padded(self) -> bool:
        """Whether the window reads beyond the volume's faces (padding on either side)."""
        return self.pad_lo > 0 or self.pad_hi > 0

    def output_extent(self, extent: int) -> int:
        """Global output extent along this dim for a global input ``extent``, as torch computes it."""
        if self.transposed:
            return geometry.transposed_output_extent(extent, self.kernel, self.stride, self.pad_lo,
                                                     self.dilation, self.output_padding)
        return geometry.conv_output_extent(extent, self.kernel, self.stride, self.pad_lo, self.pad_hi,
                                           self.dilation, self.ceil_mode)

    def extended(self, out: int) -> int:
        """Input extent an unpadded kernel needs to give ``out`` outputs (a shard plus its halos)."""
        return (out - 1) * self.stride + self.span

    def plans(self, extent: int, parts: int, *, layer: str = "layer", dim: str = "dim",
              out_extent: int | None = None) -> list[HaloPlan]:
        """Every rank's halo plan along this dim for ``extent`` split in ``parts`` (raises
        ``geometry.HaloError`` naming ``layer`` and ``dim`` where the split is too fine)."""
        if self.transposed:
            return self.transposed_plans(extent, parts, layer=layer, dim=dim)[0]
        return geometry.window_plans(extent, parts, self.kernel, self.stride, self.pad_lo, self.pad_hi,
                                     self.dilation, self.ceil_mode, out_extent=out_extent, layer=layer,
                                     dim=dim, mode=self.mode)

    def transposed_plans(self, extent: int, parts: int, *, layer: str = "layer",
                         dim: str = "dim") -> tuple[list[HaloPlan], list[int]]:
        """A transposed window's plans and, per rank, the global output index of its local result
        (``geometry.transposed_plans``)."""
        if not self.transposed:
            raise ValueError(f"{layer}: transposed_plans of a window that is not transposed")
        return geometry.transposed_plans(extent, parts, self.kernel, self.stride, self.pad_lo, self.dilation,
                                         self.output_padding, layer=layer, dim=dim)

    def describe(self) -> str:
        """Short text for error messages: ``k3 s1 p1/1`` and what else differs from the defaults."""
        text = f"k{self.kernel} s{self.stride} p{self.pad_lo}/{self.pad_hi}"
        text += f" d{self.dilation}" if self.dilation != 1 else ""
        text += " ceil" if self.ceil_mode else ""
        text += f" {self.mode}" if self.mode != "zeros" else ""
        text += f" transposed op{self.output_padding}" if self.transposed else ""
        return text


def checked(value: object, layer: str, dims: int | None = None) -> Windows:
    """``value`` (what a registry entry's ``window`` gave for ``layer``) as a tuple of :class:`Window`,
    one per dim; a list of dicts or a wrong count is a TypeError naming the layer."""
    if not isinstance(value, Sequence) or not value or not all(isinstance(w, Window) for w in value):
        raise TypeError(f"{layer}: a registry entry's window= must give one hybridpar.nn.Window per spatial "
                        f"dim (D, H, W), got {value!r}")
    if dims is not None and len(value) != dims:
        raise TypeError(f"{layer}: window= gives {len(value)} Window records for {dims} spatial dims")
    return tuple(value)


def describe(windows: Windows) -> str:
    """Per dim text of ``windows`` (``k3 s1 p1/1 x3`` when the dims agree)."""
    texts = [w.describe() for w in windows]
    return f"{texts[0]} x{len(texts)}" if len(set(texts)) == 1 else " | ".join(texts)
