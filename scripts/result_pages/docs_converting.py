"""The claims of docs/converting.md (converting a pretrained model), section by section: the numbers it quotes from
experiments/benchmarks/, experiments/minilm_glue/ and experiments/smollm2/, recomputed from their result files.
(Its sentence on the distillations at a quarter of SmolLM2's cache is claimed with the SmolLM2 page, in
smollm2.py.)"""

from __future__ import annotations

import statistics

from result_pages.benchmarks import row, span
from result_pages.engine import Value, boot, cited, claim, field, formula, ppl, stage, strict, struck, verdict_is

P = "docs/converting.md"
B = "experiments/benchmarks/"
GLUE = "experiments/minilm_glue/runs/"
S = "experiments/smollm2/"
F, L, T = S + "fitted/runs/", S + "fitted_2048/runs/", S + "ten_minutes/runs/"
SMOLLM2 = 134_515_008  # SmolLM2-135M's parameters (as smollm2.py counts its share of the model)
VOCABULARY = 49_152  # SmolLM2's vocabulary: the original's next-token distributions, 4 bytes an entry
CORRECTED = "corrected 2026-12-06 (issue 88)"


def options() -> None:
    """## Options: the implicit solver's speed-up (benchmarks, section 1) and calibration on MRPC (section 2)."""

    def speed_up(r):  # MiniLM at rank 128: the paper's settings' time over the implicit solver's, at a lower error
        m = next(x for x in r["minilm"] if x["rank"] == 128)["variants"]
        if not m["implicit"]["mean_error"] < m["paper"]["mean_error"]:
            raise ValueError("the implicit solver's error is not lower than the paper's settings'")
        return [m["paper"]["total_seconds"] / m["implicit"]["total_seconds"]]
    claim(P, "tensor ({:.0f}x faster than tensorly's dense `parafac` with the paper's settings, at a lower error:",
          formula(speed_up, B + "decomposition.json"))

    aware, plain = GLUE + "mrpc/minilm/cp-aware-r128/seed0-46922a08/", GLUE + "mrpc/minilm/cp-r128/seed0-6c28b6c2/"
    struck(P, "F1 0.819 at rank 128 where plain CP falls to 0.435 (the checkpoint fine-tuned at lr 2e-5 in "
              "`experiments/benchmarks/LOG.md`, section 2, with its commands)",
           f"{CORRECTED}: the lr 2e-5 checkpoint's results were never kept (the LOG says so); the sweep's jobs "
           "beside it")
    claim(P, "F1 {:.3f} at rank 128 where plain CP falls to {:.3f} (the MiniLM sweep's checkpoint, lr 1e-4:",
          stage(aware + "results.jsonl", "reparam", "f1"), stage(plain + "results.jsonl", "reparam", "f1"))


