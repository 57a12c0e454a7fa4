"""`kvlab estimate --plot FILE.png`: decode tokens/s against batch size and against context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvlab.errors import KvlabError
from kvlab.estimate.roofline import Estimate


def plot_estimate(e: Estimate, path: str | Path) -> Path:
    """Two panels: aggregate tok/s by batch size, per-stream tok/s by context."""
    try:
        import matplotlib
    except ImportError:
        raise KvlabError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise KvlabError(f"--plot writes a PNG; give a file name ending in .png, got {path}")
    fig, (by_batch, by_context) = plt.subplots(1, 2, figsize=(12, 4.5))
    _batch_panel(by_batch, e)
    _context_panel(by_context, e)
    fig.suptitle(f"{e.model.name} on {e.hardware.name}", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise KvlabError(f"cannot write plot {path}: {err.strerror}") from None
    finally:
        plt.close(fig)
    return path


def _batch_panel(ax: Any, e: Estimate) -> None:
    low, high = e.workload.efficiency
    batches = [p.batch for p in e.batch_sweep]
    ceiling = [p.aggregate_tok_s for p in e.batch_sweep]
    ax.plot(batches, ceiling, "o-", label="ceiling")
    ax.fill_between(batches, [c * low for c in ceiling], [c * high for c in ceiling],
                    alpha=0.25, label=f"realistic ({low:.0%}-{high:.0%})")
    if e.compute_bound_batch is not None and e.compute_bound_batch <= batches[-1]:
        ax.axvline(e.compute_bound_batch, color="tab:red", ls="--",
                   label=f"compute-bound from {e.compute_bound_batch}")
    if e.max_concurrency is not None and e.max_concurrency < batches[-1]:
        ax.axvline(max(e.max_concurrency, 1), color="tab:gray", ls=":",
                   label=f"KV memory full at {e.max_concurrency}")
    ax.set(xscale="log", yscale="log", xlabel="batch size (concurrent sequences)",
           ylabel="decode tokens/s, all sequences",
           title=f"by batch, context {e.workload.context_tokens:,}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _context_panel(ax: Any, e: Estimate) -> None:
    low, high = e.workload.efficiency
    contexts = [p.context for p in e.context_sweep]
    tok_s = [p.tok_s for p in e.context_sweep]
    ax.plot(contexts, tok_s, "o-", label="ceiling")
    ax.fill_between(contexts, [t * low for t in tok_s], [t * high for t in tok_s], alpha=0.25,
                    label=f"realistic ({low:.0%}-{high:.0%})")
    if e.max_context is not None and e.max_context < contexts[-1]:
        ax.axvline(max(e.max_context, 1), color="tab:gray", ls=":",
                   label=f"KV memory full at {e.max_context:,}")
    ax.set(xscale="log", xlabel="context (tokens in the KV cache)",
           ylabel="decode tokens/s per sequence",
           title=f"by context, concurrency {e.workload.concurrency}")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
