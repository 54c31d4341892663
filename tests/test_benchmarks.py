"""The benchmark scripts still run: a tiny case of each that the README's latency claims rest on. Each test reads
the rows the script returns, the table it writes and the lines it prints: the rows are the ones asked for, and every
ratio shown is the ratio of the timings (or sizes) it was computed from, recomputed here."""

import argparse
import importlib.util
import json
import re
import statistics
import time
from pathlib import Path

import pytest
import torch
import transformers

from collab_attn.analysis.accounting import attention_flops_per_token
from collab_attn.nn import cpu_kernels
from collab_attn.stats import timing_verdict

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows (lists of cells) of the one Markdown table in ``text``."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header, separator, *rows = ([cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines)
    assert all(cell and set(cell) <= set("-:") for cell in separator)
    assert all(len(row) == len(header) for row in rows)
    return header, rows


def shows(printed: str, value: float) -> bool:
    """Whether ``printed`` (a number as the scripts print it: thousands commas and a trailing ``x`` allowed) is
    ``value`` rounded to the decimals it shows."""
    number = printed.strip().removesuffix("x").replace(",", "")
    decimals = len(number.partition(".")[2])
    return abs(float(number) - value) <= 0.5 * 10**-decimals + 1e-9 * abs(value)


def shows_range(low: str, high: str, runs: list[float], scale: float = 1.0) -> bool:
    """Whether ``low`` and ``high`` (printed numbers) are the extremes of ``runs`` times ``scale``."""
    return shows(low, scale * min(runs)) and shows(high, scale * max(runs))


def reference_verdict(name: str, reference: str, runs: list[float], reference_runs: list[float]) -> str:
    """The verdict a benchmark must show for ``runs`` against the reference's: ``-`` for the reference itself."""
    return "-" if name == reference else timing_verdict(runs, reference_runs).verdict


def scripted(times: dict[str, list[float]]):
    """A stand-in for a benchmark's ``measure``: these times (seconds per variant), whatever it is asked."""
    return lambda *args, **kwargs: {name: list(runs) for name, runs in times.items()}


# Three repeats per variant whose ranges fall below, above, across and against the reference's (10-12 ms): the
# verdicts faster, slower, tie (overlap) and tie (touching ranges overlap).
SCRIPTED = {"reference": [0.010, 0.011, 0.012], "faster": [0.005, 0.006, 0.007], "slower": [0.020, 0.030, 0.025],
            "across": [0.009, 0.011, 0.013], "touching": [0.012, 0.020, 0.030]}
SCRIPTED_VERDICTS = {"reference": "-", "faster": "faster", "slower": "slower", "across": "tie", "touching": "tie"}


E2E_CELL = r"([\d.]+) \[([\d.]+)-([\d.]+)\]"  # the median [range] of a model, milliseconds
E2E_VERSUS = E2E_CELL + r" \(([\d.]+x), ([\w-]+), ([\d.]+x)\)"  # ... (time ratio, verdict, FLOPs ratio)


def assert_end_to_end_reports(result: dict, text: str, printed: str, names: list[str]) -> None:
    """Each record's medians, ranges, ratios and verdicts are those of the times it keeps, and the table written and
    printed shows them: the median and range of each model, the ratio to the original with ``timing_verdict``'s
    verdict and the FLOPs ratio."""
    records = result["records"]
    for record in records:
        assert list(record["times"]) == list(record["median"]) == list(record["range"]) == list(record["verdict"])
        assert list(record["times"]) == names
        for name, runs in record["times"].items():
            assert record["median"][name] == statistics.median(runs)
            assert record["range"][name] == [min(runs), max(runs)]
            assert record["time_vs_original"][name] == pytest.approx(record["median"][name]
                                                                     / record["median"]["original"])
            assert record["verdict"][name] == reference_verdict(name, "original", runs, record["times"]["original"])
    header, rows = markdown_table(text)
    assert header == ["mode", "batch", "seq", "original ms [range]",
                      *(f"{name} ms [range] (time, verdict, FLOPs)" for name in names[1:])]
    assert [row[:3] for row in rows] == [[r["mode"], str(r["batch"]), str(r["seq"])] for r in records]
    for row, record in zip(rows, records, strict=True):
        times, median, flops = record["times"], record["median"], record["flops_per_token"]
        ms, low, high = re.fullmatch(E2E_CELL, row[3]).groups()
        assert shows(ms, 1e3 * median["original"]) and shows_range(low, high, times["original"], 1e3)
        for cell, name in zip(row[4:], names[1:], strict=True):
            ms, low, high, time_ratio, verdict, flops_ratio = re.fullmatch(E2E_VERSUS, cell).groups()
            assert shows(ms, 1e3 * median[name]) and shows_range(low, high, times[name], 1e3)
            assert shows(time_ratio, median[name] / median["original"]) and verdict == record["verdict"][name]
            assert shows(flops_ratio, flops[name] / flops["original"])
    table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    assert printed.endswith(table + "\n")  # the table printed is the one written
    for line in table.splitlines()[2:]:
        assert f"\n{line} (load " in printed  # and each row as it was measured


