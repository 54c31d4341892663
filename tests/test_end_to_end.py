"""``collab_attn.fit_end_to_end``: all the converted attention layers at once trained so that the converted model's
output matches the original's (collab_attn/fitting/end_to_end.py). On the tiny GPT-2 and grouped-head Llama of
test_fitting, converted at half the cache after the layer-by-layer fit: the held-out KL falls, only the attention
layers move, the cache stays; an exact conversion stays exact; a base encoder is fitted on its hidden states with
padding left out; bad arguments are refused."""

import copy

import pytest
import torch
from conftest import random_batch, small_model
from test_fitting import HELD_OUT, converted, gpt2, ids, kl, llama

import collab_attn
from collab_attn.pretrained.race import mean_cache_numbers

pytestmark = pytest.mark.usefixtures("one_thread")
FIT = [{"input_ids": ids(seed)} for seed in range(16)]  # enough fitting tokens that the fit carries to HELD_OUT

CASES = [(gpt2, "key-svd", 12, {}), (gpt2, "cp", 20, {"value_rank": 20}), (llama, "kv-svd", 20, {"rope_pairs": 1}),
         (llama, "key-svd", 12, {"value_rank": 12})]


@pytest.mark.parametrize("make, method, rank, options", CASES,
                         ids=[f"{make.__name__}-{method}" for make, method, _, _ in CASES])
def test_the_end_to_end_fit_lowers_the_held_out_kl_after_the_layer_fit(make, method, rank, options):
    original, model = converted(make, method, rank, **options)
    collab_attn.fit_to_original(model, original, FIT, steps=20, progress=False)
    cache = mean_cache_numbers(model)
    before = kl(original, model)
    attention = {"attn", "self_attn"}
    others = {name: p.clone() for name, p in model.named_parameters() if not attention & set(name.split("."))}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    fit = collab_attn.fit_end_to_end(model, original, FIT, steps=40, learning_rate=3e-3, progress=False)
    after = kl(original, model)
    assert after < 0.95 * before, (before, after)
    assert fit.kept_fit and fit.loss_after == fit.fitted_loss < 0.9 * fit.loss_before and fit.loss == "kl"
    assert fit.tokens == 16 * 8 * 24 and len(fit.history) >= 20 and fit.history[-1][0] == 40
    assert fit.parameters == sum(p.numel() for name, p in model.named_parameters() if name not in others)
    for name, p in model.named_parameters():
        if name in others:
            torch.testing.assert_close(p, others[name], rtol=0, atol=0)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert mean_cache_numbers(model) == cache
    assert "| 40 steps, 3,072 tokens" in fit.table() and '"kept_fit": true' in fit.to_json()


@pytest.mark.parametrize("make, method, rank", [(gpt2, "kv-svd", 48), (llama, "key-svd", 24)],
                         ids=["gpt2-kv-svd", "llama-key-svd"])
def test_an_exact_conversion_stays_exact(make, method, rank):
    """At these sizes the conversions are exact: the fitting loss is at rounding level, the steps cannot lower it
    by much and the weights before are kept when they do not."""
    original, model = converted(make, method, rank)
    with torch.no_grad():
        expected = model(HELD_OUT).logits
    fit = collab_attn.fit_end_to_end(model, original, FIT[:4], steps=5, learning_rate=1e-2, progress=False)
    assert fit.loss_before < 1e-7 and fit.fitted_loss > fit.loss_before and not fit.kept_fit
    with torch.no_grad():
        torch.testing.assert_close(model(HELD_OUT).logits, expected, rtol=0, atol=0)


