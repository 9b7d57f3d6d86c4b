"""``python -m hybridpar.checkpoint``: look into a checkpoint root without training code.

Why: versions are kept for later study (fine-tuning, population-based search, watching weights evolve)
and for users leaving hybridpar, so they must be listable, checkable and exportable with nothing but
this package. Read-only: nothing here writes into ``ROOT``, and nothing read runs code.

    ls ROOT [--full]                     versions, metadata, levels, verified or not
    verify ROOT [STEP]                   read every byte against its checksum (exit 1 if unusable)
    export ROOT OUT [--step S]           the full model's state dict: OUT.pt (torch.load(weights_only=True)
           [--overwrite]                 reads it) or OUT.safetensors (--format safetensors)
    diff ROOT A B                        per-tensor change norms between two versions

ROOT is a checkpoint root or a run directory holding one as ``checkpoints/``. ``--local DIR`` (with
``{node}`` and ``--nodes N`` for several node directories) also looks at L1/L2. STEP, A and B are steps
(the newest version of that step) or version names. ``export`` without ``--step`` exports the newest
version, and refuses it if it is damaged rather than export an older one unasked; the file carries the
run's configuration too (:func:`hybridpar.checkpoint.export.read_config`), from which an application
rebuilds the model (``cosmoflow.model.build_model_from_export``). ``export`` never replaces OUT unless
``--overwrite`` is given, does not create OUT's folder, and writes through a temporary name beside OUT
(removed on failure) with the mode ``torch.save`` gives, 0666 less the umask. Every error is one line on
stderr: exit 2 for a wrong command line (an OUT that exists, or whose folder does not), 1 for anything
else.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.export import (
    SAFETENSORS,
    TORCH,
    config_text,
    output_problem,
    plain,
    save_safetensors,
    save_torch,
    tensors_only,
)
from hybridpar.checkpoint.format import CheckpointError
from hybridpar.checkpoint.levels import Found, Levels, available, complete_levels, scan
from hybridpar.checkpoint.restore import read_version, verify_version
from hybridpar.checkpoint.tree import key_filter, unflatten


class Usage(Exception):
    """A command line that cannot be carried out as written (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def root_of(arg: str) -> Path:
    """The checkpoint root: ``arg`` itself, or ``arg/checkpoints`` for a run directory with no versions of
    its own."""
    root = Path(arg)
    if not root.is_dir():
        raise Usage(f"{root}: no such directory")
    sub = root / "checkpoints"
    if sub.is_dir() and not any(mf.parse_name(p.name) for p in root.iterdir()):
        return sub
    return root


def _levels(args: argparse.Namespace) -> Levels:
    if args.nodes < 1:
        raise Usage(f"--nodes must be >= 1, got {args.nodes}")
    return Levels(root_of(args.root), args.local, 0, args.nodes)


def _found(levels: Levels) -> list[Found]:
    return sorted((f for f in scan(levels).values() if f.manifest is not None), key=lambda f: f.order)


def _steps(levels: Levels) -> str:
    return ", ".join(str(f.step) for f in _found(levels)) or "none"


def _pick(levels: Levels, spec: str | None, complete: bool = True) -> Found:
    found = [f for f in _found(levels) if not complete or available(levels, f)]
    if spec is not None:
        found = [f for f in found if f.name == spec or (spec.isdigit() and f.step == int(spec))]
    if not found:
        raise CheckpointError(f"no complete version {spec or ''} under {levels.root} "
                              f"(steps: {_steps(levels)})")
    return found[-1]


def _newest(levels: Levels) -> Found:
    """The newest version, whatever its state: what ``export`` without ``--step`` must export or refuse."""
    found = _found(levels)
    if not found:
        raise CheckpointError(f"no complete version under {levels.root}")
    newest = found[-1]
    for f in scan(levels).values():
        if f.manifest is None and f.problems and f.step >= newest.step:
            raise CheckpointError(f"the newest version {f.name} is damaged ({f.problems[0]}); pass --step to "
                                  f"export an older one (steps: {_steps(levels)})")
    return newest


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
            f"BAD: {problems[-1]}" + (f" ({problems[0]})" if len(problems) > 1 else "")
        if usable and not args.full:
            check += " (headers; --full reads all)"
        metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in meta.get("metrics", {}).items())
        rows.append((f.order, [f.name, str(body["step"]),
                               time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(body["time"])),
                               str(meta.get("epoch", "-")), metrics or "-", _size(body["bytes"]),
                               ",".join(complete_levels(levels, f)) or "-", check]))
    if not rows:
        print(f"no versions under {levels.root}")
        return 0
    rows.sort(key=lambda r: r[0])
    print(_table([r for _, r in rows], ["version", "step", "saved", "epoch", "metrics", "size", "levels",
                                        "verified"]))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    levels = _levels(args)
    targets = [_pick(levels, args.step, complete=False)] if args.step else _found(levels)
    worst = 0
    if not args.step:  # a damaged manifest makes a version unusable too
        for f in sorted(scan(levels).values(), key=lambda f: f.name):
            if f.manifest is None and f.problems:
                print(f"{f.name}: UNUSABLE")
                for p in f.problems:
                    print(f"  {p}")
                worst = 1
    for f in targets:
        assert f.manifest is not None
        usable, problems = verify_version(levels, f.manifest, full=True)
        print(f"{f.name}: {'ok' if usable else 'UNUSABLE'}")
        for p in problems:
            print(f"  {p}")
        worst = max(worst, 0 if usable else 1)
    if not targets:
        print(f"no versions under {levels.root}")
    return worst