@pytest.mark.parametrize("padded", [False, True])
def test_end_to_end_times_the_original_and_a_conversion(tmp_path, padded, capsys):
    """MiniLM and its rank-64 conversion, blocked and in one piece, on one case in both modes, three repeats: a record
    and a table row per mode, medians and ranges of the recorded times, the FLOPs of 6 layers (d_model 384, 12 heads,
    feed-forward 1536) and, in each cell, the time ratio to the original's with its verdict, and the FLOPs ratio."""
    end_to_end = load("end_to_end")
    argv = ["--threads", "1", "--ranks", "64", "--cases", "2x48", "--modes", "infer", "train", "--repeats", "3",
            "--warmup", "0", "--one-piece", "--out", str(tmp_path / "e2e")] + (["--padded"] if padded else [])
    result = end_to_end.main(argv)
    assert result["max_abs_difference_to_explicit_path"] < 1e-4  # the blocked path against all logits at once
    records = result["records"]
    assert [(r["mode"], r["batch"], r["seq"]) for r in records] == [("infer", 2, 48), ("train", 2, 48)]
    names = ["original", "collab-64", "collab-64 (one piece)"]
    layer_flops = {rank: attention_flops_per_token(384, 12, 48, rank)["total"] + 4 * 384 * 1536 for rank in (None, 64)}
    for record in records:
        for times in record["times"].values():
            assert len(times) == 3 and all(t > 0 for t in times)
        assert record["flops_per_token"] == {"original": 6 * layer_flops[None], "collab-64": 6 * layer_flops[64],
                                             "collab-64 (one piece)": 6 * layer_flops[64]}
    assert json.loads((tmp_path / "e2e.json").read_text())["padded"] is padded
    text = (tmp_path / "e2e.md").read_text()
    assert ("padded to three quarters" in text) is padded
    assert "timing_verdict" in text  # the table says by which rule
    assert_end_to_end_reports(result, text, capsys.readouterr().out, names)


def test_end_to_end_calls_faster_or_slower_only_outside_the_spread(tmp_path, capsys, monkeypatch):
    """Scripted times (the models still load and are checked): a conversion is faster or slower than the original
    only where its range and the original's do not overlap."""
    end_to_end = load("end_to_end")
    names = ["original", "collab-64", "collab-32", "collab-64 (one piece)", "collab-32 (one piece)"]
    monkeypatch.setattr(end_to_end, "measure", scripted(dict(zip(names, SCRIPTED.values()))))
    result = end_to_end.main(["--threads", "1", "--ranks", "64", "32", "--cases", "2x48", "--modes", "infer",
                              "--repeats", "3", "--one-piece", "--out", str(tmp_path / "e2e")])
    (record,) = result["records"]
    assert list(record["verdict"].values()) == list(SCRIPTED_VERDICTS.values())
    text = (tmp_path / "e2e.md").read_text()
    assert_end_to_end_reports(result, text, capsys.readouterr().out, names)
    (row,) = markdown_table(text)[1]
    assert row[3] == "11.0 [10.0-12.0]"
    assert [cell.rpartition(", ")[0] for cell in row[4:]] == [
        "6.0 [5.0-7.0] (0.55x, faster", "25.0 [20.0-30.0] (2.27x, slower", "11.0 [9.0-13.0] (1.00x, tie",
        "20.0 [12.0-30.0] (1.82x, tie"]  # then each one's FLOPs ratio


def test_attention_latency_compares_every_variant(tmp_path, capsys):
    """Batch 2, 600 positions: more logits than one CPU block, so ``collab`` times the blocked path beside the
    paper's formulation; the script's own check finds the variants computing alike. Three repeats: each cell shows
    the median, the range and, beside ``concat``, the ratio and its verdict."""
    attention_latency = load("attention_latency")
    argv = ["--d-model", "48", "--heads", "4", "--ranks", "16", "--batch", "2", "--seq", "600", "--modes", "infer",
            "--threads", "1", "--repeats", "3", "--warmup", "0", "--out", str(tmp_path / "lat")]
    result = attention_latency.main(argv)
    assert result["variants_vs_ours_max_abs_diff"] < 1e-4
    (record,) = result["results"]
    assert (record["mode"], record["batch"], record["seq"]) == ("infer", 2, 600)
    assert all(len(runs) == 3 for runs in record["seconds"].values())
    assert_attention_latency_reports(result, (tmp_path / "lat.md").read_text(), capsys.readouterr().out,
                                     ["concat", "collab-16", "paper-16"])


