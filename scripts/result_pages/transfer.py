"""The claims of experiments/transfer/README.md and README.md's sentence on it (issue 91)."""

from __future__ import annotations

from result_pages.engine import (
    Value,
    against_original,
    boot,
    bootstrap,
    cited,
    claim,
    field,
    formula,
    ppl,
    short,
    strict,
    verdict,
)
from result_pages.engine import (
    run as run_file,
)


def gain(a: str, b: str, domain: str) -> Value:
    """How much lower run ``a``'s perplexity is than run ``b``'s on one domain, in percent (the window bootstrap's
    estimate, as scripts/summarize.py transfer prints it)."""
    return Value(f"{short(a)} against {short(b)}, {domain}, gain", lambda: [-100 * bootstrap(a, b, domain)
                                                                            .mean_difference])


def claims_transfer() -> None:
    """experiments/transfer/README.md (issue 91): every number, from its run files."""
    P = "experiments/transfer/README.md"
    strict(P)
    name = "key-svd-k96-v96-calibrated16384-fitted150-e2e32on32768held4096"
    quarter = "key-svd-k48-v48-calibrated16384-fitted150-e2e32on32768held4096"
    test, val = "experiments/transfer/test/runs/", "experiments/transfer/runs/"
    own, mixed, general = f"{name}-textown.json", f"{name}.json", f"{name}-textall.json"
    four, three = ("wikipedia", "shakespeare", "code", "docs"), ("wikipedia", "shakespeare", "code")
    alone = {d: f"{name}-text{d}.json" for d in three}  # each domain's own fit
    cell = "{:.3f}x [{:.3f}, {:.3f}]"
    bold = "**{:.3f}x** [{:.3f}, {:.3f}]"

    def worst(path, domains=four):
        return formula(lambda r: [max(r["domains"][d]["perplexity"] / r["domains"][d]["original_perplexity"]
                                      for d in domains)], path)

    def ratio(a, b, domain):
        return formula(lambda x, y: [x["domains"][domain]["perplexity"] / y["domains"][domain]["perplexity"]], a, b)

    # the answer
    claim(P, "the model at 1/2 of the cache is {:.3f}x / {:.3f}x the original's perplexity there but {:.3f}x on "
          "Python\nsource and {:.3f}x", ppl(test + mixed, *four))
    claim(P, "it is {:.3f}x / {:.3f}x / {:.3f}x / {:.3f}x, at most {:.3f}x on any\ndomain, and on the docs, which no "
          "fit read, {:.3f}x", ppl(test + general, *four), worst(test + general), ppl(test + general, "docs"))
    claim(P, "from anyone), {:.3f}x /\n{:.3f}x / {:.3f}x / {:.3f}x;", ppl(test + own, *four))
    claim(P, "the three-domain fit ({:.3f}x against {:.3f}x for own text and {:.3f}x for the race's text)",
          worst(val + general, three), worst(val + own, three), worst(val + mixed, three))
    claim(P, "over the three-domain fit ({:.1f}% on wikipedia", gain(test + alone["wikipedia"], test + general,
                                                                     "wikipedia"))
    claim(P, "three-domain fit is at\nmost {:.3f}x, far from the aim", worst(test + quarter + "-textall.json"))
    long = "key-svd-k96-v96-calibrated16384-fitted150-e2e128on131072held4096stop32-textall.json"
    mixture = f"{name}-textevery.json"

    def times_as_long(a, b):
        return formula(lambda x, y: [x["end_to_end"]["seconds"] / y["end_to_end"]["seconds"]], a, b)

    claim(P, "it is at most {:.3f}x on every test domain", worst(test + long))
    claim(P, "with an end-to-end fit {:.1f} times as long", times_as_long(val + long, val + general))
    cited(P, "(at most 10% worse than the in-domain fit)", "the aim of issue 91")
    cited(P, "meets the issue's aim of at most 1.25x everywhere at 1/2", "the aim of issue 91")
    cited(P, "far from the aim of 1.8x", "the aim of issue 91")
    # section 1
    claim(P, "| own samples | " + " | ".join([cell] * 4) + " | {:.3f}x |",
          *(against_original(test + own, d) for d in four), worst(test + own))
    claim(P, "| the three domains' text | " + " | ".join([cell, cell, cell, bold]) + " | **{:.3f}x** |",
          *(against_original(test + general, d) for d in four), worst(test + general))
    claim(P, "| the race's text (wikipedia + Shakespeare) | " + " | ".join([cell, bold, cell, cell]) + " | {:.3f}x |",
          *(against_original(test + mixed, d) for d in four), worst(test + mixed))
    for label, domain, cells in (("wikipedia", "wikipedia", [bold, cell, cell, cell]),
                                 ("Shakespeare", "shakespeare", [cell] * 4),
                                 ("code", "code", [cell, cell, bold, cell])):
        claim(P, f"| {label} | " + " | ".join(cells) + " | {:.3f}x |",
              *(against_original(test + alone[domain], d) for d in four), worst(test + alone[domain]))
    claim(P, "The original: {:.2f} / {:.2f} / {:.2f} / {:.2f} on test",
          formula(lambda r: [r["domains"][d]["perplexity"] for d in four], test + "original.json"))
    for label, a, b in (("the three domains' text / own samples", general, own),
                        ("own samples / the race's text", own, mixed)):
        words = [verdict(test + a, test + b, d) for d in four]
        quote = f"| {label} | " + " | ".join(f"{{:.3g}}x [{{:.3g}}x, {{:.3g}}x] {w}" for w in words) + " |"
        claim(P, quote, *(boot(test + a, test + b, d) for d in four))
    claim(P, "the three\ndomains' text {:.3f}x / {:.3f}x / {:.3f}x, own samples {:.3f}x / {:.3f}x / {:.3f}x, the "
          "race's text {:.3f}x / {:.3f}x /\n{:.3f}x",
          ppl(val + general, *three), ppl(val + own, *three), ppl(val + mixed, *three))
    words = {"ahead": "ahead by {:.1f}%", "tie": "a tie", "behind": "behind by {:.1f}%"}
    for domain in three:
        quote, values = f"| {domain} |", []
        for split in (test, val):
            word = verdict(split + alone[domain], split + general, domain)
            quote += " {:.3f}x [{:.3f}, {:.3f}], " + words[word] + " |"
            values += [boot(split + alone[domain], split + general, domain)] + (
                [] if word == "tie" else [gain(split + alone[domain], split + general, domain)])
        claim(P, quote, *values)
    claim(P, "The in-domain fit is at most {:.1f}% better", gain(test + alone["wikipedia"], test + general,
                                                                  "wikipedia"))
    cited(P, "the issue's aim (at most 10%)", "the aim of issue 91")
    claim(P, "the in-domain fit is {:.1f}% / {:.1f}% / {:.1f}% better on\ntest",
          *(gain(test + alone[d], test + own, d) for d in three))
    claim(P, "the model is {:.3f}x to {:.3f}x on the other two fitted domains", formula(
        lambda *runs: [f(r["domains"][d]["perplexity"] / r["domains"][d]["original_perplexity"]
                         for r, mine in zip(runs, three) for d in three if d != mine) for f in (min, max)],
        *(test + alone[d] for d in three)))
    claim(P, "| the three domains' text | 128 steps on 131,072 tokens | " + " | ".join([cell] * 4) + " | {:.3f}x |",
          *(against_original(test + long, d) for d in four), worst(test + long))
    claim(P, "on test {:.3g}x [{:.3g}x, {:.3g}x] on wikipedia, {:.3g}x\n  [{:.3g}x, {:.3g}x] on code, "
          "{:.3g}x [{:.3g}x, {:.3g}x] on the docs",
          *(boot(test + long, test + general, d) for d in ("wikipedia", "code", "docs")))
    for domain in four:
        assert verdict(test + long, test + general, domain) == "ahead", domain  # "ahead ... on every domain"
    for domain in three:
        assert verdict(val + long, val + general, domain) == "ahead", domain  # "and on validation on all three"
    claim(P, "(worst {:.3f}x against {:.3f}x). At most {:.3f}x on any test domain", worst(val + long, three),
          worst(val + general, three), worst(test + long))
    cited(P, "`E2E_STEPS=128 E2E_TOKENS=131072 E2E_CHECK_EVERY=32 run.sh fit all`", "the command")
    cited(P, "(at\n  most 1.25x everywhere)", "the aim of issue 91")
    words = [verdict(val + mixture, val + general, d) for d in three]  # own samples beside them: "no gain"
    assert words == ["tie", "ahead", "behind"], words
    # section 2
    q_own, q_general = test + quarter + "-textown.json", test + quarter + "-textall.json"
    claim(P, "| own samples | {:.3f}x | {:.3f}x | {:.3f}x | {:.3f}x | {:.3f}x | {:.3f}x / {:.3f}x / {:.3f}x |",
          ppl(q_own, *four), worst(q_own), ppl(val + quarter + "-textown.json", *three))
    claim(P, "| the three domains' text | {:.3f}x | {:.3f}x | {:.3f}x | {:.3f}x | {:.3f}x | {:.3f}x / {:.3f}x / "
          "{:.3f}x |", ppl(q_general, *four), worst(q_general), ppl(val + quarter + "-textall.json", *three))
    claim(P, "`key-svd` at 1/4 ({:.0f} + {:.0f} numbers per token and layer)",
          field(val + quarter + "-textall.json", "entry.rank", "entry.value_rank"))
    claim(P, "the window bootstrap: {:.3g}x [{:.3g}x, {:.3g}x] on wikipedia, {:.3g}x [{:.3g}x, {:.3g}x] on code, "
          "{:.3g}x [{:.3g}x, {:.3g}x] on\nthe docs",
          *(boot(q_general, q_own, d) for d in ("wikipedia", "code", "docs")))
    claim(P, "(worst {:.3f}x against {:.3f}x)", worst(val + quarter + "-textall.json", three),
          worst(val + quarter + "-textown.json", three))
    claim(P, "everywhere, is not met: {:.3f}x on code", ppl(q_general, "code"))
    q_long = "key-svd-k48-v48-calibrated16384-fitted150-e2e128on131072held4096stop32-textall.json"
    claim(P, "| the three domains' text, 128 end-to-end steps on 131,072 tokens | {:.3f}x | {:.3f}x | {:.3f}x | "
          "{:.3f}x | {:.3f}x | {:.3f}x / {:.3f}x / {:.3f}x |", ppl(test + q_long, *four), worst(test + q_long),
          ppl(val + q_long, *three))
    for split, domains in ((test, four), (val, three)):
        for domain in domains:  # "ahead of the 32 steps on every domain (test ...; validation: ahead on all three)"
            assert verdict(split + q_long, split + quarter + "-textall.json", domain) == "ahead", (split, domain)
    claim(P, "(test: {:.3f}x [{:.3f}x, {:.3f}x] on wikipedia,\n{:.3f}x [{:.3f}x, {:.3f}x] on code, {:.3f}x [{:.3f}x, "
          "{:.3f}x] on the docs", *(boot(test + q_long, q_general, d) for d in ("wikipedia", "code", "docs")))
    claim(P, "and still miss\nthe aim: {:.3f}x on the docs, {:.3f}x on wikipedia ({:.3f}x at worst on validation)",
          ppl(test + q_long, "docs", "wikipedia"), worst(val + q_long, three))
    losses = [loss for _, loss in run_file(val + q_long)["end_to_end"]["checks"]]
    gains = [a - b for a, b in zip(losses, losses[1:])]
    assert gains == sorted(gains, reverse=True) and min(gains) > 0, losses  # "its held-out loss fell less at each"
    cited(P, "`BUDGET=0.25 E2E_STEPS=128 E2E_TOKENS=131072 E2E_CHECK_EVERY=32 run.sh\nfit all`", "the command")
    windows = val + "key-svd-k48-v48-calibrated16384-fitted150-e2e32on32768held6144len2048-textall.json"
    # "Fitting windows of 2,048 tokens instead ... do not help either" (numbers in LOG.md, sixth session)
    assert [verdict(windows, val + quarter + "-textall.json", d) for d in three] == ["behind", "tie", "tie"]
    claim(P, "far from the aim of 1.8x; with 128 end-to-end steps at most {:.3f}x, still short",
          worst(test + q_long))
    cited(P, "The issue's aim at 1/4, at most 1.8x", "the aim of issue 91")
    # section 2: which weights are trained
    q_every = "key-svd-k48-v48-calibrated16384-fitted150-distilled131072-textall.json"
    q_both = "key-svd-k48-v48-calibrated16384-fitted150-e2e128on131072held4096stop32-distilled131072-textall.json"
    claim(P, "| the three domains' text, every weight distilled on {:,.0f} tokens (no end-to-end fit) | {:.3f}x | "
          "{:.3f}x | {:.3f}x | {:.3f}x | {:.3f}x | {:.3f}x / {:.3f}x / {:.3f}x |", field(val + q_every,
                                                                                    "training.tokens"),
          ppl(test + q_every, *four), worst(test + q_every), ppl(val + q_every, *three))
    claim(P, "| the three domains' text, 128 end-to-end steps, then every weight distilled on the same {:,.0f} "
          "tokens | {:.3f}x | {:.3f}x | {:.3f}x | **{:.3f}x** | **{:.3f}x** | {:.3f}x / {:.3f}x / {:.3f}x |",
          field(val + q_both, "training.tokens"), ppl(test + q_both, *four), worst(test + q_both),
          ppl(val + q_both, *three))
    claim(P, "one pass, batches of 4 windows of 256: {:.0f} steps) on the first {:,.0f} tokens",
          formula(lambda r: [max(h["step"] for h in r["training"]["history"]), r["training"]["tokens"]],
                  val + q_every))
    cited(P, "AdamW, lr\n1e-4", "collab_attn.pretrained.distill's recipe")
    for split, domains in ((test, four), (val, three)):
        for domain in domains:  # every weight ahead of the attention alone; after the 128 steps, of the layer fit
            assert verdict(split + q_every, split + q_long, domain) == "ahead", (split, domain)
            assert verdict(split + q_both, split + q_every, domain) == "ahead", (split, domain)
    claim(P, "every weight is ahead on all four\n  test domains: {:.3g}x [{:.3g}x, {:.3g}x] on wikipedia, {:.3g}x "
          "[{:.3g}x, {:.3g}x] on Shakespeare, {:.3g}x [{:.3g}x, {:.3g}x]\n  on code, {:.3g}x [{:.3g}x, {:.3g}x] on "
          "the docs", *(boot(test + q_every, test + q_long, d) for d in four))
    claim(P, "test domains ({:.3g}x [{:.3g}x, {:.3g}x] on wikipedia, {:.3g}x [{:.3g}x, {:.3g}x] on the docs)",
          boot(test + q_both, test + q_every, "wikipedia"), boot(test + q_both, test + q_every, "docs"))
    claim(P, "where\n  it is chosen (worst {:.3f}x against {:.3f}x)", worst(val + q_both, three),
          worst(val + q_every, three))
    claim(P, "On test it is at most {:.3f}x [{:.3f}, {:.3f}] (the docs), {:.3f}x on\n  wikipedia",
          against_original(test + q_both, "docs"), ppl(test + q_both, "wikipedia"))
    cited(P, "the issue's aim at 1/4 (at most 1.8x everywhere)", "the aim of issue 91")
    claim(P, "the distillation took {:,.0f} s (from the layer fit) and {:,.0f} s (after the 128 steps) on one thread",
          field(val + q_every, "training.seconds"), field(val + q_both, "training.seconds"))
    claim(P, "every weight distilled\nafter them leaves it at most {:.3f}x [{:.3f}, {:.3f}] (the docs)",
          against_original(test + q_both, "docs"))
    cited(P, "`BUDGET=0.25 run.sh fit all own`", "the command")
    # section 2: every weight at the cost of the 10-minute recipe
    wide = "key-svd-k96-v96-calibrated32768-fitted150-distilled32768-textown.json"  # the general recipe's run
    every = {(budget, text): f"key-svd-k{k}-v{k}-calibrated16384-fitted150-distilled32768-text{text}.json"
             for budget, k in (("1/2", 96), ("1/4", 48)) for text in ("own", "all")}
    attention = {("1/2", t): f"{name}-text{t}.json" for t in ("own", "all")} | {
        ("1/4", t): f"{quarter}-text{t}.json" for t in ("own", "all")}
    label = {"own": "own samples", "all": "the three domains' text"}
    claim(P, "32 steps on 32,768\ntokens of own samples, {:.0f} on {:,.0f} of the three domains' text",
          formula(lambda r: [max(h["step"] for h in r["training"]["history"]), r["training"]["tokens"]],
                  val + every["1/2", "all"]))
    assert [run_file(val + every[b, "own"])["training"]["tokens"] for b in ("1/2", "1/4")] == [32768] * 2
    assert max(h["step"] for h in run_file(val + every["1/2", "own"])["training"]["history"]) == 32
    for key in every:
        claim(P, f"| {key[0]} | {label[key[1]]} | " + " | ".join(["{:.3f}x"] * 5) + " |",
              ppl(test + every[key], *four), worst(test + every[key]))
        words = [verdict(test + every[key], test + attention[key], d) for d in four]
        quote = f"| {key[0]}, {label[key[1]]} | " + " | ".join(
            f"{{:.3g}}x [{{:.3g}}x, {{:.3g}}x] {w}" for w in words) + " |"
        claim(P, quote, *(boot(test + every[key], test + attention[key], d) for d in four))
        expected = ["ahead", "ahead", "tie"] if key == ("1/2", "all") else ["ahead"] * 3
        assert [verdict(val + every[key], val + attention[key], d) for d in three] == expected, key
    twice = "key-svd-k96-v96-calibrated16384-fitted150-distilled65536-textown.json"
    claim(P, "Twice the\nown samples ({:,.0f} tokens, {:.0f} steps; not timed) gain a little, ahead on both splits "
          "but for a tie on Shakespeare: at\nmost {:.3f}x on test at 1/2",
          formula(lambda r: [r["training"]["tokens"], max(h["step"] for h in r["training"]["history"])], val + twice),
          worst(test + twice))
    for split, domains in ((val, three), (test, four)):
        assert [verdict(split + twice, split + every["1/2", "own"], d) for d in domains] == (
            ["ahead", "tie", "ahead", "ahead"][:len(domains)]), split
    doubled = "key-svd-k96-v96-calibrated16384-fitted150-distilled65536-textall.json"

    def below_aim():
        tops = [against_original(test + doubled, d).numbers()[2] for d in four]
        if max(tops) >= 1.25:
            raise ValueError(f"an interval reaches {max(tops):.3f}, the page says every one is below 1.25")
        return [1.25]
    claim(P, "on twice the three domains' text ({:,.0f} tokens),\nat most {:.3f}x on every test domain, every interval "
          "below {:.2f}", formula(lambda r: [r["entry"]["distill_tokens"]], val + doubled), worst(test + doubled),
          Value(f"{short(test + doubled)}, intervals", below_aim))
    claim(P, "Twice the three domains' text ({:,.0f} tokens, {:.0f} steps) meets the aim at 1/2 on every\ntest domain: "
          "{:.3f}x [{:.3f}, {:.3f}] / {:.3f}x / {:.3f}x [{:.3f}, {:.3f}] / {:.3f}x",
          formula(lambda r: [r["entry"]["distill_tokens"], max(h["step"] for h in r["training"]["history"])],
                  val + doubled),
          against_original(test + doubled, "wikipedia"), ppl(test + doubled, "shakespeare"),
          against_original(test + doubled, "code"), ppl(test + doubled, "docs"))
    assert [verdict(test + doubled, test + every["1/2", "all"], d) for d in four] == ["ahead"] * 4
    assert [verdict(val + doubled, val + every["1/2", "all"], d) for d in three] == ["tie", "ahead", "ahead"]
    claim(P, "ahead of the 33 steps on all four (code: {:.3g}x [{:.3g}x, {:.3g}x];",
          boot(test + doubled, test + every["1/2", "all"], "code"))
    second = "key-svd-k96-v96-calibrated16384s1-fitted150-distilled65536-textall.json"
    assert run_file(val + second)["entry"]["calibration_sample"] == 1
    assert run_file(val + second)["training"]["tokens"] == run_file(val + doubled)["training"]["tokens"]
    assert [verdict(test + second, test + doubled, d) for d in four] == ["tie"] * 4  # "ties with it on all four"
    tops = [against_original(test + second, d).numbers()[2] for d in four]
    assert max(tops) < 1.25, tops  # "every interval below 1.25"
    claim(P, "ties with it on all four test domains: at most {:.3f}x [{:.3f}, {:.3f}], every interval below 1.25",
          against_original(test + second, max(four, key=lambda d: ppl(test + second, d).numbers()[0])))
    claim(P, "and at most {:.3f}x with a second calibration sample", worst(test + second))
    assert run_file(val + wide)["entry"]["calibration_tokens"] == 32768  # all 128 windows of 256 the distillation reads
    assert run_file(val + wide)["training"]["tokens"] == 32768
    assert [verdict(val + wide, val + every["1/2", "own"], d) for d in three] == ["tie", "tie", "ahead"]
    assert [verdict(test + wide, test + every["1/2", "own"], d) for d in four] == ["ahead", "tie", "ahead", "ahead"]
    assert max(three, key=lambda d: ppl(val + every["1/2", "own"], d).numbers()[0]) == "code"  # "the worst domain"
    claim(P, "on test {:.3f}x / {:.3f}x / {:.3f}x / {:.3f}x, ahead on wikipedia, code and the docs",
          ppl(test + wide, *four))
    cited(P, "Shakespeare; still short of 1.25x", "the aim of issue 91 (its worst domain claimed just above)")
    claim(P, "and with every weight distilled on {:,.0f} of its tokens ({:.3f}x, section 2; {:.3f}x through the "
          "one-call\n  path, section 5)", formula(lambda r: [r["entry"]["distill_tokens"]], val + doubled),
          worst(test + doubled), worst("experiments/transfer/one_call/textfile/test.json"))
    claim(P, "every weight distilled at the 10-minute recipe's\ncost: at most {:.3f}x at 1/2",
          worst(test + wide))
    for key in every:  # "ahead on every test domain at 1/4, and at 1/2 on all but code with the three domains' text"
        assert [verdict(test + every[key], test + attention[key], d) for d in four] == (
            ["ahead", "ahead", "tie", "ahead"] if key == ("1/2", "all") else ["ahead"] * 4), key
    claim(P, "own samples at most {:.3f}x at 1/2 (aim 1.25x) and {:.3f}x at 1/4 (aim 1.8x)",
          worst(test + every["1/2", "own"]), worst(test + every["1/4", "own"]))
    # section 3
    stage = "{:.3f}x / {:.3f}x / {:.3f}x"
    for label, suffix in (("| calibrated on 16,384 tokens | none | ", "-calibrated16384"),
                          ("| + each layer fitted, 150 steps | attention, one layer at a time | ",
                           "-calibrated16384-fitted150"),
                          ("| + end to end, 32 steps on 32,768 tokens | attention, together | ", "")):
        base = f"key-svd-k96-v96{suffix}" if suffix else name
        claim(P, label + stage + " | " + stage + " |", ppl(val + base + ".json", *three),
              ppl(val + base + "-textown.json", *three))
    calibrated = val + "key-svd-k96-v96-calibrated16384"
    claim(P, "code is {:.3f}x, nearly twice what it is calibrated on own text ({:.3f}x)",
          ppl(calibrated + ".json", "code"), ppl(calibrated + "-textown.json", "code"))
    claim(P, "the layer fit takes code from {:.3f}x to {:.3f}x, the end\n  to end fit to {:.3f}x; on own text, from "
          "{:.3f}x to {:.3f}x", ppl(calibrated + ".json", "code"), ppl(calibrated + "-fitted150.json", "code"),
          ppl(val + mixed, "code"), ppl(calibrated + "-textown.json", "code"), ppl(val + own, "code"))
    # section 3: early stopping on another domain, and the pull toward the start (fitted on wikipedia; numbers in LOG)
    wiki, stop, pull = (val + f"{name}{tail}-textwikipedia.json" for tail in ("", "codestop4", "anchor10000"))
    checks = [loss for _, loss in run_file(stop)["end_to_end"]["checks"]]
    assert checks == sorted(checks, reverse=True)  # "lowers the KL on code's fit split too, at every check"
    assert run_file(stop)["end_to_end"]["best_step"] == 32  # "early stopping on code keeps the last weights"
    assert run_file(stop)["domains"] == run_file(wiki)["domains"]
    words = [verdict(pull, wiki, d) for d in three]
    assert words == ["behind", "tie", "behind"], words  # "behind ... on wikipedia and code and a tie on Shakespeare"
    # section 3: how the own text is drawn; the distillation's rate and passes on own samples
    from collab_attn.own_text import OWN_TEXTS

    drawn = val + "key-svd-k96-v96-calibrated16384-fitted150-distilled32768"
    settings = {t: (r.temperature, r.top_p) for t, r in OWN_TEXTS.items()}
    assert settings == {"own": (1.0, 1.0), "owncode": (1.0, 1.0), "ownnucleus": (1.0, 0.9), "ownlowtemp": (0.7, 1.0),
                        "ownhightemp": (1.2, 1.0), "ownhighertemp": (1.5, 1.0)}, settings
    behind = ["behind"] * 3
    # "ahead on all three of the nucleus and of temperatures 0.7, 1.2 and 1.5, and ahead on wikipedia of owncode,
    # which ties on the others" (each row: LOG.md, sixth session)
    for text, expected in (("owncode", ["behind", "tie", "tie"]), ("ownnucleus", behind), ("ownlowtemp", behind),
                           ("ownhightemp", behind), ("ownhighertemp", behind)):
        assert [verdict(f"{drawn}-text{text}.json", f"{drawn}-textown.json", d) for d in three] == expected, text
    claim(P, "Temperature 1 (`own`:\n{:.3f}x / {:.3f}x / {:.3f}x on wikipedia / Shakespeare / code)",
          ppl(f"{drawn}-textown.json", *three))
    cited(P, "the nucleus (top-p 0.9) and of temperatures 0.7, 1.2 and 1.5", "collab_attn.own_text.OWN_TEXTS "
          "(asserted above)")
    rate, twice_over = f"{drawn}lr0.0003-textown.json", f"{drawn}x2-textown.json"
    assert [verdict(rate, f"{drawn}-textown.json", d) for d in three] == ["ahead", "tie", "behind"]
    assert [verdict(twice_over, f"{drawn}-textown.json", d) for d in three] == ["tie"] * 3
    assert [verdict(val + twice, twice_over, d) for d in three] == ["ahead", "tie", "ahead"]
    assert run_file(twice_over)["entry"]["distill_passes"] == 2 and run_file(rate)["entry"]["distill_learning_rate"] \
        == 3e-4
    fast = f"{drawn}lr0.001-textown.json"
    assert [verdict(fast, f"{drawn}-textown.json", d) for d in three] == behind
    assert run_file(fast)["entry"]["distill_learning_rate"] == 1e-3
    cited(P, "A peak rate of 3e-4", "the setting of the run (asserted above)")
    cited(P, "(1e-3: behind on all three)", "the setting of the run (asserted above)")
    claim(P, "a second pass over the samples ties on all three, where {:,.0f} new ones are ahead",
          field(val + twice, "training.tokens"))
    # section 5
    gen, texts = "experiments/transfer/one_call/general/", "experiments/transfer/one_call/texts/"
    textfile = "experiments/transfer/one_call/textfile/"  # the same recipe as texts, through scripts/reparametrize.py
    ours, race = run_file(gen + "reparam_report.json"), run_file(val + wide)
    logged = [[(h["step"], h["loss"]) for h in r["history"] if "loss" in h] for r in (ours["distillation"],
                                                                                     race["training"])]
    assert [step for step, _ in logged[0]] == [step for step, _ in logged[1]] == list(range(1, 33))

    def apart(a, b):  # the largest difference between the two runs' logged distillation losses
        pairs = zip(*([h["loss"] for h in r["history"] if "loss" in h] for r in (a["distillation"], b["training"])))
        return [max(abs(x - y) for x, y in pairs)]

    claim(P, "every logged distillation loss within {:.5f} of the race's", formula(apart, gen + "reparam_report.json",
                                                                                 val + wide))
    assert ours["collab"]["fit_steps"] == 150 and ours["collab"]["distill_steps"] == 32
    assert ours["collab"]["calibration_samples"] == 128 and ours["fit"]["tokens"] == race["fit"]["tokens"]
    assert "fit_steps" not in run_file(gen + "timing.json")["command"]  # no fitting setting given
    claim(P, "On the otherwise idle 2-core CPU\nit took {:,.0f} s (`one_call/general/`)", field(gen + "timing.json",
                                                                                             "wall_seconds"))
    claim(P, "{:.0f} s sampling the {:,.0f} tokens of own text, {:.0f} s of layer fit, {:.0f} s of\ndistillation",
          field(gen + "timing.json", "sampling_seconds"),
          formula(lambda r: [r["distillation"]["windows"] * 255], gen + "reparam_report.json"),
          field(gen + "reparam_report.json", "fit.seconds", "distillation.seconds"))
    claim(P, "**over the issue's 20-minute aim by {:.0f}%**", formula(
        lambda t: [100 * (t["wall_seconds"] / 1200 - 1)], gen + "timing.json"))
    again = "experiments/transfer/one_call/general-capture/"  # the same recipe after the capture change, timed again
    theirs = run_file(again + "reparam_report.json")
    assert theirs["collab"] == ours["collab"] and "fit_steps" not in run_file(again + "timing.json")["command"]
    assert [h for h in theirs["distillation"]["history"] if "loss" in h] == [
        h for h in ours["distillation"]["history"] if "loss" in h]  # "every distillation loss ... equal to the bit"
    assert [(f["error_before"], f["error_after"]) for f in theirs["fit"]["layers"]] == [
        (f["error_before"], f["error_after"]) for f in ours["fit"]["layers"]]  # "... and layer error"
    claim(P, "capture {:.0f} s instead of\n115 s", field(again + "reparam_report.json", "fit.capture_seconds"))
    claim(P, "instead of\n{:.0f} s, while the same", field(gen + "reparam_report.json", "fit.capture_seconds"))

    def per_step(r):  # seconds a distillation step
        return r["distillation"]["seconds"] / len([h for h in r["distillation"]["history"] if "loss" in h])

    claim(P, "the same distillation steps took {:.2f}x as long that day ({:.2f} s a step against {:.2f} s", formula(
        lambda a, b: [per_step(a) / per_step(b), per_step(a), per_step(b)], again + "reparam_report.json",
        gen + "reparam_report.json"))
    claim(P, "{:,.0f} s (one timing each, no verdict)", field(again + "timing.json", "wall_seconds"))
    assert run_file(texts + "run.json")["name"] == doubled.removesuffix(".json")
    claim(P, "{:,.0f} s from\ncalibration to the last distillation step ({:.0f} s calibrating and converting, {:.0f} s "
          "of layer fit, {:.0f} s of\ndistillation; {:,.0f} s with loading and evaluation", field(
              texts + "timing.json", "recipe_seconds", "conversion_seconds", "layer_fit_seconds",
              "distillation_seconds", "wall_seconds"))
    minutes = field(texts + "timing.json", "recipe_seconds", scale=1 / 60)
    claim(P, "**{:.1f} minutes: over the 20-minute aim by {:.0f}%**", minutes,
          formula(lambda t: [100 * (t["recipe_seconds"] / 1200 - 1)], texts + "timing.json"))
    claim(P, "in {:.1f} minutes on both cores", minutes)
    claim(P, "missed by the one-call recipe\n  ({:.1f}, at most {:.3f}x at 1/2 on own samples) and by the recipe that "
          "meets the aim at 1/2 ({:.1f} as a race command,\n  {:.1f} through the one-call path in another session",
          field(gen + "timing.json", "wall_seconds", scale=1 / 60), worst(test + wide), minutes,
          field(textfile + "timing.json", "wall_seconds", scale=1 / 60))
    claim(P, "its\nperplexities are the committed run's within {:.2f}%", formula(
        lambda a, b: [100 * max(abs(a["domains"][d]["perplexity"] / b["domains"][d]["perplexity"] - 1) for d in three)],
        texts + "run.json", val + doubled))
    report = run_file(textfile + "reparam_report.json")
    assert report["collab"]["fit_steps"] == 150 and report["collab"]["distill_steps"] == 64
    assert report["calibration"]["sequences"] == 64 and report["distillation"]["tokens"] == 64 * 4 * 256
    assert "collab.calibration=" in run_file(textfile + "timing.json")["command"]
    claim(P, "writes the three domains' fitting text ({:.0f} windows of each fit split, {:,.0f} tokens)",
          Value("write_fit_text.py's default tokens over 3 domains x 256", lambda: [67584 / 3 / 256]),
          Value("write_fit_text.py's default tokens", lambda: [67584]))
    claim(P, "On test\n**" + " / ".join([cell, "{:.3f}x", cell, cell]) + ": every interval below 1.25**",
          against_original(textfile + "test.json", "wikipedia"), ppl(textfile + "test.json", "shakespeare"),
          against_original(textfile + "test.json", "code"), against_original(textfile + "test.json", "docs"))
    tops = [against_original(textfile + "test.json", d).numbers()[2] for d in four]
    assert max(tops) < 1.25, tops  # "every interval below 1.25"
    assert [verdict(textfile + "test.json", test + doubled, d) for d in four] == ["tie", "tie", "ahead", "tie"]
    assert [verdict(textfile + "validation.json", val + doubled, d) for d in three] == ["tie", "tie", "behind"]
    claim(P, "(test: ahead, {:.3g}x [{:.3g}x, {:.3g}x]; validation: behind, {:.3g}x [{:.3g}x,\n{:.3g}x])",
          boot(textfile + "test.json", test + doubled, "code"),
          boot(textfile + "validation.json", val + doubled, "code"))
    claim(P, "It took {:,.0f} s ({:.0f} s of layer fit, {:.0f} s of distillation; one timing, another session)",
          field(textfile + "timing.json", "wall_seconds", "layer_fit_seconds", "distillation_seconds"))
    assert run_file(textfile + "timing.json")["wall_seconds"] > 1200  # "over 20 minutes"
    # section 4
    claim(P, "on the three domains' text ({:.3f}x at\n  worst)", worst(test + long))
    claim(P, "not with the 10-minute recipe ({:.3f}x on code, {:.3f}x on wikipedia)",
          ppl(test + general, "code", "wikipedia"))
    claim(P, "estimate, not by every interval ({:.3f}x\n  [{:.3f}, {:.3f}] on the docs)",
          against_original(test + q_both, "docs"))
    cited(P, "at most 1.8x at 1/4 is met by the estimate", "the aim of issue 91")
    cited(P, "at most 1.25x everywhere at 1/2", "the aim of issue 91")
    cited(P, "the in-domain fit at most 10% better", "the aim of issue 91")
    cited(P, "within 20 minutes is missed", "the aim of issue 91")
    claim(P, "Trained: the attention layers ({:.1f}M parameters)",
          field(val + own, "end_to_end.parameters", scale=1e-6))
    cited(P, "(the last 10% of Tiny Shakespeare)", "the split of collab_attn/pretrained/heldout.py")
    cited(P, "(torch 2.13.0's Python source", "the pinned torch version")
    cited(P, "(Python 3.11.7's language reference", "the Python version whose pydoc text the docs domain reads")
    cited(P, "with the 95% paired bootstrap", "the confidence of collab_attn.stats")


