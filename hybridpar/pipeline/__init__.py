"""Pipeline and hybrid parallelism: schedules, the stage builder, gradient reduction, the engine
(:func:`hybridpar.parallelize` builds one)."""

from hybridpar.pipeline.engine import Engine
from hybridpar.planner.schedule import bubble_fraction, schedule

__all__ = ["Engine", "schedule", "bubble_fraction"]