def test_checking_on_fewer_batches_measures_only_them_and_trains_the_same():
    """``check_batches`` moves the measurements that decide whether the fit is kept, not the steps: the same weights
    come out, and the losses before and after are those of the first batches only."""
    original, model = converted(llama, "key-svd", 12, value_rank=12)
    collab_attn.fit_to_original(model, original, FIT, steps=5, progress=False)
    checked = copy.deepcopy(model)
    start = copy.deepcopy(model)
    full = collab_attn.fit_end_to_end(model, original, FIT, steps=12, learning_rate=3e-3, progress=False)
    part = collab_attn.fit_end_to_end(checked, original, FIT, steps=12, learning_rate=3e-3, check_batches=3,
                                      progress=False)
    for ours, theirs in zip(checked.parameters(), model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert full.kept_fit and part.kept_fit and part.history == full.history
    assert (part.tokens, part.check_tokens, full.check_tokens) == (16 * 8 * 24, 3 * 8 * 24, 16 * 8 * 24)
    assert "| 12 steps, 3,072 tokens (judged on 576), " in part.table() and "judged" not in full.table()

    def mean_kl(model, batches):  # every batch holds the same number of tokens
        return sum(kl(original, model, b["input_ids"]) for b in batches) / len(batches)

    assert part.loss_before == pytest.approx(mean_kl(start, FIT[:3]), rel=1e-5)
    assert part.fitted_loss == pytest.approx(mean_kl(checked, FIT[:3]), rel=1e-5)
    assert full.loss_before == pytest.approx(mean_kl(start, FIT), rel=1e-5) != part.loss_before


def test_judging_on_held_out_batches_measures_only_them_and_trains_the_same():
    """``held_out``: the loss before and after, which decides whether the fit is kept, on batches the fit does not
    train on; the steps and the weights are those of the fit judged on its own tokens."""
    original, model = converted(llama, "key-svd", 12, value_rank=12)
    collab_attn.fit_to_original(model, original, FIT, steps=5, progress=False)
    judged, start = copy.deepcopy(model), copy.deepcopy(model)
    own = collab_attn.fit_end_to_end(model, original, FIT[:8], steps=12, learning_rate=3e-3, progress=False)
    held = collab_attn.fit_end_to_end(judged, original, FIT[:8], steps=12, learning_rate=3e-3, held_out=FIT[8:10],
                                      progress=False)
    for ours, theirs in zip(judged.parameters(), model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert held.held_out and not own.held_out and held.history == own.history
    assert (held.tokens, held.check_tokens) == (8 * 8 * 24, 2 * 8 * 24)
    assert "| 12 steps, 1,536 tokens (judged on 384 held out), " in held.table()

    def mean_kl(model, batches):
        return sum(kl(original, model, b["input_ids"]) for b in batches) / len(batches)

    assert held.loss_before == pytest.approx(mean_kl(start, FIT[8:10]), rel=1e-5)
    assert held.fitted_loss == pytest.approx(mean_kl(judged, FIT[8:10]), rel=1e-5) != own.fitted_loss
    with pytest.raises(ValueError, match="pass check_batches .* or held_out .*, not both"):
        collab_attn.fit_end_to_end(judged, original, FIT[:8], steps=2, check_batches=2, held_out=FIT[8:10])
    with pytest.raises(ValueError, match="held_out: no fitting tokens"):
        collab_attn.fit_end_to_end(judged, original, FIT[:8], steps=2, held_out=[])


def test_early_stopping_keeps_the_weights_of_the_lowest_held_out_loss():
    """``check_every``: the held-out loss every few steps too; fitted to one batch, the held-out loss is lowest after
    the first steps and rises after them, and the weights of that step are kept, not the last ones. The steps are
    the same as without the checks."""
    original, model = converted(llama, "key-svd", 12, value_rank=12)
    collab_attn.fit_to_original(model, original, FIT, steps=5, progress=False)
    last = copy.deepcopy(model)
    plain = collab_attn.fit_end_to_end(last, original, FIT[:1], steps=24, learning_rate=1e-3, held_out=FIT[8:10],
                                       progress=False)
    fit = collab_attn.fit_end_to_end(model, original, FIT[:1], steps=24, learning_rate=1e-3, held_out=FIT[8:10],
                                     check_every=3, progress=False)
    assert fit.history == plain.history and [step for step, _ in fit.checks] == list(range(3, 25, 3))
    assert fit.checks[-1][1] == pytest.approx(plain.fitted_loss, rel=1e-6)
    lowest = min(fit.checks, key=lambda check: check[1])
    assert fit.best_step == lowest[0] < 24 and fit.fitted_loss == lowest[1] < fit.checks[-1][1]
    assert fit.kept_fit and fit.loss_after == fit.fitted_loss < fit.loss_before
    held_kl = sum(kl(original, model, b["input_ids"]) for b in FIT[8:10]) / 2
    assert held_kl == pytest.approx(fit.fitted_loss, rel=1e-5)
    assert f"| {fit.fitted_loss:.4f} (step {fit.best_step}) |" in fit.table()
    for every in (0, 24, 2.0):
        with pytest.raises(ValueError, match="check_every must be a number of steps from 1 to steps - 1 = 23"):
            collab_attn.fit_end_to_end(model, original, FIT[:1], steps=24, check_every=every)


def test_the_anchor_holds_the_weights_near_where_the_fit_starts():
    """``anchor``: the relative squared distance from the starting weights in each step's loss. The weights move less
    the larger it is (and exactly as without it at 0); the recorded losses stay the divergence alone."""
    original, model = converted(llama, "key-svd", 12, value_rank=12)
    collab_attn.fit_to_original(model, original, FIT, steps=5, progress=False)
    start = [p.detach().clone() for p in model.parameters()]

    def drift(anchor):
        fitted = copy.deepcopy(model)
        fit = collab_attn.fit_end_to_end(fitted, original, FIT[:8], steps=12, learning_rate=3e-3, anchor=anchor,
                                         progress=False)
        moved = sum(float((p - w).square().sum().detach()) for p, w in zip(fitted.parameters(), start))
        return fit, moved / sum(float(w.square().sum()) for w in start)

    (free, free_drift), (zero, zero_drift) = drift(0.0), drift(0)
    (held, held_drift), (_, tight_drift) = drift(1e3), drift(1e5)
    assert zero.history == free.history and zero_drift == free_drift and free.anchor == 0.0 == zero.anchor
    assert 0 < tight_drift < held_drift < free_drift and held.anchor == 1e3
    assert held.history[0] == free.history[0]  # the first step's loss: no drift yet, the divergence alone
    assert held.loss_before == free.loss_before and free.fitted_loss < held.fitted_loss
    assert '"anchor": 1000.0' in held.to_json()
    for anchor in (-1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="anchor must be a number >= 0"):
            collab_attn.fit_end_to_end(model, original, FIT[:1], steps=2, anchor=anchor)


def test_a_base_encoder_is_fitted_on_its_hidden_states_without_the_padding():
    """BERT without a head has no logits: the relative squared error of its last hidden states, over the
    non-padding tokens (the padding positions may do anything)."""
    original = small_model("bert", initializer_range=0.2)
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, 12, method="cp", value_rank=12, progress=False)
    batches = [random_batch(lengths=ls, seed=s) for s, ls in enumerate([(11, 7, 3), (9, 9, 5), (4, 10, 8)] * 3)]
    fit = collab_attn.fit_end_to_end(model, original, batches, steps=30, learning_rate=3e-3, progress=False)
    assert fit.loss == "relative squared error" and fit.tokens == 3 * (21 + 23 + 22)
    assert fit.kept_fit and fit.loss_after < 0.8 * fit.loss_before
    held_out = random_batch(lengths=(12, 6), seed=50)
    with torch.no_grad():
        ours, theirs = (m(**held_out).last_hidden_state for m in (model, original))
    mask = held_out["attention_mask"].bool()
    error = (ours - theirs)[mask].square().sum() / theirs[mask].square().sum()
    assert error < 0.9 * fit.loss_before


def test_bad_arguments_say_what_to_pass():
    original, model = converted(gpt2, "kv-svd", 24)
    kept = {key: value.clone() for key, value in model.state_dict().items()}
    fit = collab_attn.fit_end_to_end
    for steps in (0, -2, 1.5, None):
        with pytest.raises(ValueError, match="steps must be a positive number"):
            fit(model, original, FIT, steps=steps)
    with pytest.raises(ValueError, match="learning_rate must be a positive number"):
        fit(model, original, FIT, steps=3, learning_rate=float("nan"))
    with pytest.raises(ValueError, match="no fitting tokens"):
        fit(model, original, [], steps=3)
    for check in (0, 2.5):
        with pytest.raises(ValueError, match="check_batches must be a positive number of batches"):
            fit(model, original, FIT, steps=3, check_batches=check)
    with pytest.raises(ValueError, match="check_batches=17 is more than the 16 batches given: pass at most 16"):
        fit(model, original, FIT, steps=3, check_batches=17)
    with pytest.raises(ValueError, match="original must be the model before the conversion"):
        fit(model, model, FIT, steps=3)
    with pytest.raises(ValueError, match="original is a llama model but converted was made from a gpt2 model"):
        fit(model, llama(), FIT, steps=3)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, kept[key], rtol=0, atol=0)
