"""The sweep's figures: achieved FLOP/s and efficiency per layout family, the step breakdown measured against
predicted, and the model against the measurement.

Why optional: matplotlib is an extra (``hybridpar[plots]``); without it the JSON and CSV still hold
every figure.
"""

from __future__ import annotations

from pathlib import Path

from perf.harness.configs import CATEGORIES, FAMILIES


def plots(rows: list[dict], out: Path, title: str) -> list[str]:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'hybridpar[plots]')", flush=True)
        return []
    written = []
    sweeps = [s for s in ("strong", "weak") if any(r["sweep"] == s for r in rows)]
    colors = {"data": "tab:blue", "spatial": "tab:orange", "pipe": "tab:green", "hybrid": "tab:red"}
    fig, axes = plt.subplots(2, len(sweeps), figsize=(5.5 * len(sweeps), 7.5), squeeze=False)
    for j, sweep in enumerate(sweeps):
        rs = [r for r in rows if r["sweep"] == sweep]
        single = [r for r in rs if r["family"] == "single"]
        for fam in FAMILIES:
            fr = sorted([r for r in rs if r["family"] == fam] + single, key=lambda r: r["ranks"])
            if len(fr) <= len(single):
                continue
            best: dict[int, dict] = {}
            for r in fr:  # one point per world size: the best layout of the family
                if r["ranks"] not in best or r["step_s"] < best[r["ranks"]]["step_s"]:
                    best[r["ranks"]] = r
            xs = sorted(best)
            axes[0][j].plot(xs, [best[x]["flops_per_s"] / 1e9 for x in xs], "o-", color=colors[fam],
                            label=fam)
            axes[0][j].plot(xs, [best[x]["model_flops"] / best[x]["predicted"]["step_s"] / 1e9 for x in xs],
                            "x--", color=colors[fam], alpha=0.5)
            axes[1][j].plot(xs, [best[x]["efficiency"] for x in xs], "o-", color=colors[fam], label=fam)
        cores = max((r["ranks"] for r in rs if not r["oversubscribed"]), default=1)
        if single:
            xs = sorted({r["ranks"] for r in rs})
            f0 = single[0]["flops_per_s"] / 1e9
            axes[0][j].plot(xs, [f0 * x for x in xs], ":", color="grey", label="ideal (N x 1 rank)")
            axes[0][j].plot(xs, [f0 * min(x, cores) for x in xs], "-.", color="grey", lw=0.8,
                            label=f"{cores} cores' worth")
            axes[1][j].axhline(1.0, ls=":", color="grey")
        for ax in axes[:, j]:
            ax.axvspan(cores + 0.5, max(r["ranks"] for r in rs) + 0.5, color="grey", alpha=0.08)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"ranks (shaded: > {cores} cores, oversubscribed)")
            ax.grid(alpha=0.3)
        axes[0][j].set_title(f"{sweep} scaling: achieved GFLOP/s, best layout per family (x--: model)",
                             fontsize=9)
        axes[0][j].set_ylabel("GFLOP/s (matmul FLOPs, all ranks)")
        axes[1][j].set_title(f"{sweep} efficiency ({'T1/(N TN)' if sweep == 'strong' else 'T1/TN'})")
        axes[1][j].set_ylabel("efficiency")
        axes[0][j].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=90)
    plt.close(fig)
    written.append("scaling.png")

    fig, axes = plt.subplots(len(sweeps), 1, figsize=(max(8, 0.55 * len(rows)), 4.2 * len(sweeps)),
                             squeeze=False)
    palette = {"compute": "tab:green", "halo": "tab:orange", "pipeline": "tab:blue", "grad_reduce": "tab:red",
               "data_wait": "gold", "other": "lightgrey"}
    for j, sweep in enumerate(sweeps):
        rs = [r for r in rows if r["sweep"] == sweep]
        ax = axes[j][0]
        labels = []
        for i, r in enumerate(rs):
            for k, (src, dx) in enumerate(((r["breakdown_s"], -0.2), (r["predicted"]["breakdown_s"], 0.2))):
                bottom = 0.0
                for c in CATEGORIES:
                    v = 1e3 * src[c]
                    ax.bar(i + dx, v, 0.38, bottom=bottom, color=palette[c], alpha=1.0 if k == 0 else 0.55,
                           label=c if (i == 0 and k == 0) else None)
                    bottom += v
            labels.append(f"{r['ranks']}: {r['layout']}")
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{sweep}: breakdown per config (left: measured, mean over ranks; right, faded: model)")
        ax.legend(fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=80)
    plt.close(fig)
    written.append("breakdown.png")

    fig, ax = plt.subplots(figsize=(5, 5))
    for r in rows:
        ax.scatter(1e3 * r["step_s"], 1e3 * r["predicted"]["step_s"], color=colors.get(r["family"], "black"),
                   marker="o" if r["sweep"] == "strong" else "s", s=18)
    lim = [0, 1.1e3 * max(max(r["step_s"], r["predicted"]["step_s"]) for r in rows)]
    ax.plot(lim, lim, color="grey")
    ax.fill_between(lim, [0.85 * v for v in lim], [1.15 * v for v in lim], color="grey", alpha=0.15)
    ax.set_xlabel("measured ms/step")
    ax.set_ylabel("predicted ms/step")
    ax.set_title("model vs measurement (band: +-15 %; o strong, s weak)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "validation.png", dpi=80)
    plt.close(fig)
    written.append("validation.png")
    return written