def assert_attention_latency_reports(result: dict, text: str, printed: str, names: list[str]) -> None:
    """Each record's medians, ranges, ratios to ``concat`` and verdicts are those of the seconds it keeps, and the
    table written and printed shows them."""
    header, rows = markdown_table(text)
    assert markdown_table(result["table"]) == (header, rows)
    assert header == ["mode", "batch", "seq", "concat ms [range]",
                      *(f"{name} ms [range] (vs concat, verdict)" for name in names[1:])]
    assert "timing_verdict" in text  # the table says by which rule
    for record, (mode, batch, seq, *cells) in zip(result["results"], rows, strict=True):
        assert [mode, batch, seq] == [record["mode"], str(record["batch"]), str(record["seq"])]
        seconds, median = record["seconds"], record["median_seconds"]
        assert list(seconds) == list(median) == list(record["range_seconds"]) == list(record["verdict"]) == names
        for name, cell in zip(names, cells, strict=True):
            runs = seconds[name]
            assert median[name] == statistics.median(runs) and record["range_seconds"][name] == [min(runs), max(runs)]
            assert record["ratio_to_concat"][name] == pytest.approx(median[name] / median["concat"])
            verdict = reference_verdict(name, "concat", runs, seconds["concat"])
            assert record["verdict"][name] == verdict
            ms, low, high, ratio, shown = re.fullmatch(
                r"([\d.]+) ms \[([\d.]+)-([\d.]+)\](?: \(([\d.]+x), ([\w-]+)\))?", cell).groups()
            assert shows(ms, 1e3 * median[name]) and shows_range(low, high, runs, 1e3)
            assert (ratio is None) is (shown is None) is (name == "concat")  # concat is the reference
            assert name == "concat" or (shows(ratio, median[name] / median["concat"]) and shown == verdict)
    for line in text.splitlines()[-len(rows):]:
        assert f"\n{line} (load " in printed  # the rows printed are the ones written


def test_attention_latency_calls_faster_or_slower_only_outside_the_spread(tmp_path, capsys, monkeypatch):
    """Scripted times: a variant is faster or slower than ``concat`` only where its range and concat's do not
    overlap; the cells show whole milliseconds (concat's median is 10 ms or more)."""
    attention_latency = load("attention_latency")
    names = ["concat", "collab-8", "paper-8", "collab-16", "paper-16"]
    monkeypatch.setattr(attention_latency, "measure", scripted(dict(zip(names, SCRIPTED.values()))))
    result = attention_latency.main(["--d-model", "48", "--heads", "4", "--ranks", "8", "16", "--batch", "2", "--seq",
                                     "8", "--modes", "infer", "--repeats", "3", "--out", str(tmp_path / "lat")])
    (record,) = result["results"]
    assert list(record["verdict"].values()) == list(SCRIPTED_VERDICTS.values())
    text = (tmp_path / "lat.md").read_text()
    assert_attention_latency_reports(result, text, capsys.readouterr().out, names)
    assert text.endswith("| infer | 2 | 8 | 11 ms [10-12] | 6 ms [5-7] (0.55x, faster) | 25 ms [20-30] (2.27x, "
                         "slower) | 11 ms [9-13] (1.00x, tie) | 20 ms [12-30] (1.82x, tie) |\n")


DECODE_COLUMNS = ["batch", "context", "cache", "model", "ms / step", "range", "ms / token", "tokens / s", "vs original",
                  "verdict", "cache MiB", "vs original", "max batch"]
PREFILL_COLUMNS = ["batch", "context", "model", "prefill ms", "range", "vs original", "verdict"]


def assert_decode_reports(rows: list[dict], markdown: str, printed: str, prefill: bool, extra: tuple = ()) -> None:
    """``decode.py``'s rows, its table and its printed lines show the same numbers, and each ratio is the row's
    time (and cache) over the original model's with the same batch, context and cache; the time is the median of the
    runs the JSON keeps, the range their extremes, the verdict ``timing_verdict``'s (``extra``: the columns that
    follow)."""
    time_key = "prefill_ms" if prefill else "ms_per_step"
    header, table = markdown_table(markdown)
    assert header == (PREFILL_COLUMNS if prefill else DECODE_COLUMNS) + list(extra)
    lines = [line for line in printed.splitlines() if line.startswith("batch ")]
    assert len(table) == len(lines) == len(rows)
    for row, cells, line in zip(rows, table, lines):
        (base,) = [r for r in rows if r["model"] == "original"
                   and all(r.get(k) == row.get(k) for k in ("batch", "context", "cache"))]
        runs = row[f"{time_key}_runs"]
        assert row[time_key] == statistics.median(runs)
        assert (row[f"{time_key}_low"], row[f"{time_key}_high"]) == (min(runs), max(runs))
        time_ratio = row[time_key] / base[time_key]
        assert row["time_vs_original"] == pytest.approx(time_ratio)
        verdict = "-" if row is base else timing_verdict(runs, base[f"{time_key}_runs"]).verdict
        assert row["verdict"] == verdict
        low, high = cells[4 if prefill else 5].split("-")
        assert shows(low, row[f"{time_key}_low"]) and shows(high, row[f"{time_key}_high"])
        assert re.match(rf"batch +{row['batch']} context +{row['context']} .*{re.escape(row['model'])} ", line)
        (timed,) = re.findall(r"\(([\d.]+x), ([\w-]+)\)", line)  # the time ratio and its verdict
        assert shows(timed[0], time_ratio) and timed[1] == verdict
        ratios = re.findall(r"\(([\d.]+x)\)", line)  # the cache's ratio
        if prefill:
            assert cells[:3] == [str(row["batch"]), str(row["context"]), row["model"]]
            assert shows(cells[3], row["prefill_ms"]) and shows(cells[5], time_ratio) and cells[6] == verdict
            assert shows(re.search(r"([\d.]+) ms prefill", line)[1], row["prefill_ms"])
            assert not ratios
            continue
        cache_ratio = row["cache_mib"] / base["cache_mib"]
        assert row["cache_vs_original"] == pytest.approx(cache_ratio)
        assert cells[:4] == [str(row["batch"]), str(row["context"]), row["cache"], row["model"]]
        shown = [row["ms_per_step"], row["ms_per_token"], row["tokens_per_s"], time_ratio, row["cache_mib"],
                 cache_ratio]
        assert all(shows(cell, value) for cell, value in zip(cells[4:5] + cells[6:9] + cells[10:12], shown,
                                                             strict=True))
        assert cells[9] == verdict
        assert cells[12] == str(row["max_batch"]) and f"max batch {row['max_batch']}" in line
        ms_per_token, cache = re.search(r"([\d.]+) ms/token .* cache +([\d.]+) MiB", line).groups()
        assert shows(ms_per_token, row["ms_per_token"]) and shows(cache, row["cache_mib"])
        assert len(ratios) == 1 and shows(ratios[0], cache_ratio)


