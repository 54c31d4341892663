"""Parameter and FLOP accounting for one attention layer, concatenated or collaborative (pure arithmetic).

The parameter counts are those of ``MultiHeadAttention`` and ``CollaborativeAttention`` (the same component
names as their ``parameter_counts()``), so they also match what ``reparametrize`` reports for a converted layer
(pass ``output_projection=False`` for BERT and RoBERTa, whose output projection lives outside the self-attention
module). Why the number of heads does not matter for concatenated heads: each head is ``d_model / heads`` wide,
so the query, key, value and output projections are ``d_model x d_model`` whatever ``heads`` is.
"""

from __future__ import annotations

from collections.abc import Sequence

from collab_attn.models.methods import METHODS as CONVERSION_METHODS
from collab_attn.models.methods import PAPER_METHOD
from collab_attn.nn.attention import head_size

METHODS = tuple(name for name, method in CONVERSION_METHODS.items() if method.collaborative)


def _check(d_model: int, num_heads: int, head_dim: int | None, rank: int | None, method: str) -> int:
    head_dim = head_size(d_model, num_heads, head_dim)
    if rank is not None and rank <= 0:
        raise ValueError(f"rank must be positive, got {rank}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    return head_dim


def attention_parameters(
    d_model: int,
    num_heads: int,
    rank: int | None = None,
    *,
    head_dim: int | None = None,
    bias: bool = True,
    method: str = PAPER_METHOD,
    tucker_core_size: int | None = None,
    output_projection: bool = True,
    value_rank: int | None = None,
) -> dict[str, int]:
    """Parameters per component of one self-attention layer, and their ``total``.

    ``rank=None``: concatenated heads, four ``nn.Linear`` (``query``, ``key``, ``value``, ``output``), each
    with a bias when ``bias``. With a ``rank`` D~: collaborative heads. ``query`` and ``key`` are shared
    ``d_model x D~`` maps without bias, ``mixing`` is ``heads x D~`` (Tucker: ``heads x core`` plus a
    ``mixing_core`` of ``core x D~ x D~``, core defaulting to ``heads``), the query bias becomes
    ``content_bias`` (``heads x d_model``, only when ``bias``) and the key bias is dropped. ``value`` and
    ``output`` are unchanged; with a ``value_rank`` D_v (shared values) they are ``d_model x D_v`` maps and
    ``value_mixing`` is ``heads x D_v`` (Tucker: ``heads x core`` plus a ``value_core`` of ``core x D_v x D_v``).
    Components a layer does not have are left out, like ``parameter_counts()``.
    """
    head_dim = _check(d_model, num_heads, head_dim, rank, method)
    if value_rank is not None and rank is None:
        raise ValueError("value_rank (shared values) needs collaborative heads: pass rank too")
    inner = num_heads * head_dim if value_rank is None else value_rank
    counts = {"value": d_model * inner + (inner if bias else 0)}
    vectors = CONVERSION_METHODS[method].mixing == "vectors"
    core = tucker_core_size or num_heads
    if value_rank is not None:
        counts["value_mixing"] = num_heads * (value_rank if vectors else core)
        if not vectors:
            counts["value_core"] = core * value_rank * value_rank
    if output_projection:
        counts["output"] = inner * d_model + (d_model if bias else 0)
    if rank is None:
        counts["query"] = counts["key"] = counts["value"]
    else:
        counts["query"] = counts["key"] = d_model * rank
        if bias:
            counts["content_bias"] = num_heads * d_model
        if vectors:
            counts["mixing"] = num_heads * rank
        else:
            counts["mixing"] = num_heads * core
            counts["mixing_core"] = core * rank * rank
    counts["total"] = sum(counts.values())
    return counts


def attention_flops_per_token(
    d_model: int,
    num_heads: int,
    seq_len: int,
    rank: int | None = None,
    *,
    head_dim: int | None = None,
    bias: bool = True,
    method: str = PAPER_METHOD,
    output_projection: bool = True,
    value_rank: int | None = None,
) -> dict[str, int]:
    """FLOPs of one self-attention layer per token of a ``seq_len``-token sequence (queries = keys = tokens).

    A multiply-add counts as 2 FLOPs, a lone multiplication as 1. Counted, per token:

    - ``projections``: the query, key and value projections, ``2 d_model x width`` each (concatenated:
      width ``heads x head_dim``; collaborative: ``D~`` for query and key), plus, collaborative with ``bias``,
      the content bias ``2 d_model x heads`` (one logit offset per head and key token);
    - ``mixing`` (collaborative only): the per-head mixed queries, ``heads x D~`` multiplications for CP
      (``q~ * m_h``), ``2 heads x D~^2`` for Tucker (``q~ M_h``);
    - ``scores``: one query against ``seq_len`` keys, ``2 heads x seq_len x head_dim`` (concatenated) or
      ``2 heads x seq_len x D~`` (collaborative: every head scores in the full shared width);
    - ``weighted_sum``: the softmax-weighted sum of values, ``2 heads x seq_len x head_dim``;
    - ``output``: the output projection, ``2 heads x head_dim x d_model`` (when ``output_projection``).

    Shared values (``value_rank`` D_v, collaborative only): the value projection is ``2 d_model x D_v``, every head
    sums the one shared value, ``2 heads x seq_len x D_v``, ``value_mixing`` scales each head's sum, ``heads x D_v``
    multiplications, and the output projection reads the heads' mixed sums added up, ``heads x D_v`` additions
    (counted 1 each) and ``2 D_v x d_model``; Tucker mixes each head's sum by ``N_h`` into the heads' total,
    ``2 heads x D_v^2``.

    Not counted: bias and mask additions, the logit scaling, the softmax itself (exponentials, sums,
    divisions), dropout, and Tucker's ``M_h = sum_g A[h, g] G[g]``, which is built once per forward pass while
    training (once in all for inference) and not per token. Note that the scores cost ``heads x D~`` per key
    against ``heads x head_dim`` for concatenated heads: collaborative heads spend fewer FLOPs on scores only
    when ``D~ < head_dim``.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    head_dim = _check(d_model, num_heads, head_dim, rank, method)
    if value_rank is not None and rank is None:
        raise ValueError("value_rank (shared values) needs collaborative heads: pass rank too")
    inner = num_heads * head_dim if value_rank is None else value_rank
    vectors = CONVERSION_METHODS[method].mixing == "vectors"
    if rank is None:
        flops = {"projections": 3 * 2 * d_model * inner, "mixing": 0, "scores": 2 * num_heads * seq_len * head_dim}
    else:
        content = 2 * d_model * num_heads if bias else 0
        flops = {
            "projections": 2 * 2 * d_model * rank + 2 * d_model * inner + content,
            "mixing": num_heads * rank if vectors else 2 * num_heads * rank * rank,
            "scores": 2 * num_heads * seq_len * rank,
        }
    if value_rank is None:
        flops["weighted_sum"] = 2 * num_heads * seq_len * head_dim
    else:
        # value mixing, then the heads' sums added up (Tucker: one D_v x D_v product per head into the sum)
        flops["mixing"] += 2 * num_heads * value_rank * (1 if vectors else value_rank)
        flops["weighted_sum"] = 2 * num_heads * seq_len * value_rank
    flops["output"] = 2 * inner * d_model if output_projection else 0
    flops["total"] = sum(flops.values())
    return flops


def cache_bytes_per_token(
    d_model: int,
    num_heads: int,
    rank: int | None = None,
    *,
    head_dim: int | None = None,
    bias: bool = True,
    dtype_bytes: int = 2,
    value_rank: int | None = None,
) -> dict[str, int]:
    """Key/value cache bytes per token and layer of a decoder (``collab_attn.models.layers``' cache layout).

    Concatenated heads cache every head's key and value, ``2 heads x head_dim`` numbers. Collaborative heads cache
    one shared key of width D~, plus (with ``bias``) each head's content-bias logit, plus the per-head values:
    ``D~ + heads + heads x head_dim``; sharing the values too (``value_rank`` D_v), ``D~ + heads + D_v``.
    ``dtype_bytes``: 2 for float16/bfloat16, 4 for float32."""
    head_dim = _check(d_model, num_heads, head_dim, rank, PAPER_METHOD)
    if value_rank is not None and rank is None:
        raise ValueError("value_rank (shared values) needs collaborative heads: pass rank too")
    values = num_heads * head_dim if value_rank is None else value_rank
    keys = values if rank is None else rank + (num_heads if bias else 0)
    return {"keys": keys * dtype_bytes, "values": values * dtype_bytes, "total": (keys + values) * dtype_bytes}


def default_ranks(d_model: int, num_heads: int) -> list[int]:
    """d, 3d/4, d/2, d/3, d/4, d/6, d/8 and head_dim (where collaborative scores cost as much as concatenated)."""
    ranks = [d_model * 3 // 4, d_model // 2, d_model // 3, d_model // 4, d_model // 6, d_model // 8]
    ranks = [d_model] + ranks + [d_model // num_heads]
    return sorted({r for r in ranks if r > 0}, reverse=True)


def _markdown(header: Sequence[str], rows: Sequence[Sequence], right_from: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" if i < right_from else "---:" for i in range(len(header))) + "|")
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%"


def heads_table(d_model: int, head_counts: Sequence[int], rank: int, bias: bool = True) -> str:
    """Parameters of one layer as the number of heads changes at fixed ``d_model``: concatenated vs collaborative
    at ``rank`` (only the mixing and content bias, ``heads x (D~ + d_model)``, grow with the heads)."""
    rows = []
    for heads in head_counts:
        concat = attention_parameters(d_model, heads, bias=bias)
        collab = attention_parameters(d_model, heads, rank, bias=bias)
        rows.append([heads, d_model // heads, f"{concat['total']:,}", f"{collab['total']:,}"])
    return _markdown(["heads", "head_dim", "concatenated", f"collaborative, D~={rank}"], rows)


def _name(method: str, rank: int | None, value_rank: int | None) -> str:
    if rank is None:
        return "concatenated"
    return f"{method}, D~={rank}" + ("" if value_rank is None else f", D_v={value_rank}")


def parameters_table(
    d_model: int, num_heads: int, ranks: Sequence[int], num_layers: int = 1, bias: bool = True,
    method: str = PAPER_METHOD, tucker_core_size: int | None = None, value_rank: int | None = None,
) -> str:
    """Per-layer parameters by component, concatenated first, then collaborative at each rank (sharing values of
    width ``value_rank`` when given)."""
    concat = attention_parameters(d_model, num_heads, bias=bias)
    rows = []
    for rank in [None, *ranks]:
        counts = attention_parameters(d_model, num_heads, rank, bias=bias, method=method,
                                      tucker_core_size=tucker_core_size, value_rank=rank and value_rank)
        mixing = sum(counts.get(name, 0) for name in ("mixing", "mixing_core", "value_mixing", "value_core"))
        rows.append([
            _name(method, rank, rank and value_rank),
            f"{counts['query']:,}", f"{counts['key']:,}", f"{counts['value']:,}", f"{counts['output']:,}",
            f"{mixing:,}", f"{counts.get('content_bias', 0):,}", f"{counts['total']:,}",
            _percent(counts["total"], concat["total"]), f"{num_layers * counts['total']:,}",
        ])
    header = ["attention", "query", "key", "value", "output", "mixing", "content bias", "total / layer", "vs concat",
              f"total x {num_layers} layers"]
    return _markdown(header, rows)


def flops_table(
    d_model: int, num_heads: int, ranks: Sequence[int], seq_len: int, bias: bool = True, method: str = PAPER_METHOD,
    value_rank: int | None = None,
) -> str:
    """Per-layer FLOPs per token by part, concatenated first, then collaborative at each rank."""
    concat = attention_flops_per_token(d_model, num_heads, seq_len, bias=bias)
    rows = []
    for rank in [None, *ranks]:
        flops = attention_flops_per_token(d_model, num_heads, seq_len, rank, bias=bias, method=method,
                                          value_rank=rank and value_rank)
        rows.append([
            _name(method, rank, rank and value_rank),
            *(f"{flops[part]:,}" for part in ("projections", "mixing", "scores", "weighted_sum", "output", "total")),
            _percent(flops["total"], concat["total"]),
        ])
    header = ["attention", "projections", "mixing", "scores", "weighted sum", "output", "total", "vs concat"]
    return _markdown(header, rows)


def cache_table(
    d_model: int, num_heads: int, ranks: Sequence[int], num_layers: int = 1, bias: bool = True, dtype_bytes: int = 2,
    value_rank: int | None = None, method: str = PAPER_METHOD,
) -> str:
    """Key/value cache bytes per token, per layer and for the whole model, concatenated first (``method`` names the
    rows: CP and Tucker cache the same)."""
    concat = cache_bytes_per_token(d_model, num_heads, bias=bias, dtype_bytes=dtype_bytes)
    rows = []
    for rank in [None, *ranks]:
        cache = cache_bytes_per_token(d_model, num_heads, rank, bias=bias, dtype_bytes=dtype_bytes,
                                      value_rank=rank and value_rank)
        rows.append([
            _name(method, rank, rank and value_rank), f"{cache['keys']:,}", f"{cache['values']:,}",
            f"{cache['total']:,}", _percent(cache["total"], concat["total"]), f"{num_layers * cache['total']:,}",
        ])
    header = ["attention", "keys", "values", "bytes / token / layer", "vs concat", f"x {num_layers} layers"]
    return _markdown(header, rows)


def table(
    d_model: int,
    num_heads: int,
    ranks: Sequence[int] | None = None,
    seq_len: int = 128,
    *,
    num_layers: int = 1,
    head_counts: Sequence[int] = (1, 2, 4, 8, 12, 16),
    bias: bool = True,
    method: str = PAPER_METHOD,
    tucker_core_size: int | None = None,
    title: str | None = None,
    dtype_bytes: int = 2,
    value_rank: int | None = None,
) -> str:
    """The four tables (heads at fixed d_model, parameters per rank, FLOPs per token per rank, cache bytes per token
    per rank) as Markdown, under a ``### title: sizes`` heading. ``ranks`` defaults to ``default_ranks``."""
    if num_layers <= 0 or any(h <= 0 for h in head_counts):
        raise ValueError(f"num_layers and head_counts must be positive, got {num_layers} and {list(head_counts)}")
    ranks = list(ranks) if ranks else default_ranks(d_model, num_heads)
    head_counts = [h for h in head_counts if d_model % h == 0]
    head_dim = _check(d_model, num_heads, None, None, method)
    sizes = f"d_model={d_model}, {num_heads} heads of {head_dim}, {num_layers} layers"
    title = f"{title}: {sizes}" if title else sizes
    biases = "with biases" if bias else "without biases"
    return "\n\n".join([
        f"### {title}",
        f"Parameters of one attention layer (query, key, value, output projections; {biases}) as the number of "
        f"heads changes at d_model={d_model}:",
        heads_table(d_model, head_counts, d_model // 2, bias),
        f"Parameters per layer, concatenated vs collaborative ({method}) at shared key/query size D~:",
        parameters_table(d_model, num_heads, ranks, num_layers, bias, method, tucker_core_size, value_rank),
        f"FLOPs per token per layer at sequence length {seq_len} (multiply-add = 2 FLOPs; softmax, biases and "
        "masks not counted; see `collab_attn.analysis.accounting.attention_flops_per_token`):",
        flops_table(d_model, num_heads, ranks, seq_len, bias, method, value_rank),
        f"Key/value cache bytes per token when it runs as a decoder ({dtype_bytes}-byte numbers; collaborative "
        "heads cache one shared key of width D~ and one content-bias logit per head, and the per-head values):",
        cache_table(d_model, num_heads, ranks, num_layers, bias, dtype_bytes, value_rank, method),
    ])