def _load(levels: Levels, f: Found, entry: str | None) -> dict[str, Any]:
    assert f.manifest is not None
    flat, notes = read_version(levels, f.manifest, 0, key_filter(entry))
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    state = unflatten(flat)
    if entry is not None and entry not in state:
        have = sorted({e for rec in f.manifest["files"].values() for e in rec["entries"]})
        raise CheckpointError(f"{f.name} has no entry {entry!r} (entries: {', '.join(have)}); "
                              f"use --entry or --all")
    return state


def cmd_export(args: argparse.Namespace) -> int:
    fmt = args.format or (SAFETENSORS if args.out.endswith(".safetensors") else TORCH)
    if fmt == SAFETENSORS and args.all:
        raise Usage("--format safetensors writes one state dict of tensors (--entry); --all needs "
                    "--format torch")
    problem = output_problem(args.out, args.overwrite)  # before any work: the file is left as it was
    if problem:
        raise Usage(problem)
    levels = _levels(args)
    if args.step is not None:
        f = _pick(levels, args.step)
    else:
        f = _newest(levels)
    entry = None if args.all else args.entry
    try:
        state = _load(levels, f, entry)
    except CheckpointError as e:
        if args.step is not None:
            raise
        raise CheckpointError(f"the newest version {f.name} is damaged ({e}); pass --step to export an older "
                              f"one (steps: {_steps(levels)})") from None
    out = plain(state if entry is None else state[entry])
    config = f.manifest.get("config")  # the run's, so the model can be rebuilt from the file alone
    if fmt == SAFETENSORS:
        save_safetensors(out, args.out, {"hybridpar.version": f.name, "hybridpar.step": str(f.step),
                                         "hybridpar.entry": entry or "", **config_text(config)})
    else:
        if entry is not None:
            tensors_only(out, f"{f.name} entry {entry!r}")
        save_torch(out, args.out, config)
    print(f"exported {f.name} (step {f.step}, {'all entries' if entry is None else entry}) to {args.out} "
          f"({fmt}{', with its run configuration' if config is not None else ''})")
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
    ap = _Parser(prog="python -m hybridpar.checkpoint", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("root", help="the checkpoint root (L3), or a run directory holding it as checkpoints/")
        p.add_argument("--local", default=None, help="local_dir of the run, to look at L1/L2 too")
        p.add_argument("--nodes", type=int, default=1,
                       help="node directories to look at with {node} in --local (default: 1)")
        return p

    version = "a step (its newest version) or a version name"
    p = add("ls", "list versions")
    p.add_argument("--full", action="store_true", help="verify every byte, not just headers")
    p.set_defaults(fn=cmd_ls)
    p = add("verify", "verify every byte of one or all versions (exit 1 if one is unusable)")
    p.add_argument("step", nargs="?", default=None, help=f"the version to verify: {version} (default: all)")
    p.set_defaults(fn=cmd_verify)
    p = add("export", "write the model's state dict as a PyTorch (.pt) or safetensors file")
    p.add_argument("out", help="the file to write (a name ending .safetensors implies --format safetensors)")
    p.add_argument("--step", default=None, help=f"the version to export: {version} (default: the newest, "
                   f"refused if damaged)")
    p.add_argument("--entry", default="model", help="which entry of the state (default: model)")
    p.add_argument("--all", action="store_true", help="export every entry as one dict (--format torch only)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (default: refuse)")
    p.add_argument("--format", choices=(TORCH, SAFETENSORS), default=None,
                   help="torch: read with torch.load(path, weights_only=True); safetensors: read with "
                   "safetensors.torch.load_file (default: from OUT's suffix, else torch)")
    p.set_defaults(fn=cmd_export)
    p = add("diff", "per-tensor change norms between two versions")
    p.add_argument("a", help=f"the version compared from: {version}")
    p.add_argument("b", help=f"the version compared to: {version}")
    p.add_argument("--entry", default="model", help="which entry to compare (default: model)")
    p.set_defaults(fn=cmd_diff)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except Usage as e:
        print(f"{ap.prog} {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