def fitting() -> None:
    """## Fitting the converted layers to what the original computes: SmolLM2's fitted runs (experiments/smollm2/
    fitted/, fitted_2048/, ten_minutes/; scripts/race_smollm2.py). The distillations' sentence is in smollm2.py."""
    half, quarter = F + "key-svd-k96-v96-calibrated16384", F + "key-svd-k48-v48-calibrated16384"
    h100, q100 = half + "-fitted100.json", quarter + "-fitted100.json"

    # What it costs
    claim(P, "100 steps per layer took {:.0f} s of processor time at half the cache and {:.0f} s at a quarter",
          field(h100, "fit.cpu_seconds"), field(q100, "fit.cpu_seconds"))
    struck(P, "2-4x", f"{CORRECTED}: fit.seconds over fit.cpu_seconds is 4.3x at both budgets")

    def wall_over_cpu(*runs):  # one ratio for both budgets: they must agree to the digit printed
        ratios = {round(r["fit"]["seconds"] / r["fit"]["cpu_seconds"], 1) for r in runs}
        if len(ratios) != 1:
            raise ValueError(f"the budgets' wall over processor times differ: {sorted(ratios)}")
        return [ratios.pop()]
    claim(P, "{:.1f}x that on the shared machine; **corrected 2026-12-06, issue 88**)",
          formula(wall_over_cpu, h100, q100))

    # When to use it
    def error_ratios(*runs):  # each layer's output error before the fit over after it, the least and the most
        ratios = [x["error_before"] / x["error_after"] for r in runs for x in r["fit"]["layers"]]
        return [min(ratios), max(ratios)]
    claim(P, "calibrated `key-svd` went from {:.2f}x / {:.2f}x the original's perplexity (wikipedia / Shakespeare) to "
             "{:.2f}x / {:.2f}x at half the cache and from {:.2f}x / {:.2f}x to {:.2f}x / {:.2f}x at a quarter, every "
             "layer's output error {:.1f}-{:.0f}x lower.", ppl(half + ".json"), ppl(h100), ppl(quarter + ".json"),
          ppl(q100), formula(error_ratios, h100, q100))
    residual = half + "-fitted100residual.json"
    claim(P, "The residual target gains another {:.0f}% on wikipedia ({:.2f}x) and ties on Shakespeare",
          formula(lambda r, o: [100 * (1 - _ratio(r, "wikipedia") / _ratio(o, "wikipedia"))], residual, h100),
          ppl(residual, "wikipedia"), verdict_is(residual, h100, "shakespeare", "tie"))
    h300, h600 = half + "-fitted300.json", half + "-fitted600.json"
    claim(P, "took `key-svd` at half the cache to {:.2f}x / {:.2f}x and {:.2f}x / {:.2f}x (per-layer error {:.3f} -> "
             "{:.3f} -> {:.3f}), at {:.0f}x and {:.0f}x the fit's cost", ppl(h300), ppl(h600),
          formula(lambda *runs: [mean_layer_error(r) for r in runs], h100, h300, h600),
          formula(lambda a, b, c: [r["fit"]["cpu_seconds"] / a["fit"]["cpu_seconds"] for r in (b, c)], h100, h300,
                  h600))
    struck(P, "and still not within 10 minutes on one core: with the calibration statistics (75 s) and the conversion "
              "(8 s), 10.4 minutes of processor time at half the cache",
           f"{CORRECTED}: the calibration statistics' and the conversion's processor times are in no run file; the "
           "fit's is")
    claim(P, "its fit {:.1f} minutes of processor time at half the cache", field(h100, "fit.cpu_seconds", scale=1 / 60))
    ten = T + "key-svd-k96-v96-calibrated16384-fitted100-e2e32on32768check4096.json"
    claim(P, "end-to-end fit: {:.0f} s of wall time for conversion, layer fit and end to end, {:.0f} s with the "
             "evaluation, one timing", formula(lambda r: [_fit_seconds(r)[-1], r["seconds"]], ten))

    # The output projection solved
    ls = half + "-fitted100-ls.json"
    claim(P, "**behind** the plain fit, {:.2f}x / {:.2f}x against {:.2f}x / {:.2f}x ({:+.1f}% [{:+.1f}%, {:+.1f}%] and "
             "{:+.1f}% [{:+.1f}%, {:+.1f}%] of perplexity over windows); Adam already leaves the projection near its "
             "optimum (the mean layer error {:.3f} against {:.3f})", ppl(ls), ppl(h100),
          boot(ls, h100, percent=True), boot(ls, h100, "shakespeare", percent=True),
          formula(lambda *runs: [mean_layer_error(r) for r in runs], ls, h100),
          verdict_is(ls, h100, "wikipedia", "behind"), verdict_is(ls, h100, "shakespeare", "behind"))

    # End to end, after the layer fit
    long_half, long_quarter = (x + "-fitted600-e2e64on65536.json" for x in (half, quarter))
    claim(P, "(SmolLM2: {:.1f}M parameters at half the cache, {:.0f}% of the model; {:.1f}M at a quarter, {:.0f}%)",
          *(formula(lambda r: [r["end_to_end"]["parameters"] / 1e6, 100 * r["end_to_end"]["parameters"] / SMOLLM2], x)
            for x in (long_half, long_quarter)))
    struck(P, "at 64 steps: about 1,000 of 1,800 s", f"{CORRECTED}: no run file splits the measurements from the "
                                                    "steps; the processor times of two runs stand beside it")
    checked_half = half + "-fitted600-e2e128on131072check16384.json"
    claim(P, "at half the cache, {:.0f} steps judged on all their {:,.0f} tokens took {:,.0f} s of processor time, "
             "{:.0f} steps judged on {:,.0f} of theirs {:,.0f} s",
          field(long_half, "end_to_end.steps", "end_to_end.tokens", "end_to_end.cpu_seconds"),
          field(checked_half, "end_to_end.steps", "end_to_end.check_tokens", "end_to_end.cpu_seconds"))
    claim(P, "(they would take {:.1f} GB for SmolLM2 at 16,384 tokens)",
          Value("SmolLM2's vocabulary x 16,384 tokens x 4 bytes", lambda: [4 * 16_384 * VOCABULARY / 1e9]))
    q32, h32 = quarter + "-fitted100-e2e32.json", half + "-fitted100-e2e32.json"
    def minutes(*runs):  # the end-to-end fit's processor time, in minutes, the mean of both budgets
        return [statistics.fmean(r["end_to_end"]["cpu_seconds"] for r in runs) / 60]
    claim(P, "(`key-svd`, 32 steps after the 100-step layer fit, about {:.0f} minutes of one core)",
          formula(minutes, h32, q32))
    claim(P, "(about {:.0f} minutes of one core for the 64 steps;", formula(minutes, long_half, long_quarter))
    claim(P, "ahead of the layer fit alone at both budgets, {:.2f}x -> {:.2f}x / {:.2f}x -> {:.2f}x the original's "
             "perplexity at a quarter of the cache and {:.2f}x -> {:.2f}x / {:.2f}x -> {:.2f}x at half, but at half "
             "still behind the 600-step layer fit ({:.2f}x / {:.2f}x)",
          *(ppl(x, d) for a, b in ((q100, q32), (h100, h32)) for d in ("wikipedia", "shakespeare") for x in (a, b)),
          ppl(h600))

    def e2e_tokens(r):  # steps, tokens, and the tokens beyond the 16,384 calibration tokens
        return [r["end_to_end"]["steps"], r["end_to_end"]["tokens"], r["end_to_end"]["tokens"] - 16_384]
    passes = quarter + "-fitted600-e2e64.json"
    claim(P, "fit, {:.0f} steps on the first {:,.0f} fitting tokens (`--e2e-tokens 65536`, one pass; {:,.0f} new, the "
             "first 16,384 the calibration tokens) take `key-svd` to {:.3f}x / {:.3f}x at half the cache and {:.3f}x / "
             "{:.3f}x at a quarter, ahead of {:.0f} steps over the {:,.0f} calibration tokens (four passes: {:.3f}x / "
             "{:.3f}x at a quarter) by the window bootstrap", formula(e2e_tokens, long_half), ppl(long_half),
          ppl(long_quarter), field(passes, "end_to_end.steps", "end_to_end.tokens"), ppl(passes),
          *(verdict_is(long_quarter, passes, d, "ahead") for d in ("wikipedia", "shakespeare")))
    s1_half, s1_quarter = (x + "s1-fitted600-e2e64on65536.json" for x in (half, quarter))
    long_half_2048, long_quarter_2048 = (L + x.removeprefix(F) for x in (long_half, long_quarter))
    claim(P, "A second calibration sample reproduces both ({:.3f}x / {:.3f}x and {:.3f}x / {:.3f}x, ties over the "
             "windows); on 2,048-token windows the same models are at {:.3f}x / {:.3f}x (half) and {:.3f}x / "
             "{:.3f}x (a quarter)", ppl(s1_half), ppl(s1_quarter), ppl(long_half_2048, length=2048),
          ppl(long_quarter_2048, length=2048),
          *(verdict_is(s1, x, d, "tie") for s1, x in ((s1_half, long_half), (s1_quarter, long_quarter))
            for d in ("wikipedia", "shakespeare")))
    checked_quarter = quarter + "-fitted600-e2e128on131072check16384.json"
    claim(P, "{:.0f} steps on the first {:,.0f} fitting tokens ({:,.0f} new), judged on the first {:,.0f} "
             "(`--e2e-check-tokens 16384`), take it to {:.3f}x / {:.3f}x and {:.3f}x / {:.3f}x (processor time of the "
             "end-to-end fit {:,.0f} s and {:,.0f} s, single timings; the 64 steps judged on all their tokens took "
             "{:,.0f} s and {:,.0f} s)", formula(e2e_tokens, checked_half),
          field(checked_half, "end_to_end.check_tokens"), ppl(checked_half), ppl(checked_quarter),
          *(field(x, "end_to_end.cpu_seconds") for x in (checked_half, checked_quarter, long_half, long_quarter)))
    windows = L + "key-svd-k96-v96-calibrated16384-fitted600-e2e32on65536check16384len2048.json"
    claim(P, "with the same 65,536 tokens it is ahead at 2,048 tokens ({:.3f}x against {:.3f}x on wikipedia) and ties "
             "at 256; twice the tokens in short windows does more ({:.3f}x).",
          ppl(windows, "wikipedia", length=2048), ppl(long_half_2048, "wikipedia", length=2048),
          ppl(L + checked_half.removeprefix(F), "wikipedia", length=2048),
          verdict_is(windows, long_half_2048, "wikipedia 2048", "ahead"),
          *(verdict_is(windows, long_half_2048, d, "tie") for d in ("wikipedia", "shakespeare")))

    # Where the distance left sits; how far the answers follow the original's
    best = "key-svd-{}-calibrated16384-fitted600-e2e128on131072check16384.json"
    sensitivity = [S + "fitted/sensitivity/" + best.format(k) for k in ("k96-v96", "k48-v48")]

    def costliest_share(*files):  # the largest share of a model's KL that restoring one layer sheds
        return [100 * max((d["loss"] - x["restored"]) / d["loss"] for f in files for d in f.values()
                          for x in d["layers"])]
    claim(P, "the KL left is spread over all 30 layers, none above {:.0f}% of it",
          formula(costliest_share, *sensitivity))
    answers = S + "fitted/answers/" + best.format("k96-v96")
    claim(P, "On SmolLM2's best half-cache model the answers agree on {:.0f}% of their positions",
          formula(lambda r: [100 * sum(x["agreed"] for x in r["prompts"]) / sum(x["tokens"] for x in r["prompts"])],
                  answers))
    cited(P, "lie within 0.5 nats", "the margin below which the LOG counts a miss as one where the original was "
                                    "nearly undecided (14 of 27: fitted/answers/), a threshold")

    # Within 10 minutes
    t150, held = (T + f"key-svd-k96-v96-calibrated16384-fitted150-e2e32on32768{x}4096.json" for x in ("check", "held"))
    claim(P, "every attention weight trained, {:.1f}M), judged on the first 4,096, took {:.0f} s of wall time for "
             "conversion and fits ({:.0f} + {:.0f} + {:.0f} s; {:.0f} s a second time, judged on held-out tokens: at "
             "the limit) and reach {:.3f}x / {:.3f}x the original's perplexity (KL {:.2f} / {:.2f}); with 100 layer "
             "steps {:.0f} s ({:.0f} s with the evaluation) and {:.3f}x / {:.3f}x (the 150-step run ahead on wikipedia "
             "by the window bootstrap, a tie on Shakespeare). The 100-step layer fit alone was {:.3f}x / {:.3f}x",
          field(t150, "end_to_end.parameters", scale=1e-6),
          formula(lambda r: [_fit_seconds(r)[-1], *_fit_seconds(r)[:-1]], t150),
          formula(lambda r: [_fit_seconds(r)[-1]], held), ppl(t150), field(t150, "domains.wikipedia.kl",
                                                                         "domains.shakespeare.kl"),
          formula(lambda r: [_fit_seconds(r)[-1], r["seconds"]], ten), ppl(ten), ppl(h100),
          verdict_is(t150, ten, "wikipedia", "ahead"), verdict_is(t150, ten, "shakespeare", "tie"))

    cited(P, "(`GENERAL_RECIPE`: 150 steps a layer, then every weight distilled 32 steps, on 128 windows of own "
             "samples; chosen\n  on validation over 32 attention-only end-to-end steps and over a layer fit on the "
             "first 64 windows alone", "scripts/reparametrize.py GENERAL_RECIPE, "
          "and experiments/transfer/README.md (claimed in transfer.py)")
    cited(P, "`collab.fit_steps=0` included", "the setting that turns the general recipe off")
    claim(P, "SmolLM2 at half its cache is at most\n  {:.3f}x the original's perplexity on every test domain",
          formula(lambda r: [max(m["perplexity"] / m["original_perplexity"] for m in r["domains"].values())],
                  "experiments/transfer/one_call/textfile/test.json"))
    cited(P, "more programming requests, top-p 0.9, temperature 0.7, 1.2, 1.5", "collab_attn.own_text.OWN_TEXTS, "
          "asserted in result_pages/transfer.py")
    cited(P, "4 windows a step, one pass, AdamW at 1e-4", "collab_attn.pretrained.distill's recipe (OWN_BATCH)")


