"""Stage-to-stage transfers by cross-memory attach (``parallelize(..., local_p2p=...)``) against gloo.

Why: on a CPU host gloo moves each activation and gradient through TCP loopback (two kernel copies,
I/O threads waking per segment, on the cores the stages compute on); ``hybridpar.comm.local_p2p``
lets the receiver copy the sender's tensor once. Measured exactly as ``bench_deferred`` measures
the B/W split: two engines (local p2p on, off) in the same 2 processes, stepped alternately, the
median of per-pair ratios off / on over fresh pairs of processes; then each variant's peak heap
per stage over one step, in fresh processes.

    python -m perf local_p2p                       # M = 1, 2, 4, 8; 3 rounds
    python -m perf local_p2p --size 12 --rounds 1 --pairs 4 --no-wait --out /tmp/local_p2p.json
"""

from __future__ import annotations

from perf import bench_deferred


def main(argv: list[str] | None = None) -> None:
    bench_deferred.main(argv, option="local_p2p", name="local_p2p", what="Same-host transfers by "
                        "cross-memory attach (local p2p)", doc=__doc__)


if __name__ == "__main__":
    main()
