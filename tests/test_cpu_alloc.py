"""hybridpar.device.cpu_alloc: glibc takes the settings, the switch turns them off, and with them a GPipe-like
pattern (allocate many activation-sized blocks, free them all, again) stops returning the heap's top
to the kernel between steps (the resident set stays, instead of being faulted back in every step)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hybridpar.device import cpu_alloc

glibc = pytest.mark.skipif(cpu_alloc._libc() is None, reason="needs glibc's mallopt")

# Minor page faults of 5 rounds of: allocate 40 blocks of 1.7 MiB, touch them, free them all.
FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from hybridpar.device import cpu_alloc
    took = cpu_alloc.tune() if sys.argv[1] == "tune" else False
    def step():
        held = [torch.ones(2, 16, 24, 24, 24) for _ in range(40)]
        del held
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return out[0], int(out[1])


@glibc
def test_tune_keeps_freed_activation_memory():
    """Default glibc faults fresh pages in every step (here ~17,600 faults over 5 steps of 40 blocks,
    the count depending on how the kernel backs them); tuned, about one block's worth (~430)."""
    took, tuned = _faults("tune")
    # glibc's starting mmap threshold, pinned: freeing a large mapped block (importing torch's compiler
    # stack does) raises the dynamic threshold and would make the default process keep its heap too
    _, default = _faults("none", {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert took == "True"
    assert default >= 5 * 40  # at least one fault per block and step: the memory went back each time
    assert tuned * 10 < default


@glibc
def test_switch_and_idempotence(monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_MALLOC_TUNING", "0")
    assert cpu_alloc.tune(force=True) is False and not cpu_alloc.tuned()
    monkeypatch.delenv("HYBRIDPAR_MALLOC_TUNING")
    assert cpu_alloc.tune(force=True) is True and cpu_alloc.tuned()
    assert cpu_alloc.tune() is True  # cached