def allocation() -> None:
    """## Where the cache goes: ``allocate_cache`` on SmolLM2 (experiments/smollm2/fitted/runs/key-svd-kalloc*)."""
    even_half, even_quarter = (F + f"key-svd-{k}-calibrated16384-fitted100.json" for k in ("k96-v96", "k48-v48"))
    half, quarter = (F + f"key-svd-kalloc{k}-calibrated16384-fitted100.json" for k in (192, 96))
    claim(P, "on SmolLM2 ({:.0f} steps, 8,192 tokens) {:.0f} minutes of wall time on the shared 2-core machine.",
          field(half, "allocation.steps"), field(half, "allocation.seconds", scale=1 / 60))

    def lower(r):  # the allocation's summed layer error must be below the even split's, as the page says
        if not r["allocation"]["error"] < r["allocation"]["uniform_error"]:
            raise ValueError("the allocation's summed layer error is not below the even split's")
        return []
    claim(P, "fitted the same way ({:.3f}x / {:.3f}x against {:.3f}x / {:.3f}x; the measured summed error {:.2f} "
             "against {:.2f} before the full fit, {:.3f} against {:.3f} mean after it)", ppl(half), ppl(even_half),
          field(half, "allocation.error", "allocation.uniform_error"),
          formula(lambda *runs: [mean_layer_error(r) for r in runs], half, even_half),
          *(verdict_is(half, even_half, d, "tie") for d in ("wikipedia", "shakespeare")))
    claim(P, "At a quarter it is behind the even split ({:.2f}x / {:.2f}x against {:.2f}x / {:.2f}x) although its "
             "summed layer error is lower", ppl(quarter), ppl(even_quarter), formula(lower, quarter),
          *(verdict_is(quarter, even_quarter, d, "behind") for d in ("wikipedia", "shakespeare")))