def claims_readme_transfer() -> None:
    """README.md's sentence on experiments/transfer (issue 91)."""
    P = "README.md"
    test = "experiments/transfer/test/runs/key-svd-k96-v96-calibrated16384-fitted150-e2e32on32768held4096"
    claim(P, "fitted on wikipedia and Shakespeare, {:.3f}x on Python source\n  and {:.3f}x on Python's documentation",
          ppl(test + ".json", "code", "docs"))
    def worst(path):
        return formula(lambda r: [max(m["perplexity"] / m["original_perplexity"] for m in r["domains"].values())],
                       path)

    claim(P, "fitted on those two and Python source, at most {:.3f}x on any of the four\n  domains ({:.3f}x on the "
          "documentation", worst(test + "-textall.json"), ppl(test + "-textall.json", "docs"))
    claim(P, "`export` took {:,.0f} s on the project's otherwise idle 2-core CPU",
          field("experiments/transfer/one_call/general/timing.json", "wall_seconds"))
    cited(P, "(150 steps a layer on 128 windows of them, then every weight distilled 32 steps",
          "scripts/reparametrize.py GENERAL_RECIPE")
    cited(P, "`collab.calibration=<file> collab.fit_steps=150 collab.distill_steps=64`", "the recipe of "
          "experiments/transfer/run_one_call.sh FINISH=textfile")
    claim(P, "({:.1f} minutes on both cores; {:.3f}x through\n  `scripts/reparametrize.py` given that text as a file)",
          field("experiments/transfer/one_call/texts/timing.json", "recipe_seconds", scale=1 / 60),
          worst("experiments/transfer/one_call/textfile/test.json"))
    claim(P, "and at most {:.3f}x with 128 end-to-end steps instead of\n  32", worst(
        "experiments/transfer/test/runs/key-svd-k96-v96-calibrated16384-fitted150-e2e128on131072held4096stop32-textall"
        ".json"))
    claim(P, "At 1/4, with every weight distilled after 128\n  end-to-end steps, at most {:.3f}x on any of the four",
          worst("experiments/transfer/test/runs/key-svd-k48-v48-calibrated16384-fitted150-e2e128on131072held4096stop32-"
                "distilled131072-textall.json"))
    claim(P, "(what a decoder is fitted on when no text is\n  given), at most {:.3f}x on any of the four domains",
          worst("experiments/transfer/test/runs/key-svd-k96-v96-calibrated32768-fitted150-distilled32768-textown.json"))
    claim(P, "or {:.3f}x with every weight distilled on {:,.0f} tokens",
          worst("experiments/transfer/test/runs/key-svd-k96-v96-calibrated16384-fitted150-distilled65536-textall.json"),
          field("experiments/transfer/runs/key-svd-k96-v96-calibrated16384-fitted150-distilled65536-textall.json",
                "entry.distill_tokens"))
    claim(P, "A fit on one domain alone gains at\n  most {:.1f}% there over the three-domain fit",
          Value("the one-domain fits against the three-domain fit, the largest gain", lambda: [max(
              -100 * bootstrap(f"{test}-text{d}.json", test + "-textall.json", d).mean_difference
              for d in ("wikipedia", "shakespeare", "code"))]))
