"""hybridpar: spatial, pipeline and data parallelism for 3D CNNs on volumes too large for one device.

The public surface is small: :func:`init_distributed`, :class:`ProcessGrid`, the layers in
:mod:`hybridpar.nn`, the layout changes :func:`scatter`, :func:`gather` and :class:`Redistribute`, and
:func:`infer` (a fully convolutional model on whole volumes, file to file, kept split).
"""

from hybridpar import data, fft, flops, nn, profiling
from hybridpar.comm import gather, no_grad_sync, redistribute, scatter
from hybridpar.entry import parallelize
from hybridpar.grid import ProcessGrid
from hybridpar.inference import infer
from hybridpar.nn.layout import Redistribute
from hybridpar.pipeline import Engine
from hybridpar.planner import GridSpec, LayerRule, ParallelSpec, PipelineSpec, SpecError, load_spec
from hybridpar.process.launchers import init_distributed
from hybridpar.profiling import timeline

__all__ = ["ProcessGrid", "init_distributed", "nn", "scatter", "gather", "redistribute", "Redistribute",
           "no_grad_sync", "parallelize", "Engine", "load_spec", "ParallelSpec", "GridSpec", "PipelineSpec",
           "LayerRule", "SpecError", "fft", "flops", "profiling", "timeline", "infer", "data"]
__version__ = "0.1.0"
