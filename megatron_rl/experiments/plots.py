"""Training curves as PNG from metrics.jsonl rows (matplotlib, headless)."""

from __future__ import annotations

import json
import os

PANELS = [
    ("reward/mean", "train reward"),
    ("eval/mean_at_k", "held-out mean@k"),
    ("kl_k1", "KL to reference (k1, token mean)"),
    ("kl_forward", "forward KL to reference"),
    ("entropy", "entropy (token mean)"),
    ("grad_norm", "grad norm"),
    ("mismatch/abs_delta_mean", "|rollout - trainer| log-prob"),
    ("response/length_mean", "response length"),
    ("rollout/agent/called_tools", "episodes that call a tool"),
    ("agent/calls_parsed", "tool calls that parse"),
    ("rollout/agent/turns", "policy turns per episode"),
]


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(rows: list[dict] | dict[str, list[dict]], out_png: str, baseline: float | None = None,
             title: str = "", panels: tuple[str, ...] | None = None) -> str:
    """One panel per metric present: PANELS' keys, or the keys `panels` names in its order (titled
    as in PANELS, else by the key); `rows` may map run names to their rows to overlay runs. `baseline` (e.g. the base model's held-out
    accuracy) is drawn on the eval panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = rows if isinstance(rows, dict) else {"run": rows}
    titles = dict(PANELS)
    shown = [(k, titles.get(k, k)) for k in (titles if panels is None else panels)]
    panels_present = [(k, t) for k, t in shown if any(k in r for rs in runs.values() for r in rs)]
    cols = min(4, max(1, len(panels_present)))
    nrows = -(-len(panels_present) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels_present):
        for name, rs in runs.items():
            pts = [(r["step"], r[key]) for r in rs if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("eval") else None, ms=3,
                        label=name if len(runs) > 1 else None)
        if key == "eval/mean_at_k" and baseline is not None:
            ax.axhline(baseline, color="gray", ls="--", label="base model")
            ax.legend(fontsize=7)
        elif len(runs) > 1:
            ax.legend(fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    for ax in list(axes.flat)[len(panels_present):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
