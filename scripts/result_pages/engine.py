"""The checker of scripts/check_results.py: values computed from run files, claims, strict pages, and the check of
pages against them (its docstring says how a claim reads)."""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from collab_attn import cli  # noqa: E402

NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 1,234.5 or 0.920 or -9.0
MEASURED = re.compile(r"(?<![\w.\-/])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:(?:\.\d+)(?:x|%| s\b|M\b)?|x|%| s\b)"
                      r"(?![\w/])")


# ---------------------------------------------------------------------------------------------------
# Values: each computes one or more numbers from run files, lazily, and names the files it read


@dataclass(frozen=True)
class Value:
    source: str  # the run files, for the error line
    compute: Callable[[], Sequence[float]]

    def numbers(self) -> list[float]:
        out = self.compute()
        return [float(x) for x in (out if isinstance(out, (list, tuple)) else [out])]


@functools.cache
def run(path: str) -> dict:
    """A JSON run file, by its path from the repository root."""
    file = ROOT / path
    if not file.is_file():
        raise cli.Missing(f"{path}: no such run file (a claim cites it)")
    return json.loads(file.read_text())


def short(path: str) -> str:
    return path.removeprefix("experiments/")


def field(path: str, *dotted: str, scale: float = 1.0) -> Value:
    """JSON fields of a run file (``"fit.cpu_seconds"``; list items by index: ``"answers.0"``), times ``scale``."""
    def compute():
        values = []
        for name in dotted:
            node = run(path)
            for part in name.split("."):
                node = node[int(part)] if isinstance(node, list) else node[part]
            values.append(float(node) * scale)
        return values
    return Value(short(path), compute)


def formula(fn: Callable[..., Sequence[float] | float], *paths: str) -> Value:
    """``fn(run_1, run_2, ...)`` over the run files ``paths``: anything the other helpers do not compute."""
    return Value(", ".join(short(p) for p in paths), lambda: fn(*(run(p) for p in paths)))


def stage(path: str, name: str, *keys: str, scale: float = 1.0) -> Value:
    """``keys`` of the one line of a GLUE job's ``results.jsonl`` (scripts/train_glue.py) whose stage is ``name``
    (``finetuned``, ``reparam`` or ``refit``), times ``scale``."""
    def compute():
        file = ROOT / path
        if not file.is_file():
            raise cli.Missing(f"{path}: no such result file (a claim cites it)")
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        mine = [r for r in rows if r["stage"] == name]
        if len(mine) != 1:
            raise ValueError(f"{path}: {len(mine)} '{name}' results, the page cites one")
        return [float(mine[0][k]) * scale for k in keys]
    return Value(short(path), compute)


DOMAINS = ("wikipedia", "shakespeare")


def _domains(domains: Sequence[str], length: int | None) -> list[str]:
    return [f"{d} {length}" if length else d for d in (domains or DOMAINS)]


def ppl(path: str, *domains: str, length: int | None = None) -> Value:
    """The SmolLM2 race's perplexity over the original's (``runs/<name>.json`` of scripts/race_smollm2.py), per
    domain (wikipedia, then shakespeare, unless named); ``length=2048``: on the 2,048-token windows."""
    names = _domains(domains, length)
    return Value(short(path), lambda: [run(path)["domains"][d]["perplexity"] / run(path)["domains"][d][
        "original_perplexity"] for d in names])


def kl(path: str, *domains: str, length: int | None = None) -> Value:
    """KL of the converted model's next-token distribution from the original's, nats per token, per domain."""
    names = _domains(domains, length)
    return Value(short(path), lambda: [run(path)["domains"][d]["kl"] for d in names])


def top1(path: str, *domains: str, length: int | None = None) -> Value:
    """Top-1 agreement with the original, per domain."""
    names = _domains(domains, length)
    return Value(short(path), lambda: [run(path)["domains"][d]["top1"] for d in names])


RESAMPLES = 10_000  # the window bootstrap's draws, as collab_attn.pretrained.race.RESAMPLES (scripts/compare_runs.py)


@functools.cache
def bootstrap(a: str, b: str, domain: str):
    from collab_attn.stats import window_bootstrap

    return window_bootstrap(run(a)["domains"][domain]["windows"], run(b)["domains"][domain]["windows"],
                            resamples=RESAMPLES, seed=0)


