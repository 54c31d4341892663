"""The claims of experiments/energy_minilm/README.md (the paper's Figure 1 on MiniLM): every count of directions
from ``energy.csv`` beside the page (scripts/energy.py)."""

from __future__ import annotations

import csv
import functools
import statistics

from result_pages.engine import ROOT, Value, cited, claim, cli, strict

CSV = "experiments/energy_minilm/energy.csv"
MIDDLE = (1, 2, 3)  # the middle layers the page rounds over


@functools.cache
def components() -> dict[tuple[int, str], dict[str, int]]:
    """(layer index, kind) -> {"dimension", "k@0.9", "k@0.95", "k@0.99"} of energy.csv."""
    file = ROOT / CSV
    if not file.is_file():
        raise cli.Missing(f"{CSV}: no such result file (a claim cites it)")
    out = {}
    for row in csv.DictReader(file.open()):
        layer = int(row["layer"].split(".")[2])
        out[(layer, row["kind"])] = {k: int(v) for k, v in row.items() if k not in ("layer", "kind")}
    return out


def k(layer: int, kind: str, energy: str = "k@0.9") -> int:
    return components()[(layer, kind)][energy]


def value(fn) -> Value:
    return Value(CSV.removeprefix("experiments/"), fn)


def claims_energy_minilm() -> None:
    """experiments/energy_minilm/README.md."""
    P = "experiments/energy_minilm/README.md"
    cited(P, "the components needed for 90, 95 and\n99% of the energy", "the energy levels scripts/energy.py "
          "reports (a setting)")

    def first_and_fifth():
        layers = sorted({layer for layer, _ in components()})
        fewer = [layer for layer in layers if k(layer, "products") < min(k(layer, "query"), k(layer, "key"))]
        if fewer != layers:
            raise ValueError(f"the products need fewer directions than the projections only in layers {fewer}")
        gap = {layer: k(layer, "query") - k(layer, "products") for layer in layers}
        if sorted(gap, key=gap.get, reverse=True)[:2] != [0, 4]:
            raise ValueError(f"the widest gaps are not in the first and fifth layers: {gap}")
        return [k(0, "products"), k(4, "products"), components()[(0, "products")]["dimension"],
                k(0, "query"), k(4, "query")]
    claim(P, "(90% of the energy in {:.0f} and {:.0f} of {:.0f} directions, against {:.0f} and {:.0f} for the\n"
             "stacked queries)", value(first_and_fifth))

    def nearest(x: float, step: float) -> float:
        return step * round(x / step)

    def middle():
        return [nearest(statistics.fmean(k(layer, "products") for layer in MIDDLE), 5),
                components()[(1, "products")]["dimension"],
                nearest(statistics.fmean(k(layer, "query") for layer in MIDDLE), 5)]
    claim(P, "(about {:.0f} of {:.0f} against\nabout {:.0f})", value(middle))

    def halving():
        layers = sorted({layer for layer, _ in components()})
        dimension = components()[(0, "products")]["dimension"]
        if any(k(layer, "products", "k@0.95") > dimension // 2 for layer in layers):
            raise ValueError("some layer needs more than half the directions for 95% of the products' energy")
        return [dimension // 2, 95]
    claim(P, "Halving the key/query size ({:.0f}) keeps {:.0f}% or more of the products' energy in every layer",
          value(halving))
    strict(P)
