"""Stage-to-stage transfers by cross-memory attach (``parallelize(..., local_p2p=...)``) against gloo.

Why: on a CPU host gloo moves each activation and gradient through TCP loopback (two kernel copies,
I/O threads waking per segment, on the cores the stages compute on); ``hybridpar.comm.local_p2p``
lets the receiver copy the sender's tensor once. Measured exactly as ``bench_deferred`` measures
the B/W split: two engines (local p2p on, off) in the same 2 processes, stepped alternately, the
median of per-pair ratios off / on over fresh pairs of processes; then each variant's peak heap
per stage over one step, in fresh processes.

    .venv/bin/python perf/bench_local_p2p.py                       # M = 1, 2, 4, 8; 3 rounds
    .venv/bin/python perf/bench_local_p2p.py --size 12 --rounds 1 --pairs 4 --no-wait --out-dir /tmp
"""

from __future__ import annotations

import bench_deferred

if __name__ == "__main__":
    bench_deferred.main(option="local_p2p", out="local_p2p", what="Same-host transfers by cross-memory "
                        "attach (local p2p)", doc=__doc__)