def boot(a: str, b: str, domain: str = "wikipedia", percent: bool = False) -> Value:
    """Run ``a`` against run ``b`` on one domain's held-out windows, as scripts/compare_runs.py judges them
    (``collab_attn.stats.window_bootstrap``, 10,000 resamples, seed 0): the perplexity ratio a / b and its 95%
    interval, three numbers (``percent``: as relative differences in percent, ``-9.0% [-10.3%, -7.8%]``)."""
    def compute():
        c = bootstrap(a, b, domain)
        values = (c.mean_difference, *c.interval)
        return [100 * x for x in values] if percent else [1 + x for x in values]
    return Value(f"{short(a)} against {short(b)}, {domain}", compute)


def against_original(path: str, domain: str) -> Value:
    """A run's perplexity over the original's on one domain with the window bootstrap of its per-window
    log-likelihoods against the original's (``collab_attn.pretrained.transfer.against_original``): three numbers."""
    def compute():
        from collab_attn.pretrained.transfer import against_original as measured

        c = measured(run(path), domain)
        return [1 + c.mean_difference, *(1 + x for x in c.interval)]
    return Value(f"{short(path)}, {domain}, against the original", compute)


def verdict(a: str, b: str, domain: str = "wikipedia") -> str:
    """The window bootstrap's verdict in the words the pages use: ahead, behind or a tie."""
    return {"better": "ahead", "worse": "behind", "tie": "tie"}[bootstrap(a, b, domain).verdict]


def verdict_is(a: str, b: str, domain: str, word: str) -> Value:
    """No number: the window bootstrap's verdict on run ``a`` against run ``b`` on ``domain`` must be ``word``
    (ahead, behind or tie) where a sentence says so, else the claim cannot be computed."""
    def compute():
        found = verdict(a, b, domain)
        if found != word:
            raise ValueError(f"{short(a)} against {short(b)} on {domain}: {found}, where the page says {word}")
        return []
    return Value(f"{short(a)} against {short(b)}, {domain}: {word}", compute)


def over_samples(a: Sequence[str], b: Sequence[str], domain: str = "wikipedia") -> Value:
    """Two conversions over calibration samples (``a[i]`` and ``b[i]`` calibrated on sample i): the geometric mean
    of their perplexity ratios and the 95% t-interval over the samples (``compare_on_shared_seeds`` of the log
    perplexities, as scripts/compare_runs.py), three numbers, as ratios."""
    def compute():
        from collab_attn.stats import paired_comparison

        logs = [[math.log(run(p)["domains"][domain]["perplexity"]) for p in side] for side in (a, b)]
        c = paired_comparison(*logs)
        return [math.exp(c.mean_difference), *(math.exp(x) for x in c.interval)]
    return Value(f"{', '.join(map(short, a))} against {', '.join(map(short, b))}, {domain}, over samples",
                 compute)


def seed_runs(pattern: str) -> dict[int, dict]:
    files = sorted(ROOT.glob(pattern))
    if not files:
        raise cli.Missing(f"{pattern}: no run files match (a claim cites them)")
    return {json.loads(f.read_text())["seed"]: json.loads(f.read_text()) for f in files}


def seeds(pattern: str, key: str = "final_val_loss") -> Value:
    """The mean of ``key`` over the seeds' run files matching the glob ``pattern`` (Tiny Shakespeare races)."""
    return Value(short(pattern), lambda: [statistics.fmean(r[key] for r in seed_runs(pattern).values())])


def seed_pairs(a: str, b: str, key: str = "final_val_loss") -> Value:
    """``a`` minus ``b`` paired by seed (run files matching two globs): the mean difference and its 95% t-interval
    (``collab_attn.stats.compare_on_shared_seeds``), three numbers."""
    def compute():
        from collab_attn.stats import compare_on_shared_seeds

        c = compare_on_shared_seeds(*({s: r[key] for s, r in seed_runs(p).items()} for p in (a, b)))
        return [c.mean_difference, *c.interval]
    return Value(f"{short(a)} against {short(b)}", compute)


