"""What `tiletune verify` shows: a worst-first table and a heat map of layers x tensors."""

from __future__ import annotations

import math
import re
from pathlib import Path

from tiletune.numerics import Verdict

LAYER = re.compile(r"layers\.(\d+)\.(.+)$")


def verdict_table(tensors: list[dict], limit: int = 25) -> str:
    """The `limit` worst tensors (failures first, then highest error ratio) and a pass count."""
    lines = [f"{'tensor':58s} {'stock err':>10s} {'kernel err':>10s} {'ratio':>7s} {'max ulps':>8s} {'cosine':>9s}  verdict"]
    for row in tensors[:limit]:
        stock, patched = row["stock"], row["patched"]
        lines.append(
            f"{row['name'][-58:]:58s} {stock['rel_l2']:10.2e} {patched['rel_l2']:10.2e} {row['ratio']:7.2f} "
            f"{patched['max_ulps']:8.3g} {patched['cosine']:9.6f}  {'pass' if row['passed'] else 'FAIL'}"
            + (f" ({patched['nonfinite']} NaN/Inf)" if patched["nonfinite"] else "")
        )
    failed = sum(not row["passed"] for row in tensors)
    lines.append(f"{len(tensors) - failed}/{len(tensors)} tensors pass" + (f"; {failed} FAIL" if failed else ""))
    return "\n".join(lines)


def golden_table(rows: list[dict], limit: int = 25) -> str:
    """The `limit` worst tensors against a golden file."""
    lines = [f"{'tensor':58s} {'rel err':>10s} {'allowed':>10s} {'max abs':>10s} {'cosine':>9s}  verdict"]
    for row in rows[:limit]:
        if row.get("missing"):
            lines.append(f"{row['name'][-58:]:58s} {'missing in this run':>42s}  FAIL")
            continue
        lines.append(f"{row['name'][-58:]:58s} {row['rel_l2']:10.2e} {row['tolerance']:10.2e} {row['max_abs']:10.2e} "
                     f"{row['cosine']:9.6f}  {'pass' if row['passed'] else 'FAIL'}")  # fmt: skip
    failed = sum(not row["passed"] for row in rows)
    lines.append(f"{len(rows) - failed}/{len(rows)} tensors match the golden file" + (f"; {failed} FAIL" if failed else ""))
    return "\n".join(lines)


def layer_grid(verdicts: list[Verdict]) -> tuple[list[int], list[str], dict[tuple[int, str], float]]:
    """(layers, tensor kinds, worst ratio per (layer, kind)) over batches, from captured names."""
    cells: dict[tuple[int, str], float] = {}
    for v in verdicts:
        match = LAYER.search(v.name.replace(".default", ""))
        if not match:
            continue
        key = (int(match.group(1)), match.group(2).removesuffix(".weight.grad").replace("base_layer.", ""))
        ratio = v.ratio if math.isfinite(v.ratio) else 1e3
        cells[key] = max(cells.get(key, 0.0), ratio)
    layers = sorted({layer for layer, _ in cells})
    kinds = sorted({kind for _, kind in cells})
    return layers, kinds, cells


def heatmap(verdicts: list[Verdict], path: Path) -> None:
    """verify.png: tensors x layers coloured by error ratio (kernel error / stock error), red above 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    layers, kinds, cells = layer_grid(verdicts)
    if not cells:
        return
    grid = [[cells.get((layer, kind), float("nan")) for layer in layers] for kind in kinds]
    fig, ax = plt.subplots(figsize=(min(5 + 0.3 * len(layers), 18), 1.5 + 0.2 * len(kinds)), dpi=110)
    image = ax.imshow(grid, cmap="RdYlGn_r", norm=LogNorm(vmin=0.25, vmax=8), aspect="auto")
    ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
    ax.set_xticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
    ax.set_xlabel("decoder layer")
    colorbar = fig.colorbar(image, ax=ax, ticks=[0.25, 0.5, 1, 2, 4, 8])
    colorbar.ax.set_yticklabels(["0.25", "0.5", "1", "2 (gate)", "4", "8"])
    colorbar.ax.minorticks_off()
    colorbar.set_label("kernel error / stock error")
    ax.set_title("tiletune verify: error ratio per layer and tensor")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
