"""A converted rotary causal LM as the standard model of its family: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
``MistralForCausalLM`` with one key/value head of head size R (``key-svd``, ``cp``, ``tucker``), or the groups a
``merge-kv`` or ``drop-kv`` conversion kept (``collab_attn.serving.standard``), its frequencies in the ``longrope``
fields (``collab_attn.serving.rope``). Nothing of collab-attn is needed to load it.

``standard_model`` builds it in memory and checks it against the converted model; ``collab_attn.export`` writes
it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import transformers

from collab_attn.models.families import COLLAB_PREFIX, is_collaborative
from collab_attn.serving.rope import LongRope, long_rope, source_frequencies
from collab_attn.serving.standard import StandardLayer, balance_scales, refusal, standard_layer

FAMILIES = {  # collab-attn's model type -> (the standard model type, its causal LM class, biases (q, k, v, o))
    "llama": ("llama", "LlamaForCausalLM", None),  # Llama: all four or none (attention_bias)
    "qwen2": ("qwen2", "Qwen2ForCausalLM", (True, True, True, False)),
    "mistral": ("mistral", "MistralForCausalLM", (False, False, False, False)),
}
CHECK_TOLERANCE = 1e-4  # of the logits' scale, in float32


@dataclass
class Exported:
    """A standard model in memory, with what ``export.json`` records."""

    model: transformers.PreTrainedModel
    family: str
    rope: LongRope
    head_dim: int
    kv_heads: int
    bands: list[int]  # the source band each pair rotates with
    logit_error: float  # max |standard - converted| / max |converted| on the check tokens
    output_bias: str | None  # Qwen2: where the converted output bias went ("value bias", "one more pair", None)
    converted_float32_error: float | None = None  # the converted model's own, where logit_error needed it


def exportable(model) -> tuple[str, list]:
    """The family and the converted attention layers of ``model``, or a ValueError that says why it has no standard
    form and how to get a model that has one."""
    config = getattr(model, "config", None)
    if config is None or not is_collaborative(config):
        raise ValueError("export takes a model converted by collab_attn.reparametrize (a collab_attn_* model); "
                         "convert a Llama, Qwen2 or Mistral checkpoint with method='key-svd', 'cp' or 'tucker', "
                         "value_rank=rank, bands='shared', or with method='merge-kv' or 'drop-kv'")
    family = config.model_type.removeprefix(COLLAB_PREFIX)
    if family not in FAMILIES:
        raise ValueError(f"a converted {family} model has no standard rotary form: export writes Llama, Qwen2 and "
                         "Mistral models (encoders, GPT-2 and OPT keep learned or no positions, and their converted "
                         "layers run only through collab-attn)")
    if not hasattr(model, "lm_head"):
        raise ValueError(f"export writes causal language models; got {type(model).__name__}: load the converted "
                         "checkpoint with AutoModelForCausalLM")
    layers = [layer.self_attn for layer in model.model.layers]
    for index, layer in enumerate(layers):
        reason = refusal(layer, index)
        if reason is not None:
            raise ValueError(f"no standard form: {reason}")
    shapes = sorted({layer.standard_form.shape(layer) for layer in layers})
    if len(shapes) > 1:
        raise ValueError(f"no standard form: the layers have (query heads, key/value heads, head size) of widths "
                         f"{shapes}; a standard checkpoint has one shape for every layer: convert at one rank for "
                         "every layer (not a per-layer budget or allocate_cache), with bands='shared'")
    first = layers[0].standard_form.bands(layers[0])
    for index, layer in enumerate(layers[1:], start=1):
        if not torch.equal(layer.standard_form.bands(layer), first):
            raise ValueError(f"no standard form: layer {index} rotates its pairs with other bands than layer 0; a "
                             "standard checkpoint has one frequency list for all layers: convert with "
                             "bands='shared'")
    return family, layers


def _absorb_output_bias(layer: StandardLayer) -> tuple[StandardLayer, str | None]:
    """Qwen2 has no output bias: move the converted layer's (the value bias it folded in) onto the values. Attention
    rows sum to one, so a value bias ``b`` adds ``sum_h O_h b`` to the output: where the output bias lies in that
    range (to 1e-6), ``v_proj``'s bias takes it. Otherwise it rides on one more pair (``widened``). Returns the layer
    and where the bias went (None: there was none)."""
    if layer.output_bias is None or not bool(layer.output_bias.any()):
        return dataclasses.replace(layer, output_bias=None), None
    if layer.kv_heads > 1:
        raise ValueError("no standard form: a grouped layer with an output bias, in a family whose o_proj has none")
    summed = layer.output.view(layer.output.shape[0], layer.heads, -1).sum(1)  # (d, R): sum_h O_h
    solution = torch.linalg.lstsq(summed, layer.output_bias[:, None]).solution[:, 0]
    residual = (summed @ solution - layer.output_bias).norm() / layer.output_bias.norm()
    if residual <= 1e-6:
        value_bias = solution if layer.value_bias is None else layer.value_bias + solution
        return dataclasses.replace(layer, value_bias=value_bias, output_bias=None), "value bias"
    return widened(layer), "one more pair"


def widened(layer: StandardLayer) -> StandardLayer:
    """The layer with head size R + 2 and no output bias: the new query and key pair zero (no logit changes,
    whatever it rotates with), the value's two new numbers the constants (1, 0), and each head's output columns for
    them ``(c / H, 0)`` with ``c`` the output bias (zero where there is none), so that the heads add ``c``. The queries
    grow by ``sqrt((R + 2) / R)``: the standard layer divides by the square root of its head size."""
    pairs, heads, d = layer.head_dim // 2, layer.heads, layer.output.shape[0]
    grow = math.sqrt((layer.head_dim + 2) / layer.head_dim)
    bias = layer.output_bias if layer.output_bias is not None else layer.output.new_zeros(d)

    def padded(rows, dim):  # a zero after each half of a [real parts ; imaginary parts] layout along ``dim``
        first, second = rows.split(pairs, dim=dim)
        zero = torch.zeros_like(first.narrow(dim, 0, 1))
        return torch.cat([first, zero, second, zero], dim=dim)

    value_bias = layer.value.new_zeros(layer.head_dim) if layer.value_bias is None else layer.value_bias
    columns = torch.stack([bias / heads, torch.zeros_like(bias)], dim=1)  # (d, 2)
    return StandardLayer(
        padded(layer.query * grow, 1), None if layer.query_bias is None else padded(layer.query_bias * grow, 1),
        padded(layer.key, 0), None if layer.key_bias is None else padded(layer.key_bias, 0),
        torch.cat([layer.value, layer.value.new_zeros(2, layer.value.shape[1])]),
        torch.cat([value_bias, value_bias.new_tensor([1.0, 0.0])]),
        torch.cat([layer.output.view(d, heads, -1), columns[:, None].expand(d, heads, 2)], dim=2).flatten(1),
        None, torch.cat([layer.bands, layer.bands[-1:]]))


def standard_config(model, family: str, layer: StandardLayer, rope: LongRope):
    """The standard config: the converted one without collab-attn's fields, the standard layers' heads and key/value
    heads of ``head_dim``, the rope as ``longrope`` factors."""
    model_type, architecture, _ = FAMILIES[family]
    fields = {key: value for key, value in model.config.to_dict().items()
              if not key.startswith("collab_") and key not in ("model_type", "architectures", "rope_parameters",
                                                               "rope_scaling", "rope_theta", "transformers_version")}
    positions = model.config.max_position_embeddings
    fields |= {"num_attention_heads": layer.heads, "num_key_value_heads": layer.kv_heads, "head_dim": layer.head_dim,
               "rope_parameters": rope.parameters(positions), "architectures": [architecture]}
    return transformers.AutoConfig.for_model(model_type, **fields)


def _bias_slots(family: str, config) -> tuple[bool, bool, bool, bool]:
    slots = FAMILIES[family][2]
    return (config.attention_bias,) * 4 if slots is None else slots


def _projection_state(prefix: str, layer: StandardLayer, family: str, slots, dtype) -> dict:
    """``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` weights (and the biases the family has) of one layer."""
    weights = {"q_proj": (layer.query.flatten(0, 1), None if layer.query_bias is None else layer.query_bias.flatten()),
               "k_proj": (layer.key, layer.key_bias), "v_proj": (layer.value, layer.value_bias),
               "o_proj": (layer.output, layer.output_bias)}
    state = {}
    for (name, (weight, bias)), slot in zip(weights.items(), slots):
        state[f"{prefix}.{name}.weight"] = weight.to(dtype)
        if slot:
            state[f"{prefix}.{name}.bias"] = (torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None
                                              else bias).to(dtype)
        elif bias is not None and bool(bias.any()):
            raise ValueError(f"no standard form: {prefix}.{name} has a bias and a standard {FAMILIES[family][1]} "
                             "has none there")
    return state


@torch.no_grad()
def check_tokens(model, length: int = 24) -> torch.Tensor:
    """A fixed batch of token ids to compare the standard model with the converted one on."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (2, length), generator=generator)


@torch.no_grad()
def standard_model(model, balance: bool = True) -> Exported:
    """The converted causal LM ``model`` as the standard model of its family (module doc), in float32 on the CPU,
    checked against ``model`` on fixed tokens (a ValueError when its logits differ by more than ``CHECK_TOLERANCE``
    of their scale, or 4 x the converted model's own float32 error where that is larger: ``_logit_errors``).
    ``balance``: choose the free scales so that each cached coordinate has the same size (``balance_scales``)."""
    family, layers = exportable(model)
    standard = [standard_layer(layer) for layer in layers]
    if balance:
        standard = [balance_scales(layer) for layer in standard]
    slots = _bias_slots(family, model.config)
    placed = None
    if not slots[3]:  # no output bias in the family: move the converted one onto the values
        moved = [_absorb_output_bias(layer) for layer in standard]
        places = {where for _, where in moved} - {None}
        placed = "one more pair" if "one more pair" in places else next(iter(places), None)
        if placed == "one more pair":  # one head size for all layers: the others widened by a zero pair too
            standard = [layer if where == "one more pair" else widened(layer) for layer, where in moved]
        else:
            standard = [layer for layer, _ in moved]
    rope = long_rope(standard[0].bands, source_frequencies(model), _rope_base(model))
    config = standard_config(model, family, standard[0], rope)
    exported = transformers.AutoModelForCausalLM.from_config(config).eval()
    state = {key: value.detach().float().cpu() for key, value in model.state_dict().items()
             if ".self_attn." not in key}
    for index, layer in enumerate(standard):
        state |= _projection_state(f"model.layers.{index}.self_attn", layer, family, slots, torch.float32)
    missing, unexpected = exported.load_state_dict(state, strict=False)
    missing = [key for key in missing if not key.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"the standard {type(exported).__name__} did not take the converted weights: missing "
                           f"{missing[:3]}, unexpected {unexpected[:3]}")
    if model.config.tie_word_embeddings:
        exported.tie_weights()
    exported.generation_config = copy.deepcopy(model.generation_config)
    error, own = _logit_errors(model, exported)
    if not error <= max(CHECK_TOLERANCE, 4 * (own or 0.0)):
        raise ValueError(f"the standard model's logits differ from the converted model's by {error:.2e} of their "
                         f"scale, more than {CHECK_TOLERANCE:g}" + ("" if own is None else
                         f" and than 4 x the converted model's own float32 error ({own:.2e})") + "; nothing was "
                         "written")
    return Exported(exported, family, rope, standard[0].head_dim, standard[0].kv_heads, standard[0].bands.tolist(),
                    error, placed, own)


def source_as_standard(model) -> Exported:
    """An unconverted Llama or Mistral causal LM as an ``Exported`` of itself: every pair at its own frequency (factors
    1), its own heads and key/value heads. ``collab_attn.serving.gguf_file.write_gguf`` then writes the source the way
    it writes a conversion (float32, the same vocabulary), so that an engine runs the two alike (e.g.
    ``benchmarks/llama_cpp_decode.py``)."""
    config = getattr(model, "config", None)
    if config is None or is_collaborative(config) or config.model_type not in ("llama", "mistral"):
        raise ValueError("source_as_standard takes an unconverted Llama or Mistral causal LM; a converted model is "
                         "written through standard_model (collab_attn.export)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pairs = torch.arange(head_dim // 2)
    rope = long_rope(pairs, source_frequencies(model), _rope_base(model))
    return Exported(model, config.model_type, rope, head_dim, config.num_key_value_heads, pairs.tolist(), 0.0, None)


def _rope_base(model) -> float:
    parameters = getattr(model.config, "rope_parameters", None) or {}
    base = parameters.get("rope_theta", getattr(model.config, "rope_theta", None))
    if base is None:
        raise ValueError("the converted model's config gives no rope_theta")
    return float(base)


@torch.no_grad()
def _logit_errors(model, exported) -> tuple[float, float | None]:
    """The standard model against the converted one on ``check_tokens``, both in float32 on the CPU (a half-precision
    model is compared through a float32 copy): max |difference| / max |converted logit|. Where that exceeds
    ``CHECK_TOLERANCE``, also the converted model's own float32 error, against itself in float64 (a model whose
    float32 logits are that far from exact cannot be checked closer); None where it was not needed."""
    if next(model.parameters()).dtype != torch.float32 or next(model.parameters()).device.type != "cpu":
        model = copy.deepcopy(model).to(device="cpu", dtype=torch.float32)
    ids = check_tokens(model)
    reference = model(ids).logits.double()
    scale = reference.abs().max().clamp_min(1e-30)
    error = float((exported(ids).logits.double() - reference).abs().max() / scale)
    if error <= CHECK_TOLERANCE:
        return error, None
    exact = copy.deepcopy(model).double()(ids).logits
    return error, float((reference - exact).abs().max() / scale)