def loading() -> None:
    """## Loading without the collaborative class: no measured number left."""
    struck(P, "logits 0.3 apart on a small GPT-2", f"{CORRECTED}: no test or result file records that measurement")


def decoders() -> None:
    """## Decoders: GPT-2 small's cache and decoding times (experiments/benchmarks/, LOG.md sections 5 to 18)."""
    keys, kv = "collab D~=192", "cp k186 v186 (0.25)"  # keys only at d/4; keys and values shared at a quarter
    b1, b8 = B + "decode_cpu_float32_batch1.json", B + "decode_cpu_float32_batch8.json"
    claim(P, "At D~ = d/4 GPT-2 small caches {:.2f}x the bytes of the original",
          row(b1, "cache_vs_original", model=keys, context=8192, cache="dynamic"))
    claim(P, "it decoded in {:.2f}x the time at batch 8 and 8,192 tokens on the CPU in one run",
          row(b8, model=keys, context=8192, cache="dynamic"))

    def ms(cache):  # the original's time per token at batch 8 and 8,192 positions
        return row(b8, "ms_per_token", context=8192, cache=cache, model="original").numbers()[0]
    static_speed_up = Value(b8.removeprefix("experiments/"), lambda: [ms("dynamic") / ms("static")])
    claim(P, "({:.1f}x faster for the original too) it took {:.2f}x to {:.2f}x of the original's time before the "
             "keys-only step ran through the CPU kernels", static_speed_up,
          span(b8, [dict(context=n, cache="static", model=keys) for n in (1024, 4096, 8192)]))
    struck(P, "1.5x", f"{CORRECTED}: at D~ = d/4 the H100's batch-1 dynamic-cache steps took 1.5x to 1.6x")
    claim(P, "on an H100 at batch 1 with a dynamic cache it took ~~1.5x~~ {:.1f}x to {:.1f}x the time (**corrected",
          span(B + "decode_cuda_bfloat16.json", [dict(context=n, model=keys) for n in (512, 1024, 2048, 4096, 8192)]))
    fused, before = B + "decode_fused_kv_cpu_float32_batch8.json", B + "decode_fused_kv_cpu_float32_batch8_before.json"
    claim(P, "{:.2f}x the original's time per token with a static cache and `torch.compile` ({:.2f}x before), {:.2f}x "
             "with a dynamic cache ({:.2f}x before)",
          row(fused, verdict="faster", model=kv, cache="static"), row(before, model=kv, cache="static"),
          row(fused, verdict="faster", model=kv, cache="dynamic"), row(before, model=kv, cache="dynamic"))