# The decoding benchmark's tiny model (``--size tiny``): 2 layers, d_model 192, 12 heads of 16 (GPT-2 small's
# 12 layers of 768 take minutes to build, size and compile on two cores; the script's arithmetic is the same). Its
# cache per token and layer: 2 x 192 numbers concatenated, D~ + 12 + 192 with collaborative keys at D~ = 24 (d/8).
TINY = ["--size", "tiny", "--threads", "1", "--ranks", "24"]
COLLAB_CACHE = (24 + 12 + 192) / (2 * 192)


@pytest.mark.parametrize("prefill", [False, True])
def test_decode_times_the_original_and_a_collaborative_gpt2(tmp_path, prefill, capsys):
    """A tiny GPT-2 against collaborative heads at D~ = 24 (d/8): one decoding step against a cache of 16
    positions, or the prompt pass of 16 tokens; the shared-key cache is the smaller one."""
    decode = load("decode")
    argv = [*TINY, "--contexts", "16", "--repeats", "3", "--warmup", "0",
            "--out", str(tmp_path / "dec")] + (["--prefill"] if prefill else [])
    rows = decode.main(argv)
    assert [(r["batch"], r["context"], r["model"]) for r in rows] == [(1, 16, "original"), (1, 16, "collab D~=24")]
    assert rows[0]["time_vs_original"] == 1.0
    if prefill:
        assert rows[1]["time_vs_original"] == pytest.approx(rows[1]["prefill_ms"] / rows[0]["prefill_ms"])
        assert "cache_mib" not in rows[1]
    else:
        assert rows[1]["time_vs_original"] == pytest.approx(rows[1]["ms_per_step"] / rows[0]["ms_per_step"])
        assert rows[1]["cache_vs_original"] == pytest.approx(COLLAB_CACHE, rel=0.01)
    table = (tmp_path / "dec.md").read_text()
    assert table.startswith(("# Prefill: " if prefill else "# Decoding: ") + decode.TITLES["tiny"])
    assert_decode_reports(rows, table, capsys.readouterr().out, prefill)


def test_decode_times_the_cache_race_layouts_with_the_cache_they_hold(tmp_path, capsys):
    """``--cache-fractions 0.25``: every race conversion at a quarter of the cache, its cache measured from the
    cache's tensors at or below a quarter of the original's."""
    decode = load("decode")
    rows = decode.main([*TINY, "--contexts", "16", "--repeats", "1", "--warmup", "0", "--cache-fractions", "0.25",
                        "--out", str(tmp_path / "dec")])
    # a quarter of 2 x 192 is 96 numbers: cp 42 + 12 + 42, svd 36 + 12 + 36 (12 heads of 3), kv-svd's latent 96,
    # prune 3 heads of 16 per layer (48 keys, 48 values)
    assert [r["model"] for r in rows] == ["original", "collab D~=24", "cp k42 v42 (0.25)", "svd k36 v36 (0.25)",
                                          "kv-svd k96 (0.25)", "prune k48 (0.25)"]
    for row in rows[2:]:
        assert 0.2 < row["cache_vs_original"] <= 0.25 + 1e-9
    assert_decode_reports(rows, (tmp_path / "dec.md").read_text(), capsys.readouterr().out, False)


