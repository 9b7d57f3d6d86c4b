"""Pipeline and hybrid parallelism: schedules, the stage builder, gradient reduction, the engine."""

from hybridpar.perfmodel.pipeline import bubble_fraction
from hybridpar.pipeline.engine import Engine, parallelize
from hybridpar.pipeline.schedule import schedule

__all__ = ["Engine", "parallelize", "schedule", "bubble_fraction"]
