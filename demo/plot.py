"""The loss curve (.demo/loss.png) from the series Prometheus scraped: loss against the
optimizer step, one line per gang attempt (each attempt's rank-0 pod is its own series)."""
from __future__ import annotations

from pathlib import Path

from demo import prom as promlib

StepAt = dict[tuple[str | None, float], float]


def plot_loss(png: Path, loss: list[dict], steps: StepAt, val: list[dict], pre: dict | None, job: str) -> None:
    """``steps`` maps (attempt, timestamp) to the step scraped with the loss at that time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for series in sorted(loss, key=lambda s: s["metric"].get("attempt", "")):
        att = series["metric"].get("attempt")
        pts = [(steps.get((att, float(t)), 0), float(v)) for t, v in series["values"]]
        pts = sorted({s: v for s, v in pts if s > 0 and v > 0}.items())
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-",
                    label=f"train loss, attempt {series['metric'].get('attempt', '?')}")
    vpts = sorted({steps.get((s["metric"].get("attempt"), float(t)), 0): float(v)
                   for s in val for t, v in s["values"] if float(v) > 0}.items())
    if vpts:
        ax.plot([p[0] for p in vpts], [p[1] for p in vpts], "s", label="validation loss")
    if pre:
        at = pre.get("resume_step") or pre.get("checkpoint_step")
        if at is not None:
            ax.axvline(at, color="red", ls="--", label=f"evicted; resumed from step {at}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"SFTJob {job}: loss scraped by Prometheus every {promlib.SCRAPE_INTERVAL}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