def seeds_word(low: float, high: float) -> str:
    """The verdict of a paired interval over seeds for the first run: ahead below zero, behind above, tie across."""
    return "ahead" if high < 0 else "behind" if low > 0 else "tie"


def seeds_verdict_is(a: str, b: str, word: str, key: str = "best_val_loss") -> Value:
    """No number: ``seed_pairs(a, b, key)``'s verdict for ``a`` must be ``word`` where a sentence says so (ahead:
    the interval below zero, behind: above it, tie: across it), else the claim cannot be computed."""
    pairs = seed_pairs(a, b, key)

    def compute():
        found = seeds_word(*pairs.numbers()[1:])
        if found != word:
            raise ValueError(f"{pairs.source}: {found} over the seeds, where the page says {word}")
        return []
    return Value(f"{pairs.source}: {word}", compute)


# ---------------------------------------------------------------------------------------------------
# Claims


@dataclass(frozen=True)
class Claim:
    page: str
    quote: str  # a str.format template; each field one number as the page writes it
    values: tuple[Value, ...]
    why: str = ""  # for cited(): where the numbers come from, when not from a run file

    def numbers(self) -> list[float]:
        return [x for v in self.values for x in v.numbers()]

    def fields(self) -> int:
        return len(_FIELD.findall(self.quote))

    def render(self) -> str:
        return self.quote.format(*self.numbers()) if self.values else self.quote

    def sources(self) -> str:
        return "; ".join(dict.fromkeys(v.source for v in self.values)) or self.why


@dataclass
class Strict:
    page: str
    tables_only: bool = False
    section: str | None = None  # a "## " heading: only the lines under it


@dataclass
class Registry:
    claims: list[Claim] = dataclass_field(default_factory=list)
    strict: list[Strict] = dataclass_field(default_factory=list)


REGISTRY = Registry()  # where claim(), cited() and strict() put what they register: build() makes a new one
_FIELD = re.compile(r"\{[^{}]*\}")


def claim(page: str, quote: str, *values: Value) -> None:
    """``quote`` (a template of the page's text, one ``{:spec}`` per number) cites ``values``' numbers, in order."""
    REGISTRY.claims.append(Claim(page, quote, values))


def cited(page: str, quote: str, why: str) -> None:
    """Numbers in ``quote`` (plain text on the page) that no run file holds: an aim, a setting, a published figure;
    ``why`` says where they come from. They count as covered on a strict page."""
    REGISTRY.claims.append(Claim(page, quote, (), why))


def struck(page: str, old: str, why: str) -> None:
    """``~~old~~``: a page's old text, struck through where a correction replaced it (the new text beside it is
    claimed as any other); its numbers count as covered on a strict page, ``why`` says what replaced them."""
    cited(page, f"~~{old}~~", f"struck through: {why}")


def strict(page: str, tables_only: bool = False, section: str | None = None) -> None:
    """Every measured-looking number on ``page`` (in its tables, or in ``section``) must sit inside a claim."""
    REGISTRY.strict.append(Strict(page, tables_only, section))


# ---------------------------------------------------------------------------------------------------
# Checking


def _normalize(text: str) -> tuple[str, list[int]]:
    """``text`` with every run of whitespace one space, and the line (0-based) of each of its characters."""
    out, lines, line, space = [], [], 0, False
    for ch in text:
        if ch.isspace():
            if not space:
                out.append(" ")
                lines.append(line)
            space = True
        else:
            out.append(ch)
            lines.append(line)
            space = False
        if ch == "\n":
            line += 1
    return "".join(out), lines


def _pattern(quote: str) -> re.Pattern:
    """The quote with any number in each field: where the page holds a different number, find it."""
    parts = _FIELD.split(" ".join(quote.split()))
    return re.compile(f"({NUMBER})".join(re.escape(p.replace("{{", "{").replace("}}", "}")) for p in parts))


def _masked(text: str) -> str:
    """Code blocks, code spans and link targets blanked (same length): commands and names like ``-fitted600`` or
    ``k96`` are not numbers."""
    text = re.sub(r"```.*?```", lambda m: " " * len(m.group()), text)
    text = re.sub(r"`[^`]*`", lambda m: " " * len(m.group()), text)
    return re.sub(r"\]\([^)]*\)", lambda m: " " * len(m.group()), text)


