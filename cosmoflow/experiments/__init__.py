"""Experiments that answer a scientific question with the application, each one command.

``volume``: does training on larger volumes of the same universes measure cosmology better?
Run ``python -m cosmoflow.experiments.volume``; the pieces are apart so that each can be tested alone:
:mod:`.study` (the configuration and the runs it implies), :mod:`.averaging` (per-universe scores),
:mod:`.report` (table, plot, result file).
"""
