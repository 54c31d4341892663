"""The claims of docs/language-modelling.md (training from scratch and the Tiny Shakespeare races, a guide that
points to the experiments' pages): the few numbers it quotes, from the same run files as those pages."""

from __future__ import annotations

from result_pages.engine import cited, claim, field, formula, seeds_verdict_is, strict

X = "experiments/shakespeare_char/"


def claims_docs_language_modelling() -> None:
    """docs/language-modelling.md, strict on the whole page."""
    P = "docs/language-modelling.md"
    strict(P)

    # Language modelling: Tiny Shakespeare against nanoGPT
    claim(P, "(gpu recipe: {:.4f} against nanoGPT's", field(X + "gpu/runs/concat-k384-seed0.json", "best_val_loss"))
    cited(P, "against nanoGPT's\n1.4697)", "nanoGPT's published figure for config/train_shakespeare_char.py "
                                           "(../shared/data/tinyshakespeare/README.md)")

    # Which attention spends a key/value-cache budget best?
    cited(P, "only where the 95% interval", "collab_attn.stats.CONFIDENCE, a setting")

    def tpa_cache(tpa2, tpa1, concat):  # TPA's cache per token over the concatenated original's, ranks 2/2 and 1/1
        return [x["cache_bytes_per_token_bf16"] / concat["cache_bytes_per_token_bf16"] for x in (tpa2, tpa1)]

    def race(steps):
        return X + f"rope_race_{steps}/runs/rope-"
    tpa2, tpa1 = "tpa-k2-v2-q6-seed*.json", "tpa-k1-v1-q6-seed*.json"
    quarter = ("mqa-k32", "collab-k32-v32", "mla-k48-r16")  # the variants at 1/4 of the cache (rope_race.md)
    claim(P, "at 8,000 and 12,000 steps collaborative heads at 1/2 are ahead of it at {:.2f} of the cache, and every "
             "variant at 1/4 ties it at {:.2f}.",
          formula(tpa_cache, *(race(8000) + x.replace("*", "0") for x in (tpa2, tpa1, "concat-k128-seed*.json"))),
          *(seeds_verdict_is(race(n) + "collab-k64-v64-seed*.json", race(n) + tpa2, "ahead") for n in (8000, 12000)),
          *(seeds_verdict_is(race(8000) + f"{v}-seed*.json", race(8000) + tpa1, "tie") for v in quarter))