@dataclass
class Page:
    path: str
    text: str
    flat: str
    lines: list[int]
    covered: list[bool]


def read_pages(registry: Registry, overrides: dict[str, Path]) -> dict[str, Page]:
    pages = {}
    for path in dict.fromkeys([c.page for c in registry.claims] + [s.page for s in registry.strict]):
        file = overrides.get(path, ROOT / path)
        if not file.is_file():
            raise cli.Missing(f"{file}: no such page (claims cite it)")
        text = file.read_text()
        flat, lines = _normalize(text)
        pages[path] = Page(path, text, flat, lines, [False] * len(flat))
    return pages


def check(registry: Registry = REGISTRY, overrides: dict[str, Path] | None = None) -> list[str]:
    """Every claim and strict page of ``registry`` checked: one line per problem (none: every number holds)."""
    pages = read_pages(registry, overrides or {})
    problems = []
    for c in registry.claims:
        page = pages[c.page]
        label = f"{c.page}: {' '.join(c.quote.split())[:70]!r}"
        try:
            numbers = c.numbers()
        except (KeyError, IndexError, TypeError, ValueError) as err:
            problems.append(f"{label}: its values cannot be computed ({type(err).__name__}: {err}; {c.sources()})")
            continue
        if c.values and c.fields() != len(numbers):
            problems.append(f"{label}: {c.fields()} numbers in the quote, {len(numbers)} values ({c.sources()})")
            continue
        expected = " ".join((c.quote.format(*numbers) if c.values else c.quote).split())
        hits = [m.start() for m in re.finditer(re.escape(expected), page.flat)]
        if hits:
            for start in hits:
                page.covered[start:start + len(expected)] = [True] * len(expected)
            continue
        found = _pattern(c.quote).search(page.flat) if c.values else None
        if found is None:
            problems.append(f"{label}: not on the page (it should read {expected!r}; {c.sources()})")
            continue
        page.covered[found.start():found.end()] = [True] * (found.end() - found.start())  # reported once, here
        said = found.groups()
        wrong = [f"{s} where the run files give {e}" for s, e in zip(said, _pattern(c.quote).match(expected).groups())
                 if s != e]
        problems.append(f"{c.page}:{page.lines[found.start()] + 1}: {', '.join(wrong)} in {expected!r} "
                        f"({c.sources()})")
    for s in registry.strict:
        page = pages[s.page]
        total = page.text.count("\n") + 1
        first, last = 0, total
        if s.section is not None:
            heads = [i for i, line in enumerate(page.text.splitlines()) if line.startswith("## ")]
            mine = [i for i in heads if page.text.splitlines()[i][3:].strip() == s.section]
            if not mine:
                problems.append(f"{s.page}: no section '## {s.section}'")
                continue
            first = mine[0]
            last = next((i for i in heads if i > first), total)
        table = {i for i, line in enumerate(page.text.splitlines()) if line.lstrip().startswith("|")}
        masked = _masked(page.flat)
        for m in MEASURED.finditer(masked):
            line = page.lines[m.start()]
            if not first <= line < last or (s.tables_only and line not in table):
                continue
            if not all(page.covered[m.start():m.end()]):
                problems.append(f"{s.page}:{line + 1}: {m.group()!r} cites no run file: add a claim for it (or "
                                f"cited(...) with where it comes from) in scripts/result_pages/")
    return problems


R = "<r>"  # in a quote: a window-bootstrap or sample interval written "0.447x [0.416x, 0.481x]" (three numbers)
G = "<g>"  # the same to three significant digits: "5.04x [4.55x, 5.57x]"


def q(quote: str) -> str:
    return (quote.replace(R, "{:.3f}x [{:.3f}x, {:.3f}x]").replace(G, "{:#.3g}x [{:#.3g}x, {:#.3g}x]"))


def c(page: str, quote: str, *values: Value) -> None:
    claim(page, q(quote), *values)


def build(pages: Sequence[Callable[[], None]]) -> Registry:
    """A registry of the claims of ``pages``, each page function called once."""
    global REGISTRY
    REGISTRY = Registry()
    for register in pages:
        register()
    return REGISTRY
