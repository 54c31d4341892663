"""The transfer matrix of a race folder: conversions fitted on one text (``Entry.fit_text``: a domain's fit split, a
mixture, or the original's own samples), measured on every domain's held-out windows.

``transfer_markdown`` prints, per budget and recipe (the run name without its fit text), one row per fitting text:
each domain's perplexity over the original's with the paired bootstrap over that domain's windows
(``collab_attn.stats.window_bootstrap`` of the run's per-window log-likelihoods against the original's on the same
windows), and the worst domain. Then, for every domain that has a fit on its own text, that in-domain fit against
each general one (fitted on no single domain: ``GENERAL``) on the same windows: how much the in-domain fit gains.
"""

from __future__ import annotations

import re
from collections import defaultdict

from collab_attn.pretrained.heldout import OWN_TEXTS
from collab_attn.pretrained.race import one_split
from collab_attn.stats import window_bootstrap

GENERAL = (*OWN_TEXTS, "every", "all", "mixed")  # fitting texts that are no single evaluation domain's


def _fit_text(run: dict) -> str:
    return run["entry"].get("fit_text", "mixed")


def _recipe(run: dict) -> str:
    return re.sub(r"-text[a-z]+$", "", run["name"])


def _original_windows(windows: list[dict]) -> list[dict]:
    return [{"tokens": w["tokens"], "nll": w["original_nll"], "fingerprint": w["fingerprint"]} for w in windows]


def _cell(comparison, digits: int = 3) -> str:
    estimate, (low, high) = (1 + comparison.mean_difference, tuple(1 + x for x in comparison.interval))
    return f"{estimate:.{digits}f}x [{low:.{digits}f}, {high:.{digits}f}]"


def against_original(run: dict, domain: str):
    """The run's perplexity over the original's on ``domain``, with the window bootstrap's interval."""
    windows = run["domains"][domain]["windows"]
    return window_bootstrap(windows, _original_windows(windows))


def transfer_markdown(runs: list[dict]) -> str:
    """The transfer tables of ``runs`` (one split's run files; the original's is skipped), as the module says."""
    split = one_split(runs)
    converted = [r for r in runs if r["name"] != "original"]
    if not converted:
        raise ValueError("no converted runs to tabulate: the folder holds the original's run only")
    groups: dict[tuple[float, str], dict[str, dict]] = defaultdict(dict)
    for run in converted:
        groups[run["entry"].get("budget", 1.0), _recipe(run)][_fit_text(run)] = run
    lines = [f"Perplexity over the original's ({split} split), each with the 95% paired bootstrap over the domain's "
             "windows; `worst`: the highest over the domains.", ""]
    for (budget, recipe), by_text in sorted(groups.items(), key=lambda item: (-item[0][0], item[0][1])):
        domains = [d for d in next(iter(by_text.values()))["domains"] if " " not in d]
        lines += [f"### budget {budget:g}: `{recipe}`", "",
                  "| fitted on | " + " | ".join(domains) + " | worst |", "|---|" + "---:|" * (len(domains) + 1)]
        order = {text: i for i, text in enumerate(GENERAL)}  # the general fits first, in GENERAL's order
        for text, run in sorted(by_text.items(), key=lambda item: (order.get(item[0], len(order)), item[0])):
            cells = {d: against_original(run, d) for d in domains if d in run["domains"]}
            worst = max(1 + c.mean_difference for c in cells.values())
            lines.append(f"| {text} | " + " | ".join(_cell(cells[d]) if d in cells else "" for d in domains)
                         + f" | {worst:.3f}x |")
        lines += ["", _gains(by_text, domains), ""]
    return "\n".join(lines).rstrip() + "\n"


def _gains(by_text: dict[str, dict], domains: list[str]) -> str:
    """Each in-domain fit against each general fit on that domain's windows."""
    rows = []
    for domain in domains:
        own = by_text.get(domain)
        if own is None or domain not in own["domains"]:
            continue
        for text in GENERAL:
            general = by_text.get(text)
            if general is None or domain not in general["domains"]:
                continue
            comparison = window_bootstrap(own["domains"][domain]["windows"], general["domains"][domain]["windows"])
            words = {"better": "ahead", "worse": "behind", "tie": "tie"}[comparison.verdict]
            gain = 1 - (1 + comparison.mean_difference)
            rows.append(f"| {domain} | {text} | {_cell(comparison)} | {words} | {gain:+.1%} |")
    if not rows:
        return "No domain has both an in-domain and a general fit here."
    head = ["In-domain fit against a general one, on the domain's windows (below 1: the in-domain fit is better; "
            "`gain`: how much lower its perplexity is):", "",
            "| domain | general fit | in-domain / general | verdict | gain |", "|---|---|---:|---|---:|"]
    return "\n".join(head + rows)