def rotary() -> None:
    """## Rotary models: the calibrated rotary fits' test, and SmolLM2's absorbed MLA decoding (benchmarks, section
    17)."""
    struck(P, "within 1.2% where the weight fit misses by 65-80%",
           f"{CORRECTED}: figures of a test run (tests/test_rotary_calibration.py), kept in no result file")
    cited(P, "with less than a tenth of the weight fit's error, the test's bound",
          "tests/test_rotary_calibration.py::test_whitened_fits_lower_the_logit_error_on_inputs_like_the_calibrations "
          "asserts it")
    mla = "kv-svd k72 (0.25)"
    claim(P, "a SmolLM2 converted at a quarter of its cache decoded in {:.2f}x the original's time per token (batch 8, "
             "4,096 positions, dynamic cache, CPU: every step re-expanded the whole cached latent); now {:.2f}x",
          row(B + "decode_smollm2_cpu_float32_batch8_kvsvd_before.json", model=mla, cache="dynamic"),
          row(B + "decode_smollm2_cpu_float32_batch8.json", verdict="faster", model=mla, cache="dynamic"))


def _ratio(r: dict, domain: str) -> float:
    return r["domains"][domain]["perplexity"] / r["domains"][domain]["original_perplexity"]


def mean_layer_error(r: dict) -> float:
    """A layer fit's per-layer output error: the mean over the layers of the error of the weights each kept."""
    return statistics.fmean(x["error_after"] for x in r["fit"]["layers"])


def _fit_seconds(r: dict) -> list[float]:
    """Wall seconds of a run's conversion, layer fit and end-to-end fit, and their sum."""
    parts = [r["convert_seconds"], r["fit"]["seconds"], r["end_to_end"]["seconds"]]
    return [*parts, sum(parts)]


def claims_docs_converting() -> None:
    """docs/converting.md, strict on the whole page: each section's claims (the sections not named here quote no
    measured number)."""
    strict(P)
    options()
    fitting()
    allocation()
    loading()
    decoders()
    rotary()
