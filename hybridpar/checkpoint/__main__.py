"""``python -m hybridpar.checkpoint``: look into a checkpoint root without training code.

Why: versions are kept for later study (fine-tuning, population-based search, watching weights evolve)
and for users leaving hybridpar, so they must be listable, checkable and exportable with nothing but
this package. Read-only: nothing here writes into ``ROOT``.

    ls ROOT [--full]                     versions, metadata, levels, verified or not
    verify ROOT [STEP]                   read every byte against its checksum (exit 1 if unusable)
    export ROOT OUT.pt [--step S]        plain PyTorch state dict of the full model
    diff ROOT A B                        per-tensor change norms between two versions

``--local DIR`` (with ``{node}`` and ``--nodes N`` for several node directories) also looks at L1/L2.
STEP, A and B are steps (the newest version of that step) or version names.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridpar.checkpoint.format import CheckpointError
from hybridpar.checkpoint.levels import Found, Levels, available, complete_levels, scan
from hybridpar.checkpoint.restore import read_version, verify_version
from hybridpar.checkpoint.tree import key_filter, unflatten


def _levels(args: argparse.Namespace) -> Levels:
    return Levels(Path(args.root), args.local, 0, args.nodes)


def _found(levels: Levels) -> list[Found]:
    return sorted((f for f in scan(levels).values() if f.manifest is not None), key=lambda f: f.order)


def _pick(levels: Levels, spec: str | None) -> Found:
    found = [f for f in _found(levels) if available(levels, f)]
    if spec is not None:
        found = [f for f in found if f.name == spec or (spec.isdigit() and f.step == int(spec))]
    if not found:
        have = ", ".join(str(f.step) for f in _found(levels)) or "none"
        raise SystemExit(f"no complete version {spec or ''} under {levels.root} (steps: {have})")
    return found[-1]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def cmd_ls(args: argparse.Namespace) -> int:
    levels = _levels(args)
    rows = []
    for f in scan(levels).values():
        body = f.manifest
        if body is None:
            why = "; ".join(f.problems) or "no manifest (incomplete)"
            rows.append(((0.0, f.name), [f.name, str(f.step), "-", "-", "-", "-", "-", f"INCOMPLETE: {why}"]))
            continue
        meta = body["metadata"]
        usable, problems = verify_version(levels, body, full=args.full)
        check = ("ok" if not problems else f"ok, {len(problems)} damaged cop(ies)") if usable else \
            f"BAD: {problems[-1]}"
        if usable and not args.full:
            check += " (headers; --full reads all)"
        metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in meta.get("metrics", {}).items())
        rows.append((f.order, [f.name, str(body["step"]),
                               time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(body["time"])),
                               str(meta.get("epoch", "-")), metrics or "-", _size(body["bytes"]),
                               ",".join(complete_levels(levels, f)) or "-", check]))
    if not rows:
        print(f"no versions under {args.root}")
        return 0
    rows.sort(key=lambda r: r[0])
    print(_table([r for _, r in rows], ["version", "step", "saved", "epoch", "metrics", "size", "levels",
                                        "verified"]))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    levels = _levels(args)
    targets = [_pick(levels, args.step)] if args.step else _found(levels)
    worst = 0
    for f in targets:
        assert f.manifest is not None
        usable, problems = verify_version(levels, f.manifest, full=True)
        print(f"{f.name}: {'ok' if usable else 'UNUSABLE'}")
        for p in problems:
            print(f"  {p}")
        worst = max(worst, 0 if usable else 1)
    if not targets:
        print(f"no versions under {args.root}")
    return worst


def _load(levels: Levels, f: Found, entry: str | None) -> dict[str, Any]:
    assert f.manifest is not None
    flat, notes = read_version(levels, f.manifest, 0, key_filter(entry))
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    state = unflatten(flat)
    if entry is not None and entry not in state:
        have = sorted({e for rec in f.manifest["files"].values() for e in rec["entries"]})
        raise SystemExit(f"{f.name} has no entry {entry!r} (entries: {', '.join(have)}); "
                         f"use --entry or --all")
    return state


def cmd_export(args: argparse.Namespace) -> int:
    levels = _levels(args)
    f = _pick(levels, args.step)
    entry = None if args.all else args.entry
    state = _load(levels, f, entry)
    torch.save(state if entry is None else state[entry], args.out)
    print(f"wrote {args.out} from {f.name} ({'all entries' if entry is None else entry})")
    return 0


def _leaves(x: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return {prefix: x}
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list | tuple) else []
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_leaves(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def cmd_diff(args: argparse.Namespace) -> int:
    levels = _levels(args)
    fa, fb = _pick(levels, args.a), _pick(levels, args.b)
    a = _leaves(_load(levels, fa, args.entry)[args.entry])
    b = _leaves(_load(levels, fb, args.entry)[args.entry])
    rows = []
    total_d = total_a = 0.0
    for k in sorted(set(a) & set(b)):
        ta, tb = a[k], b[k]
        if ta.shape != tb.shape:
            rows.append([k, "-", "-", "-", f"shape {tuple(ta.shape)} -> {tuple(tb.shape)}"])
            continue
        if ta.is_floating_point() or ta.is_complex():
            d = float(torch.linalg.vector_norm((tb - ta).double()))
            n = float(torch.linalg.vector_norm(ta.double()))
            total_d += d * d
            total_a += n * n
            rel = d / n if n else math.inf if d else 0.0
            rows.append([k, f"{n:.4g}", f"{d:.4g}", f"{rel:.3g}", ""])
        else:
            changed = int((ta != tb).sum())
            rows.append([k, "-", "-", "-", f"{changed} of {ta.numel()} elements changed"])
    print(f"{fa.name} -> {fb.name}")
    print(_table(rows, ["tensor", "|A|", "|B-A|", "|B-A|/|A|", "note"]))
    for k in sorted(set(a) - set(b)):
        print(f"only in A: {k}")
    for k in sorted(set(b) - set(a)):
        print(f"only in B: {k}")
    if total_a:
        print(f"all tensors: |B-A|/|A| = {math.sqrt(total_d) / math.sqrt(total_a):.4g}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridpar.checkpoint", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("root", help="the checkpoint root (L3)")
        p.add_argument("--local", default=None, help="local_dir of the run, to look at L1/L2 too")
        p.add_argument("--nodes", type=int, default=1, help="node directories to look at with {node}")
        return p

    p = add("ls", "list versions")
    p.add_argument("--full", action="store_true", help="verify every byte, not just headers")
    p.set_defaults(fn=cmd_ls)
    p = add("verify", "verify every byte of one or all versions")
    p.add_argument("step", nargs="?", default=None)
    p.set_defaults(fn=cmd_verify)
    p = add("export", "write a plain PyTorch state dict")
    p.add_argument("out")
    p.add_argument("--step", default=None)
    p.add_argument("--entry", default="model", help="which entry of the state (default: model)")
    p.add_argument("--all", action="store_true", help="export every entry, as one dict")
    p.set_defaults(fn=cmd_export)
    p = add("diff", "per-tensor change norms between two versions")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--entry", default="model", help="which entry to compare (default: model)")
    p.set_defaults(fn=cmd_diff)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
