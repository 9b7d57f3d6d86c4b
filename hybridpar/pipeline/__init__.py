"""Pipeline and hybrid parallelism: schedules, the stage builder, gradient reduction, the engine."""

from hybridpar.pipeline.engine import Engine, parallelize
from hybridpar.planner.schedule import bubble_fraction, schedule

__all__ = ["Engine", "parallelize", "schedule", "bubble_fraction"]
