"""Predict the time and memory of one training step of a spec before running it.

Why a package of its own: the scaling harness validates it against measurements on this machine, the
advisor (:mod:`hybridpar.advisor`) ranks thousands of layouts with it, and the extrapolations to
published systems run it on machines we do not have. All three need the same arithmetic, and none
may allocate a model: everything comes from the one plan (:mod:`hybridpar.planner.plan`), the FLOP
count (:mod:`hybridpar.flops`) and a small :class:`Machine` description. The package sits below the
runtime: only the calibration modules touch the engine, inside the functions that time it.

* :mod:`.machine`: a machine as data: per-op-class compute costs (``flops / flop_rate + bytes /
  byte_rate + overhead``), alpha-beta links (``latency + bytes / bandwidth``), presets for
  accelerator clusters (each stating its sources), a calibration saved as JSON.
* :mod:`.calibrate`, :mod:`.calibrate_layers`: measuring this host (the only parts that run torch
  kernels or talk to other processes): fitted op-class costs, links measured as a halo-like
  exchange right after computing (which can cost far more than a ping-pong), layer times at the
  exact shapes a workload needs, the engine's overhead per step and micro-batch.
* :mod:`.workload`: a model on a global input analysed once; every spec resolved against it.
* :mod:`.comm`: halo exchange (per split dim, one message from each neighbour of the plan's widest
  halo times the local face, the same volume of halo gradients back when the input needs a
  gradient), redistribution between splits (the box intersections :mod:`hybridpar.comm.redistribute`
  routes), hierarchical ring all-reduce, which link carries what.
* :mod:`.compute`, :mod:`.pipeline`, :mod:`.memory`: the terms of a step (each layer's work on the
  most loaded rank; the stages laid out in time with the bubble and the drain; bytes per rank).
* :mod:`.predict`: :func:`predict`, the terms assembled; breakdown categories follow
  :data:`hybridpar.profiling.CATEGORIES`.

What it leaves out: kernel-level effects no shape shows (algorithm choice, tensor-core alignment,
launch latency beyond a constant per op), I/O, and overlap of halo exchange with interior compute.
"""

from hybridpar.perfmodel.calibrate import (
    calibrate_compute,
    exchange_after_compute,
    fit_cost,
    fit_link,
    link_from_samples,
    local_machine,
    pingpong,
    time_loop,
)
from hybridpar.perfmodel.calibrate_layers import (
    layer_callables,
    measure_engine_overhead,
    measure_layer,
    measure_layers,
)
from hybridpar.perfmodel.comm_cost import allreduce_time, halo_bytes, redistribute_volume
from hybridpar.perfmodel.compute import LayerCost
from hybridpar.perfmodel.machine import (
    PRESETS,
    Compute,
    Cost,
    Link,
    Machine,
    default_cache,
    get_machine,
    load_machine,
    save_machine,
)
from hybridpar.perfmodel.pipeline_cost import drain_saving
from hybridpar.perfmodel.predict import Prediction, StageCost, predict
from hybridpar.perfmodel.workload import Workload, kernel_shape, layer_entries, layer_key
from hybridpar.planner.schedule import bubble_fraction

__all__ = ["Compute", "Cost", "LayerCost", "Link", "Machine", "PRESETS", "Prediction", "StageCost",
           "Workload", "allreduce_time", "bubble_fraction", "calibrate_compute", "default_cache",
           "drain_saving", "exchange_after_compute", "fit_cost", "fit_link", "get_machine",
           "halo_bytes", "kernel_shape", "layer_callables", "layer_entries", "layer_key",
           "link_from_samples", "load_machine", "local_machine", "measure_engine_overhead",
           "measure_layer", "measure_layers", "pingpong", "predict", "redistribute_volume",
           "save_machine", "time_loop"]
