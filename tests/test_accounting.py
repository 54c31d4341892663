"""Parameter and FLOP accounting (collab_attn.analysis.accounting, scripts/accounting.py) against hand counts."""

import importlib.util
from pathlib import Path

import pytest
from conftest import small_model
from transformers import AutoModel

from collab_attn import CollaborativeAttention, MultiHeadAttention, reparametrize
from collab_attn.analysis.accounting import (
    attention_flops_per_token,
    attention_parameters,
    cache_bytes_per_token,
    default_ranks,
    table,
)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accounting.py"
_spec = importlib.util.spec_from_file_location("accounting_script", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def test_bert_base_by_hand():
    counts = attention_parameters(768, 12)
    assert counts["total"] == 2_362_368 == 4 * (768 * 768 + 768)
    assert counts["query"] == counts["key"] == counts["value"] == counts["output"] == 590_592
    collab = attention_parameters(768, 12, rank=384)
    assert collab == {
        "query": 768 * 384, "key": 768 * 384, "value": 590_592, "output": 590_592, "mixing": 12 * 384,
        "content_bias": 12 * 768, "total": 2 * 768 * 384 + 2 * 590_592 + 12 * 384 + 12 * 768,
    }
    tucker = attention_parameters(768, 12, rank=96, method="tucker", tucker_core_size=6)
    assert tucker["mixing"] == 12 * 6 and tucker["mixing_core"] == 6 * 96 * 96


def test_concatenated_count_does_not_depend_on_heads():
    totals = {attention_parameters(768, heads)["total"] for heads in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}
    assert totals == {2_362_368}
    assert {attention_parameters(384, heads, bias=False)["total"] for heads in (1, 6, 12)} == {4 * 384 * 384}


def test_collaboration_saves_more_as_the_rank_falls():
    totals = [attention_parameters(768, 12, rank)["total"] for rank in default_ranks(768, 12)]
    assert totals == sorted(totals, reverse=True)
    assert totals[0] > attention_parameters(768, 12)["total"] > totals[1]  # full rank costs the mixing/content bias


@pytest.mark.parametrize(
    "d_model, heads, rank, kwargs",
    [
        (768, 12, None, {}),
        (384, 12, None, {"bias": False}),
        (64, 4, None, {"head_dim": 24, "output_projection": False}),
        (768, 12, 384, {}),
        (384, 12, 128, {}),
        (48, 4, 12, {"bias": False, "output_projection": False}),
        (64, 8, 40, {"head_dim": 4}),
        (96, 6, 24, {"method": "tucker", "tucker_core_size": 3}),
        (96, 6, 24, {"method": "tucker"}),
    ],
)
def test_matches_the_modules(d_model, heads, rank, kwargs):
    kwargs = dict(kwargs)
    if rank is None:
        module = MultiHeadAttention(d_model, heads, **kwargs)
    else:
        method = kwargs.pop("method", "cp")
        core = kwargs.pop("tucker_core_size", heads if method == "tucker" else None)
        module = CollaborativeAttention(d_model, heads, rank, mixing_init="ones", tucker_core_size=core, **kwargs)
        kwargs.update(method=method, tucker_core_size=core)
    assert attention_parameters(d_model, heads, rank, **kwargs) == module.parameter_counts()


@pytest.mark.parametrize(
    "family, rank, method, kwargs",
    [
        ("minilm", 384, "cp", {}),
        ("bert", 8, "cp", {"n_iter_max": 3}),
        ("bert", 8, "tucker", {"n_iter_max": 3, "tucker_core_size": 2}),
        ("distilbert", 12, "cp", {"n_iter_max": 3}),
    ],
)
def test_matches_a_real_reparametrization(minilm_path, family, rank, method, kwargs):
    """BERT keeps its output projection in BertSelfOutput, so its converted module has none; DistilBERT's has one."""
    model = AutoModel.from_pretrained(minilm_path) if family == "minilm" else small_model(family)
    report = reparametrize(model, rank, method, progress=False, **kwargs)
    d_model, heads = (384, 12) if family == "minilm" else (48, 4)
    sizes = {"output_projection": family == "distilbert"}
    before = attention_parameters(d_model, heads, **sizes)
    after = attention_parameters(d_model, heads, rank, method=method, tucker_core_size=kwargs.get("tucker_core_size"),
                                 **sizes)
    if family == "minilm":
        assert before["total"] == 3 * (384 * 384 + 384)
    for layer in report.layers:
        assert layer.params_before == before["total"]
        assert layer.params_after == after["total"]
        assert layer.query_key_params_before == before["query"] + before["key"]
        assert layer.query_key_params_after == after["total"] - after["value"] - after.get("output", 0)


def test_flops_by_hand():
    n, d, heads = 128, 768, 12
    concat = attention_flops_per_token(d, heads, n)
    assert concat == {
        "projections": 3 * 2 * d * d, "mixing": 0, "scores": 2 * n * d, "weighted_sum": 2 * n * d,
        "output": 2 * d * d, "total": 8 * d * d + 4 * n * d,
    }
    collab = attention_flops_per_token(d, heads, n, rank=64)
    assert collab["projections"] == 2 * 2 * d * 64 + 2 * d * d + 2 * d * heads
    assert collab["mixing"] == heads * 64
    assert collab["scores"] == 2 * heads * n * 64 == concat["scores"]  # rank = head_dim: same score cost
    assert attention_flops_per_token(d, heads, n, rank=64, method="tucker")["mixing"] == 2 * heads * 64 * 64
    assert attention_flops_per_token(d, heads, n, rank=768)["scores"] == heads * concat["scores"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: attention_parameters(100, 12), "not a multiple"),
        (lambda: attention_parameters(768, 0), "positive"),
        (lambda: attention_parameters(768, 12, rank=0), "rank"),
        (lambda: attention_parameters(768, 12, rank=64, method="svd"), "unknown method"),
        (lambda: attention_flops_per_token(768, 12, 0), "seq_len"),
    ],
)
def test_bad_sizes(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_table_markdown():
    text = table(384, 12, num_layers=6)
    assert text.startswith("### d_model=384, 12 heads of 32, 6 layers")
    assert "| concatenated | 147,840 | 147,840 | 147,840 | 147,840 | 0 | 0 | 591,360 | 100.0% | 3,548,160 |" in text
    assert text.count("| cp, D~=384 |") == 3 and "| cp, D~=32 |" in text  # parameters, FLOPs and cache bytes
    # cache per token and layer in 2-byte numbers: keys + values 2 x 384 before; at D~=96: 96 + 12 heads + 384
    assert "| concatenated | 768 | 768 | 1,536 | 100.0% | 9,216 |" in text
    assert "| cp, D~=96 | 216 | 768 | 984 | 64.1% | 5,904 |" in text
    assert text.count("| 591,360 |") >= 6  # one row per head count in the heads table


def _cli(capsys, *args):
    code = 0
    try:
        script.main(list(args))
    except SystemExit as stop:
        code = stop.code
    return code, *capsys.readouterr()


def test_cli(tmp_path, capsys):
    code, out, err = _cli(capsys, "--preset", "bert-base", "--output", str(tmp_path / "t.md"))
    assert code == 0, err
    assert "2,362,368" in out and (tmp_path / "t.md").read_text().strip() == out.strip()
    code, out, err = _cli(capsys, "--d-model", "512", "--heads", "8", "--ranks", "256", "64", "--seq-len", "32")
    assert code == 0, err
    assert "| cp, D~=256 |" in out and "| cp, D~=64 |" in out and "D~=128 |" not in out
    for args in (["--d-model", "100", "--heads", "12"], ["--d-model", "384"], ["--ranks", "0"], ["--seq-len", "x"]):
        code, out, err = _cli(capsys, *args)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and not out, args


def test_shared_value_flops_by_hand():
    """d 48, 4 heads, 10 tokens, D~ 20, D_v 16: the value projection narrows, every head sums the one shared value,
    the value mixing and the heads' sum cost 2 heads D_v, the output reads D_v."""
    flops = attention_flops_per_token(48, 4, 10, 20, value_rank=16)
    assert flops == {
        "projections": 2 * 2 * 48 * 20 + 2 * 48 * 16 + 2 * 48 * 4, "mixing": 4 * 20 + 2 * 4 * 16,
        "scores": 2 * 4 * 10 * 20, "weighted_sum": 2 * 4 * 10 * 16, "output": 2 * 16 * 48,
        "total": sum([2 * 2 * 48 * 20 + 2 * 48 * 16 + 2 * 48 * 4, 4 * 20 + 2 * 4 * 16, 2 * 4 * 10 * 20,
                      2 * 4 * 10 * 16, 2 * 16 * 48]),
    }
    with pytest.raises(ValueError, match="value_rank .* needs collaborative heads"):
        attention_flops_per_token(48, 4, 10, value_rank=16)
    tucker = attention_flops_per_token(48, 4, 10, 20, value_rank=16, method="tucker")
    # Tucker: each head's query times M_h (2 heads D~^2), each head's sum times N_h into the total (2 heads D_v^2)
    assert tucker["mixing"] == 2 * 4 * 20 * 20 + 2 * 4 * 16 * 16
    assert tucker["total"] - tucker["mixing"] == flops["total"] - flops["mixing"]


def test_cli_shares_values_in_every_table(capsys):
    code, out, err = _cli(capsys, "--d-model", "48", "--heads", "4", "--ranks", "20", "--value-rank", "16")
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| cp, D~=20, D_v=16 |")]
    assert len(rows) == 3  # parameters, FLOPs, cache
    assert f"| {attention_parameters(48, 4, 20, value_rank=16)['total']:,} |" in rows[0]
    assert f"| {attention_flops_per_token(48, 4, 128, 20, value_rank=16)['total']:,} |" in rows[1]
    assert f"| {cache_bytes_per_token(48, 4, 20, value_rank=16)['total']:,} |" in rows[2]
    code, out, err = _cli(capsys, "--d-model", "48", "--heads", "4", "--ranks", "20", "--method", "tucker",
                          "--value-rank", "16")
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| tucker, D~=20, D_v=16 |")]
    counts = attention_parameters(48, 4, 20, value_rank=16, method="tucker")
    assert len(rows) == 3 and f"| {counts['total']:,} |" in rows[0]
    assert f"| {cache_bytes_per_token(48, 4, 20, value_rank=16)['total']:,} |" in rows[2]  # CP's cache