@pytest.mark.parametrize("bad, message", [
    (["--race-methods", "bogus"], "argument --race-methods: invalid choice: 'bogus'"),
    (["--cache-fractions", "0"], "--cache-fractions must lie in (0, 1], got [0.0]"),
    (["--size", "smollm2", "--ranks", "96"], "--ranks: keys-only collaborative widths are GPT-2's"),
    (["--size", "smollm2", "--race-methods", "svd"], "--race-methods ['svd'] do not convert rotary models"),
    (["--kernels-against-reference", "--prefill"], "--kernels-against-reference: the CPU kernels decode GPT-2's"),
])
def test_decode_refuses_a_bad_option_in_one_line_before_writing(bad, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        load("decode").main([*bad, "--out", str(tmp_path / "dec")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not list(tmp_path.iterdir())


def test_decode_never_overwrites_a_result(tmp_path, capsys, monkeypatch):
    """An ``--out`` whose table or JSON is already there is refused before anything runs (the file untouched); with
    no ``--out`` the result gets a time-stamped name of its own."""
    decode = load("decode")
    (tmp_path / "dec.json").write_text("an earlier result")
    with pytest.raises(SystemExit) as exited:
        decode.main([*TINY, "--contexts", "16", "--repeats", "1", "--out", str(tmp_path / "dec")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "never overwritten" in err and "dec.json" in err
    assert (tmp_path / "dec.json").read_text() == "an earlier result" and not (tmp_path / "dec.md").exists()
    monkeypatch.setattr(decode, "ROOT", tmp_path)
    decode.main([*TINY, "--contexts", "16", "--repeats", "1", "--warmup", "0"])
    (written,) = (tmp_path / "experiments" / "benchmarks").glob("decode_cpu_float32_*.md")
    assert re.fullmatch(r"decode_cpu_float32_\d{8}-\d{6}\.md", written.name)
    assert written.with_suffix(".json").is_file()


def test_decode_races_the_methods_it_is_given_in_their_own_layout():
    """``--race-methods cp tucker``: Tucker at the size CP takes (the same cache), built with its cores. (The
    default model is GPT-2 small; the tests take the tiny one.)"""
    decode = load("decode")
    sizes = decode.gpt2_sizes("gpt2-small")
    assert sizes == {key: getattr(transformers.GPT2Config(), key) for key in sizes}
    args = argparse.Namespace(size="tiny", ranks=[24], cache_fractions=[0.25], race_methods=["tucker", "key-svd"])
    variants = decode.variants_of(args)
    assert list(variants) == ["original", "collab D~=24", "tucker k42 v42 (0.25)"]  # key-svd never fits
    model = decode.build(variants["tucker k42 v42 (0.25)"], positions=8, device="cpu", dtype=torch.float32,
                         size="tiny")
    layer = model.transformer.h[0].attn
    assert layer.mixing_core.shape == (12, 42, 42) and layer.value_core.shape == (12, 42, 42)


def test_decode_in_batches_with_static_compiled_caches(tmp_path, capsys):
    """Batches 1 and 2, dynamic and static (compiled) caches: one row per model and setting, per-token time the
    step's divided by the batch, and a static cache that holds one slot more than the context. The static steps
    compile whole (``fullgraph=True``) with ``aot_eager``: inductor's kernels for the same converted GPT-2's static
    decoding step are built, and checked against eager, by
    tests/test_static_cache.py::test_compiled_static_decoding_equals_eager_and_does_not_recompile."""
    decode = load("decode")
    argv = [*TINY, "--contexts", "16", "--batches", "1", "2", "--caches", "dynamic", "static", "--compile-backend",
            "aot_eager", "--repeats", "1", "--warmup", "0", "--memory-gib", "1", "--out", str(tmp_path / "dec")]
    rows = decode.main(argv)
    assert [(r["batch"], r["cache"], r["model"]) for r in rows] == [
        (batch, cache, model) for batch in (1, 2) for cache in ("dynamic", "static")
        for model in ("original", "collab D~=24")]
    for row in rows:
        assert row["ms_per_token"] == pytest.approx(row["ms_per_step"] / row["batch"])
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1e3 / row["ms_per_step"])
    by = {(r["batch"], r["cache"], r["model"]): r for r in rows}
    for batch in (1, 2):
        dynamic, static = by[batch, "dynamic", "original"], by[batch, "static", "original"]
        assert static["cache_mib"] == pytest.approx(dynamic["cache_mib"] * 17 / 16)  # context + 1 slots
        assert by[batch, "static", "collab D~=24"]["cache_vs_original"] == pytest.approx(COLLAB_CACHE)
        # a smaller cache per sequence fits more sequences in the same memory
        assert by[batch, "dynamic", "collab D~=24"]["max_batch"] > dynamic["max_batch"] > 0
    text = (tmp_path / "dec.md").read_text()
    assert 'torch.compile(fullgraph=True, backend="aot_eager")' in text
    assert_decode_reports(rows, text, capsys.readouterr().out, prefill=False)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels need x86 with AVX2 and FMA")
def test_decode_times_the_cpu_kernels_against_the_reference_path_in_one_process(tmp_path, capsys):
    """``--kernels-against-reference``: every collaborative model beside a twin on the reference path, taking turns
    in one process; a profiled step shows the kernels in the one and not in the other, and each model's ratio to its
    twin is the ratio of their medians, with the verdict of their ranges. (Compiled twins get graphs of their own:
    tests/test_cpu_kernels.py::test_a_step_compiled_on_one_path_is_not_reused_on_the_other.)"""
    decode = load("decode")
    argv = [*TINY, "--contexts", "16", "--batches", "1", "2", "--repeats", "3", "--warmup", "0",
            "--kernels-against-reference", "--out", str(tmp_path / "d")]
    rows = decode.main(argv)
    twin = "collab D~=24" + decode.REFERENCE
    assert [(r["batch"], r["model"]) for r in rows] == [(batch, model) for batch in (1, 2)
                                                        for model in ("original", "collab D~=24", twin)]
    for batch in (1, 2):
        original, kernels, reference = (r for r in rows if r["batch"] == batch)
        # two layers, each scoring and weighting through the kernels: two calls per layer and step
        assert (original["kernel_calls"], kernels["kernel_calls"], reference["kernel_calls"]) == (0, 4, 0)
        assert kernels["vs_reference"] == pytest.approx(kernels["ms_per_step"] / reference["ms_per_step"])
        versus = timing_verdict(kernels["ms_per_step_runs"], reference["ms_per_step_runs"])
        assert kernels["reference_verdict"] == versus.verdict
        assert "vs_reference" not in original and "vs_reference" not in reference
    text, printed = (tmp_path / "d.md").read_text(), capsys.readouterr().out
    assert "`reference path`: the same model and weights decoding through the reference path" in text
    assert_decode_reports(rows, text, printed, prefill=False, extra=("vs reference path", "verdict"))
    _, table = markdown_table(text)
    for row, cells, line in zip(rows, table, [line for line in printed.splitlines() if line.startswith("batch ")]):
        if "vs_reference" in row:
            assert shows(cells[13], row["vs_reference"]) and cells[14] == row["reference_verdict"]
            assert line.endswith(f"vs reference path {row['vs_reference']:.2f}x: {row['reference_verdict']}")
        else:
            assert cells[13:] == ["-", "-"] and "vs reference path" not in line


CPU_KERNELS = cpu_kernels.available()  # the CPU decoding kernels' rows run where they built (x86, AVX2)
KERNELS = (["original sdpa", "collab explicit", "collab compiled"]
           + ["collab kernels", "collab kernels compiled"] * CPU_KERNELS
           + ["collab sdpa", "collab flex", "collab kv explicit", "collab kv fused", "collab kv fused compiled"]
           + ["collab kv kernels", "collab kv kernels compiled"] * CPU_KERNELS)


def assert_decode_kernels_reports(result: dict, text: str, printed: str) -> None:
    """Each row's median, range, ratio to ``original sdpa`` and verdict are those of the steps it keeps, and the table
    and the printed lines show them."""
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == KERNELS
    base = rows["original sdpa"]
    for name, row in rows.items():
        runs = row["ms_runs"]
        assert row["ms"] == statistics.median(runs) and (row["ms_low"], row["ms_high"]) == (min(runs), max(runs))
        assert row["vs_original"] == pytest.approx(row["ms"] / base["ms"])
        assert row["verdict"] == reference_verdict(name, "original sdpa", runs, base["ms_runs"])
    header, table = markdown_table(text)
    assert header == ["variant", "ms / step", "range", "vs original sdpa", "verdict", "cache MB read", "GB/s",
                      "max abs difference to explicit", "of copy"]
    copied = result["copy"]  # the memory's measured speed, a copy taking turns with the variants
    assert copied["gb_per_s"] == pytest.approx(copied["mb"] / copied["ms"]) and len(copied["ms_runs"]) == len(
        base["ms_runs"])
    assert f"**{copied['gb_per_s']:.1f} GB/s**" in text
    assert "timing_verdict" in text  # the table says by which rule
    lines = [line for line in printed.splitlines() if line.endswith("GB/s")]
    assert len(table) == len(lines) == len(rows)
    for (name, row), cells, line in zip(rows.items(), table, lines):
        assert cells[0] == name and shows(cells[1], row["ms"]) and shows_range(*cells[2].split("-"), row["ms_runs"])
        assert shows(cells[3], row["ms"] / base["ms"]) and cells[4] == row["verdict"]
        assert row["gb_per_s"] == pytest.approx(row["cache_mb"] / row["ms"])  # MB per ms: GB per second
        assert shows(cells[5], row["cache_mb"]) and shows(cells[6], row["gb_per_s"])
        difference = row["max_abs_difference"]
        assert cells[7] == ("" if difference is None else f"{difference:.1e}")
        assert row["of_copy"] == pytest.approx(row["gb_per_s"] / copied["gb_per_s"])
        assert cells[8] == f"{row['of_copy']:.0%}"
        shown_name, ms, low, high, ratio, verdict, megabytes, rate = re.fullmatch(
            r"(\S.*?) +([\d.]+) ms +\[([\d.]+)-([\d.]+)\] +\(([\d.]+x), ([\w-]+)\) +([\d.]+) MB at ([\d.]+) GB/s",
            line).groups()
        assert shown_name == name and shows(ms, row["ms"]) and shows_range(low, high, row["ms_runs"])
        assert shows(ratio, row["ms"] / base["ms"]) and verdict == row["verdict"]
        assert shows(megabytes, row["cache_mb"]) and shows(rate, row["gb_per_s"])


def test_decode_kernels_agree_and_report_ratios_of_their_timings(tmp_path, capsys):
    """One collaborative decoding step five ways, three steps each: the collaborative variants compute the same
    attention, and each row's ratio is its median over the original's, with the verdict of their ranges."""
    kernels = load("decode_kernels")
    result = kernels.main(["--batch", "2", "--context", "64", "--rank", "48", "--value-rank", "40", "--repeats", "3",
                           "--warmup", "0", "--threads", "1", "--out", str(tmp_path / "k")])
    rows = {row["variant"]: row for row in result["rows"]}
    element = 4  # float32: keys, content logits (12 heads) and values per position, 2 x 64 positions
    assert rows["original sdpa"]["cache_mb"] * 1e6 == 2 * 64 * 2 * 12 * 64 * element
    assert rows["collab explicit"]["cache_mb"] * 1e6 == 2 * 64 * (48 + 12 + 12 * 64) * element
    assert rows["collab kv fused"]["cache_mb"] * 1e6 == 2 * 64 * (40 + 12 + 40) * element
    for row in result["rows"]:
        assert len(row["ms_runs"]) == 3 and all(t > 0 for t in row["ms_runs"])
        if row["variant"].startswith("collab"):
            assert row["max_abs_difference"] < 1e-4
        else:
            assert row["max_abs_difference"] is None
    assert json.loads((tmp_path / "k.json").read_text())["rows"] == result["rows"]  # every step kept
    assert_decode_kernels_reports(result, (tmp_path / "k.md").read_text(), capsys.readouterr().out)


def test_decode_kernels_call_faster_or_slower_only_outside_the_spread(tmp_path, capsys, monkeypatch):
    """Scripted step times (the variants take turns step by step): a variant is faster or slower than the original's
    kernel only where its range and the original's do not overlap. Nothing is timed, so nothing is compiled either:
    the compiled variants run eagerly here (the test above compiles them)."""
    kernels = load("decode_kernels")
    kernel_rows = {"kernels faster": SCRIPTED["faster"], "kernels across": SCRIPTED["across"]} if CPU_KERNELS else {}
    kv_kernel_rows = {"kv kernels slower": SCRIPTED["slower"], "kv kernels faster": SCRIPTED["faster"]} \
        if CPU_KERNELS else {}
    head = dict(list(SCRIPTED.items())[:3])  # original, explicit, compiled; then the kernels; then sdpa and flex
    scripted = {**head, **kernel_rows, **dict(list(SCRIPTED.items())[3:]), "kv faster": SCRIPTED["faster"],
                "kv slower": SCRIPTED["slower"], "kv across": SCRIPTED["across"], **kv_kernel_rows}  # in order
    steps = iter(seconds for step in zip(*scripted.values()) for seconds in step)
    monkeypatch.setattr(kernels, "timed", lambda fn, *inputs: next(steps))
    monkeypatch.setattr(kernels.torch, "compile", lambda fn, **options: fn)
    monkeypatch.setattr(kernels, "make_flex", lambda backend: kernels.collab_sdpa)
    result = kernels.main(["--batch", "1", "--context", "8", "--rank", "8", "--repeats", "3", "--warmup", "0",
                           "--threads", "1", "--out", str(tmp_path / "k")])
    verdicts = list(SCRIPTED_VERDICTS.values())
    verdicts[3:3] = ["faster", "tie"] * CPU_KERNELS
    assert [row["verdict"] for row in result["rows"]] == verdicts + ["faster", "slower", "tie"] + [
        "slower", "faster"] * CPU_KERNELS
    text = (tmp_path / "k.md").read_text()
    assert_decode_kernels_reports(result, text, capsys.readouterr().out)
    faster, slower, tie = (["6.000", "5.000-7.000", "0.55x", "faster"], ["25.000", "20.000-30.000", "2.27x", "slower"],
                           ["11.000", "9.000-13.000", "1.00x", "tie"])
    assert [cells[1:5] for cells in markdown_table(text)[1]] == [
        ["11.000", "10.000-12.000", "1.00x", "-"], faster, slower] + [faster, tie] * CPU_KERNELS + [
        tie, ["20.000", "12.000-30.000", "1.82x", "tie"], faster, slower, tie] + [slower, faster] * CPU_KERNELS


def test_tpa_decode_times_the_factored_step_against_the_expanded_heads_and_the_original(tmp_path, capsys, monkeypatch):
    """The two TPA paths agree; scripted step times (the three take turns step by step): each row's ratio is its
    median over the original's, faster or slower only outside the original's range."""
    bench = load("tpa_decode")
    result = bench.main(["--contexts", "16", "--repeats", "2", "--warmup", "0", "--threads", "1",
                         "--out", str(tmp_path / "real")])
    assert [row["variant"] for row in result["rows"]] == [bench.ORIGINAL, "TPA factored (the layer's step)",
                                                          "TPA expanded heads"]
    assert all(row["max_abs_difference"] < 1e-4 for row in result["rows"][1:])
    scripted = iter([10e-3, 4e-3, 30e-3, 12e-3, 5e-3, 11e-3])  # step 1: original, factored, expanded; step 2
    monkeypatch.setattr(bench, "timed", lambda fn, device: next(scripted))
    result = bench.main(["--contexts", "16", "--repeats", "2", "--warmup", "0", "--threads", "1",
                         "--out", str(tmp_path / "scripted")])
    assert [(round(row["vs_original"], 3), row["verdict"]) for row in result["rows"]] == [
        (1.0, "-"), (0.409, "faster"), (1.864, "tie")]
    assert (round(result["rows"][1]["vs_expanded"], 3), result["rows"][1]["verdict_vs_expanded"]) == (0.22, "faster")
    _, rows = markdown_table((tmp_path / "scripted.md").read_text())
    assert [cells[2:7] for cells in rows] == [["11.000", "10.000-12.000", "1.00x", "-", ""],
                                              ["4.500", "4.000-5.000", "0.41x", "faster", "0.22x, faster"],
                                              ["20.500", "11.000-30.000", "1.86x", "tie", ""]]
    with pytest.raises(SystemExit):
        bench.main(["--contexts", "16", "--out", str(tmp_path / "scripted")])  # never overwritten
    assert "already there" in capsys.readouterr().err
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench.main(["--ranks", "0", "2", "--out", str(tmp_path / "bad")])
    assert capsys.readouterr().err == "error: argument --ranks: must be a positive integer, got 0\n"
    assert not list(tmp_path.glob("bad*"))


def test_race_decode_rows_measure_each_variant_against_the_concatenated_model(tmp_path, monkeypatch):
    from collab_attn.char_lm.models import build_model, cache_bytes, gpt_config

    bench = load("race_decode")
    timings = iter(range(1, 1000))
    monkeypatch.setattr(bench, "repeated_seconds",
                        lambda models, args, measure: {name: [measure(name, model) * 0 + next(timings) / 1000]
                                                       for name, model in models.items()})
    args = ["--contexts", "16", "--warmup", "0", "--repeats", "1", "--runs", "2", "--out", str(tmp_path / "r.md")]
    rows = bench.main(args)
    assert [r["variant"] for r in rows] == [name for name, *_ in bench.VARIANTS]
    for row, (_, kind, key, values) in zip(rows, bench.VARIANTS):
        model = build_model(gpt_config(65, 17, **bench.MODEL, kind=kind, rank=key, value_rank=values), 0)
        assert row["cache_bytes_per_token"] == 2 * cache_bytes(model)  # float32 here, bf16 in the accounting
        assert row["ratio"] == pytest.approx(row["ms_per_token"] / rows[0]["ms_per_token"])
    # run 1 times the variants 1..9 ms, run 2 10..18 ms: every range overlaps concat's (1..10 ms): no verdict
    text = (tmp_path / "r.md").read_text()
    assert "| collab k30 v30 | 16 | 1 | 12.500 | 8.000-17.000 | 2.27x | tie | 1,024 |" in text
    stored = json.loads((tmp_path / "r.json").read_text())
    assert stored["rows"] == json.loads(json.dumps(rows)) and stored["rows"][7]["ms_per_token_runs"] == [8.0, 17.0]
    with pytest.raises(SystemExit):  # a result is never overwritten
        bench.main(args)


def test_decode_attention_times_three_equal_ways_of_each_models_step(tmp_path, capsys, monkeypatch):
    """The original's shapes and an export's, each step three ways that give the same output (a way that does not is
    refused before timing); scripted times: ratios to the original's expanded step, faster or slower only outside its
    range; the cache bytes are the shapes'."""
    bench = load("decode_attention")
    args = ["--batch", "1", "--context", "32", "--head-sizes", "8", "--repeats", "2", "--warmup", "0"]
    ticks = iter([0, 10, 0, 4, 0, 12, 0, 30, 0, 5, 0, 11,  # round 1: start and end of each of the 6 steps
                  0, 14, 0, 4, 0, 12, 0, 30, 0, 5, 0, 11])  # round 2: the original's expanded step 10-14
    monkeypatch.setitem(bench.CLOCKS, "wall", lambda: next(ticks) / 1e3)
    rows = bench.main([*args, "--out", str(tmp_path / "scripted")])
    assert [(r["model"], r["way"]) for r in rows] == [(m, w) for m in ("original", "exported, head size 8")
                                                       for w in ("expanded", "gqa", "folded")]
    assert [(r["ms"], round(r["vs_original_expanded"], 4), r["verdict"]) for r in rows] == [
        (12, 1, "-"), (4, 0.3333, "faster"), (12, 1, "tie"), (30, 2.5, "slower"), (5, 0.4167, "faster"),
        (11, 0.9167, "tie")]
    assert [r["cache_mib"] * 2**20 for r in rows] == [2 * 3 * 32 * 64 * 4] * 3 + [2 * 1 * 32 * 8 * 4] * 3
    assert [(round(r["vs_original_same_way"], 4), r["verdict_same_way"]) for r in rows[3:]] == [
        (2.5, "slower"), (1.25, "slower"), (0.9167, "faster")]
    assert "vs_original_same_way" not in rows[0]
    _, table = markdown_table((tmp_path / "scripted.md").read_text())
    assert table[0][:8] == ["original", "expanded", "12.00", "10.00-14.00", "1.00x", "-", "-", "-"]
    assert table[5][:8] == ["exported, head size 8", "folded", "11.00", "11.00-11.00", "0.92x", "tie", "0.92x",
                            "faster"]
    assert table[1][:6] == ["original", "gqa", "4.00", "4.00-4.00", "0.33x", "faster"]
    monkeypatch.setitem(bench.CLOCKS, "wall", time.perf_counter)
    monkeypatch.setitem(bench.WAYS, "folded", lambda q, k, v, m: bench.gqa(q, k, v, m) + 1e-3)
    with pytest.raises(RuntimeError, match="original, folded: 1.00e-03 from the expanded step"):
        bench.main([*args, "--out", str(tmp_path / "wrong")])
    assert not list(tmp_path.glob("wrong*"))
