"""The claims of experiments/accounting/README.md: every count from the tables scripts/accounting.py wrote
(``minilm.md``, ``bert-base.md``, ``gpt2.md`` beside the page)."""

from __future__ import annotations

import functools

from result_pages.engine import ROOT, Value, claim, cli, strict


@functools.cache
def tables(path: str) -> tuple[tuple[list[str], list[list[str]]], ...]:
    """The Markdown tables of a file written by a script: (header cells, rows of cells) each."""
    file = ROOT / path
    if not file.is_file():
        raise cli.Missing(f"{path}: no such file (a claim cites it)")
    out, block = [], []
    for line in [*file.read_text().splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            out.append((block[0], block[2:]))
            block = []
    return tuple(out)


def cell(path: str, column: str, row: str) -> float:
    """The number in ``column`` of the row whose first cell is ``row``, in the first table of ``path`` with that
    column."""
    for head, rows in tables(path):
        if column in head:
            found = [r for r in rows if r[0] == row]
            if found:
                return float(found[0][head.index(column)].replace(",", "").rstrip("%"))
    raise KeyError(f"{path}: no row {row!r} with a column {column!r}")


def claims_accounting() -> None:
    """experiments/accounting/README.md."""
    P = "experiments/accounting/README.md"
    A = "experiments/accounting/"
    bert, minilm, gpt2 = A + "bert-base.md", A + "minilm.md", A + "gpt2.md"

    def value(fn, *paths) -> Value:
        return Value(", ".join(p.removeprefix("experiments/") for p in paths), lambda: fn())

    per_layer = "total / layer"
    claim(P, "({:,.0f} for BERT-base, {:,.0f} for MiniLM)",
          value(lambda: [cell(bert, per_layer, "concatenated"), cell(minilm, per_layer, "concatenated")], bert, minilm))

    def ratio(path, column, row, base="concatenated", percent=True, less=0.0):
        return (100 if percent else 1) * cell(path, column, row) / cell(path, column, base) - less
    claim(P, "*larger* ({:+.1f}% for BERT-base: the mixing and content biases); at D~ = d/4 the layer keeps {:.0f}% "
             "(BERT-base)\n  of its parameters, and the floor, with query and key gone entirely, is about {:.0f}%",
          value(lambda: [ratio(bert, per_layer, "cp, D~=768", less=100), ratio(bert, per_layer, "cp, D~=192"),
                         100 * (cell(bert, "value", "concatenated") + cell(bert, "output", "concatenated"))
                         / cell(bert, per_layer, "concatenated")], bert))

    def break_even():
        flops = {p: {d: ratio(p, "total", f"cp, D~={d}") for d in ds} for p, ds in
                 ((bert, (384, 576)), (minilm, (128, 192)))}
        if not (flops[bert][384] < 100 < flops[bert][576] and flops[minilm][128] < 100 < flops[minilm][192]):
            raise ValueError(f"the totals do not break even where the page says: {flops}")
        for p, head_dim in ((bert, 64), (minilm, 32)):
            if cell(p, "scores", f"cp, D~={head_dim}") != cell(p, "scores", "concatenated"):
                raise ValueError(f"{p}: the score cost does not match at D~ = head_dim")
        return [ratio(bert, "total", "cp, D~=768", percent=False), ratio(minilm, "total", "cp, D~=384", percent=False)]
    claim(P, "At D~ = d the layer costs {:.1f}x\n  (BERT-base, {:.1f}x MiniLM) the FLOPs of concatenated heads; the "
             "totals break even just above D~ = d/2\n  (BERT-base) or between d/2 and d/3 (MiniLM) at this length, and "
             "the score cost alone only matches at D~ = head_dim.", value(break_even, bert, minilm))
    cache = "bytes / token / layer"
    claim(P, "GPT-2 small at D~ = d/2, d/4, d/8 keeps {:.1f}%, {:.1f}% and {:.1f}% of its cache\n  (at D~ = d it is "
          "{:.1f}% larger: the content logits)",
          value(lambda: [*(ratio(gpt2, cache, f"cp, D~={d}") for d in (384, 192, 96)),
                         ratio(gpt2, cache, "cp, D~=768", less=100)], gpt2))
    strict(P)
