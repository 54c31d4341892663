"""Fitting converted attention layers to what the original computes (docs/design.md, "Fitting converted layers to
what the original computes").

``fit_to_original(converted, original, batches, steps)``: for each converted attention layer in order, the inputs the
*converted* model gives it (its hidden states and every other argument the model passes: masks, rotary positions;
no cache) are captured, and only that converted layer's parameters are trained (Adam, one of the given batches per
step, cosine decay) to minimise ``||conv(X) - Y||^2 / ||Y||^2`` over the non-padding tokens. The target ``Y``
(``target=``):

- ``"layer"`` (the default): the original's attention layer on the same inputs, ``orig(X)``;
- ``"prefix"``: the original's attention layer on the inputs the *original* model gives it, ``orig(X_orig)``;
- ``"residual"``: what makes the residual stream after the attention equal the original's,
  ``orig(X_orig) + h_orig - h``, with ``h`` the stream entering the layer's block (the attention output is added to
  it, before or after a norm, in every family here): each layer also corrects the drift the converted layers before
  it left in the stream.

``solve_output=True`` also sets the layer's output projection (the last linear map of its output: the module's own,
or BERT's beside it) to its least-squares optimum on all the fitting tokens, before the Adam steps and after them:
the output is linear in that projection's weight and bias, so given the rest of the layer the solve is exact
(normal equations in float64, a ridge of ``1e-8`` of the mean diagonal for rank-deficient inputs).

``inputs="original"`` instead gives every converted layer the inputs the *original* model gives it (the layers are
then fitted independently of each other, and only ``target="layer"`` applies): what ``collab_attn.allocate_cache``
measures candidate sizes with, each layer on the same inputs whatever the other layers are. The output is
compared after the output projection: where the model keeps that projection beside the attention module (BERT,
RoBERTa), the converted model's projection is part of the layer fitted. Each layer keeps the better of its weights
before and after the fit, measured on all the fitting tokens, so an exact conversion stays exact. Nothing else moves:
not the cache layout or sizes, not the buffers, not the other layers.

One routine for every method and family: the converted layers are found as the conversion left them (at the names of
the original's attention modules, ``find_attention``), and the model is run block by block (the element of a
``ModuleList`` that holds each attention layer: a decoder or encoder layer), each block on the output of the one
before, so that every layer's inputs include what the fitted layers before it changed. That the blocks chain this way
is checked on the first batch before anything is fitted. A layer called several times per pass (ALBERT's shared
layer) is fitted once, on the inputs of all its calls.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from collab_attn.fitting.checks import check_seed_and_progress, check_source, checked_batches
from collab_attn.fitting.passes import HookedPasses
from collab_attn.models.families import family_of

TARGETS = ("layer", "prefix", "residual")
DEFAULT_LEARNING_RATE = 3e-3  # SmolLM2-135M: 1e-3 and 3e-3 fit its layers, 1e-2 overshoots (kept the conversion)


@dataclass
class LayerFit:
    """One layer's fit: the relative output error on the fitting tokens before it and after it (of the weights the
    layer keeps: ``error_after <= error_before``), the error the trained weights reached (``fitted_error``; kept only
    when lower: ``kept_fit``), and the seconds it took (inputs, targets and steps)."""

    name: str
    error_before: float
    error_after: float
    fitted_error: float
    kept_fit: bool
    calls: int  # captured calls of the layer (batches x calls per pass)
    seconds: float


@dataclass
class FitReport:
    steps: int
    learning_rate: float
    tokens: int  # non-padding fitting tokens per pass
    target: str = "layer"  # what each layer was fitted to (``TARGETS``)
    solve_output: bool = False  # the output projection solved by least squares before and after the steps
    layers: list[LayerFit] = field(default_factory=list)
    capture_seconds: float = 0.0  # the first passes of both models (before the layers' own seconds)
    cpu_seconds: float = 0.0  # processor time of the whole fit (this process, all its threads)

    @property
    def seconds(self) -> float:
        """Wall time of the whole fit: the first passes and every layer."""
        return self.capture_seconds + sum(layer.seconds for layer in self.layers)

    def to_dict(self) -> dict:
        return {"steps": self.steps, "learning_rate": self.learning_rate, "tokens": self.tokens,
                "target": self.target, "solve_output": self.solve_output, "seconds": self.seconds,
                "capture_seconds": self.capture_seconds, "cpu_seconds": self.cpu_seconds,
                "layers": [asdict(layer) for layer in self.layers]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """A per-layer Markdown table with a mean row."""
        rows = ["| layer | error before | after | fit reached | kept fit | seconds |",
                "|---|---:|---:|---:|:---:|---:|"]
        for layer in self.layers:
            rows.append(f"| {layer.name} | {layer.error_before:.4f} | {layer.error_after:.4f} | "
                        f"{layer.fitted_error:.4f} | {'yes' if layer.kept_fit else 'no'} | {layer.seconds:.2f} |")
        count = len(self.layers)
        solved = ", output solved" if self.solve_output else ""
        rows.append(f"| mean ({self.steps} steps, {self.tokens:,} tokens, target {self.target}{solved}) | "
                    f"{sum(x.error_before for x in self.layers) / count:.4f} | "
                    f"{sum(x.error_after for x in self.layers) / count:.4f} | "
                    f"{sum(x.fitted_error for x in self.layers) / count:.4f} | "
                    f"{sum(x.kept_fit for x in self.layers)}/{count} | {self.seconds:.2f} |")
        return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------------------
# Checks


def _check_arguments(steps, learning_rate, target, inputs, solve_output, seed=0, progress=True) -> None:
    if not isinstance(solve_output, bool):
        raise ValueError(f"solve_output must be True or False, got {solve_output!r}")
    check_seed_and_progress(seed, progress)
    if type(steps) is not int or steps < 1:
        raise ValueError(f"steps must be a positive number of optimizer steps per layer, got {steps!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(map(repr, TARGETS))} (what each layer is fitted to), "
                         f"got {target!r}")
    if inputs not in ("converted", "original"):
        raise ValueError(f"inputs must be 'converted' or 'original' (which model's inputs each layer is fitted on), "
                         f"got {inputs!r}")
    if inputs == "original" and target != "layer":
        raise ValueError(f"target={target!r} corrects what the converted layers before it changed, which "
                         "inputs='original' leaves out: use target='layer' with inputs='original'")
    if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}")


# ---------------------------------------------------------------------------------------------------------------
# Capture: the blocks of one forward pass, and the original's attention arguments


def _block_of(model: nn.Module, name: str) -> str:
    """The deepest ancestor of module ``name`` that is an element of a ``ModuleList``: the model's layer (block)."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if isinstance(model.get_submodule(".".join(parts[:end - 1])), nn.ModuleList):
            return ".".join(parts[:end])
    raise NotImplementedError(f"{name} is in no ModuleList of {type(model).__name__}: fit_to_original runs a model "
                              "layer by layer and cannot find its layers")


@dataclass
class _Call:
    """One call of a module: where its hidden states were (an argument position or ``hidden_states``) and every
    other argument."""

    args: tuple
    kwargs: dict
    positional: bool

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> tuple[_Call, torch.Tensor]:
        if args:
            return cls(args[1:], kwargs, True), args[0]
        kwargs = dict(kwargs)
        return cls((), kwargs, False), kwargs.pop("hidden_states")

    def __call__(self, module: nn.Module, hidden: torch.Tensor):
        if self.positional:
            return module(hidden, *self.args, **self.kwargs)
        return module(**self.kwargs, hidden_states=hidden)


def _one_call(calls: list[_Call]) -> bool:
    """Whether ``calls`` pass the same objects (the model builds its masks and rotary positions once a pass and hands
    them to every layer): then a later pass is captured at its first call and that call stands for all of them."""
    first = calls[0]
    return all(call.positional == first.positional and len(call.args) == len(first.args)
               and all(a is b for a, b in zip(call.args, first.args)) and call.kwargs.keys() == first.kwargs.keys()
               and all(call.kwargs[key] is first.kwargs[key] for key in first.kwargs) for call in calls)


def _hidden_of(output, like: torch.Tensor) -> torch.Tensor:
    """A block's output hidden states: the output, or its first tensor shaped like its input."""
    if isinstance(output, torch.Tensor):
        return output
    for item in output:
        if isinstance(item, torch.Tensor) and item.shape == like.shape:
            return item
    raise NotImplementedError("a block returned no hidden states shaped like its input")


def forward_kwargs(model: nn.Module) -> dict:
    """``use_cache=False`` where ``model``'s forward takes it: every pass of a fit runs without a key/value cache."""
    import inspect

    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


@torch.no_grad()
def _capture_blocks(model: nn.Module, blocks: dict[str, nn.Module], batches: list[dict]):
    """Per batch: every block call of one pass of ``model`` (module name, ``_Call``), and the hidden states entering
    the first; for the first batch the hidden states entering every call (to check the chain). Where the first pass
    gives every block the same arguments (``_one_call``), a later pass ends at its first block."""
    calls: list[list[tuple[str, _Call]]] = []
    first: list[torch.Tensor] = []
    seen: list[torch.Tensor] = []

    def record(name, module, args, kwargs):
        call, hidden = _Call.of(args, kwargs)
        calls[-1].append((name, call))
        if len(calls[-1]) == 1:
            first.append(hidden.detach())
        if len(calls) == 1:
            seen.append(hidden.detach())

    options = forward_kwargs(model)
    with HookedPasses(model, blocks, record) as passes:
        for batch in batches:
            calls.append([])
            passes.run({**batch, **options})
            if passes.stop_at is None:
                passes.stop_at = 1 if _one_call([call for _, call in calls[0]]) else len(calls[0])
            elif len(calls[-1]) != passes.stop_at:
                raise NotImplementedError("the model calls its layers in another order for another batch")
            if len(calls[-1]) < len(calls[0]):  # every block takes the first call's arguments
                calls[-1] = [(name, calls[-1][0][1]) for name, _ in calls[0]]
    return calls, first, seen


@torch.no_grad()
def _capture_attention(model: nn.Module, names: list[str], batches: list[dict]) -> dict[str, list[list[_Call]]]:
    """Per attention module of ``model``, per batch, its calls' arguments besides the hidden states. Where the first
    pass calls each module once and all with the same arguments (``_one_call``), a later pass ends at its first
    attention call."""
    calls = {name: [] for name in names}

    def record(name, module, args, kwargs):
        calls[name][-1].append(_Call.of(args, kwargs)[0])

    shared, options = False, forward_kwargs(model)
    with HookedPasses(model, {name: model.get_submodule(name) for name in names}, record) as passes:
        for index, batch in enumerate(batches):
            for name in names:
                calls[name].append([])
            passes.run({**batch, **options})
            if index == 0:
                firsts = [calls[name][0] for name in names]
                shared = all(len(first) == 1 for first in firsts) and _one_call([first[0] for first in firsts])
                passes.stop_at = 1 if shared else passes.calls
            elif shared:  # the first call made (the first layer's) stands for every layer
                call = next(calls[name][-1][0] for name in names if calls[name][-1])
                for name in names:
                    calls[name][-1] = [call]
    return calls


# ---------------------------------------------------------------------------------------------------------------
# The fit


class _Output(nn.Module):
    """An attention layer's output after its output projection: the module's, then the one beside it (BERT)."""

    def __init__(self, attention: nn.Module, outer: nn.Module | None):
        super().__init__()
        self.attention, self.outer = attention, outer

    def forward(self, call: _Call, hidden: torch.Tensor) -> torch.Tensor:
        output = call(self.attention, hidden)
        output = output[0] if isinstance(output, (tuple, list)) else output
        return output if self.outer is None else self.outer(output)


def _squared(diff: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (diff.double().pow(2).sum(-1) * mask).sum()


@torch.no_grad()
def _error(layer: _Output, items: list) -> float:
    num = den = 0.0
    for call, hidden, target, mask in items:
        num += float(_squared(layer(call, hidden) - target, mask))
        den += float(_squared(target, mask))
    return num / max(den, 1e-300)


def _projection(layer: _Output) -> nn.Linear:
    """The last linear map of the layer's output: BERT's projection beside the module, else the module's own."""
    projection = layer.outer if layer.outer is not None else getattr(layer.attention, "output", None)
    if not isinstance(projection, nn.Linear):
        raise ValueError("solve_output=True needs an output projection (nn.Linear) at the end of each converted "
                         f"layer; {type(layer.attention).__name__} has {type(projection).__name__}: pass "
                         "solve_output=False")
    return projection


@torch.no_grad()
def _solve_output(layer: _Output, items: list) -> None:
    """Set the output projection to the least-squares fit of the targets from its inputs on every fitting token."""
    projection = _projection(layer)
    captured = []
    handle = projection.register_forward_hook(lambda module, args, output: captured.append((args[0], output)))
    gram = cross = None
    try:
        for call, hidden, target, mask in items:
            captured.clear()
            output = layer(call, hidden)
            if len(captured) != 1 or not torch.equal(captured[0][1], output):
                raise NotImplementedError(f"{type(layer.attention).__name__}'s output is not its output projection's "
                                          "(something follows it): solve_output=True cannot solve it; pass False")
            inputs = captured[0][0].reshape(-1, projection.in_features).double()
            if projection.bias is not None:
                inputs = torch.cat([inputs, inputs.new_ones(len(inputs), 1)], dim=1)
            weighted = inputs * mask.reshape(-1, 1).double()
            part = (weighted.T @ inputs, weighted.T @ target.reshape(len(inputs), -1).double())
            gram, cross = part if gram is None else (gram + part[0], cross + part[1])
    finally:
        handle.remove()
    ridge = 1e-8 * gram.diagonal().mean().clamp_min(1e-300)
    solution = torch.linalg.solve(gram + ridge * torch.eye(len(gram), dtype=gram.dtype), cross).T
    projection.weight.copy_(solution[:, :projection.in_features])
    if projection.bias is not None:
        projection.bias.copy_(solution[:, projection.in_features])


def cosine_adam(params: list[nn.Parameter], learning_rate: float, steps: int):
    """Adam at ``learning_rate``, decayed to 0 over ``steps`` on a cosine: the fits' optimizer and its schedule."""
    optimizer = torch.optim.Adam(params, lr=learning_rate)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))


def _train(layer: _Output, params: list[nn.Parameter], items: list, steps: int, learning_rate: float,
           generator: torch.Generator, progress) -> None:
    optimizer, schedule = cosine_adam(params, learning_rate, steps)
    order: list[int] = []
    for _ in progress:
        if not order:
            order = torch.randperm(len(items), generator=generator).tolist()
        call, hidden, target, mask = items[order.pop()]
        output = layer(call, hidden)
        loss = _squared(output - target, mask).float() / _squared(target, mask).float().clamp_min(1e-30)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)


def fit_to_original(
    converted: nn.Module,
    original: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    steps: int = 100,
    *,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    seed: int = 0,
    target: str = "layer",
    inputs: str = "converted",
    solve_output: bool = False,
    progress: bool = True,
) -> FitReport:
    """Train each converted attention layer of ``converted`` (in place, in order) to give the output of
    ``original``'s attention layer at the same place on the inputs the converted model gives it; see the module doc.

    ``batches``: tokenized batches as ``collect_calibration`` takes them (dicts with ``input_ids``,
    ``attention_mask``, ...; other keys are ignored), the fitting tokens; each optimizer step uses one of them (in a
    seeded random order), so their size is the minibatch. ``steps``: Adam steps per layer, ``learning_rate`` its
    initial rate (cosine decay to 0). ``target``: what each layer is fitted to, ``"layer"``, ``"prefix"`` or
    ``"residual"`` (see the module doc); ``inputs``: ``"converted"`` (each layer on the inputs the converted layers
    before it give it) or ``"original"`` (on the original's, each layer independently). Both models are run in eval
    mode (no dropout) and left in the mode they were in. Returns a ``FitReport``: per layer the relative output error
    before and after (the weights kept). ``solve_output``: the output projection also solved by least squares
    before and after the steps (see the module doc)."""
    _check_arguments(steps, learning_rate, target, inputs, solve_output, seed, progress)
    names = check_source(converted, original)
    device = next(converted.parameters()).device
    batches = checked_batches(original, batches, device)
    family = family_of(original.config)
    modes = [(m, m.training) for m in (converted, original)]
    converted.eval()
    original.eval()
    cpu = time.process_time()
    try:
        report = _fit(converted, original, family, names, batches, steps, learning_rate, seed, target, inputs,
                      solve_output, progress)
        report.cpu_seconds = time.process_time() - cpu
        return report
    finally:
        for model, mode in modes:
            model.train(mode)


def _fit(converted, original, family, names, batches, steps, learning_rate, seed, target, inputs,
         solve_output, progress) -> FitReport:
    start = time.perf_counter()
    block_names = list(dict.fromkeys(_block_of(converted, name) for name in names))
    blocks = {name: converted.get_submodule(name) for name in block_names}
    layer_of_block = {_block_of(converted, name): name for name in names}
    calls, state, seen = _capture_blocks(converted, blocks, batches)
    _check_chain(blocks, calls[0], seen)
    isolated = inputs == "original"
    own = target != "layer" or isolated  # the original's own inputs: the original is run block by block beside it
    if own:
        theirs = {name: original.get_submodule(name) for name in block_names}
        their_calls, their_state, _ = _capture_blocks(original, theirs, batches)
    else:
        arguments = _capture_attention(original, names, batches)
    masks = [batch.get("attention_mask", torch.ones_like(batch["input_ids"])).to(state[0].dtype) for batch in batches]
    report = FitReport(steps, float(learning_rate), int(sum(mask.sum() for mask in masks)), target, solve_output,
                       capture_seconds=time.perf_counter() - start)
    generator = torch.Generator().manual_seed(seed)
    sequence = [name for name, _ in calls[0]]
    position = 0
    for name in names:
        start = time.perf_counter()
        indices = [k for k, block in enumerate(sequence) if layer_of_block[block] == name]
        if not isolated:
            state = _advance(blocks, calls, sequence, state, position, indices[0])
        outer = None if family.output is not None else family.output_projection_name(name)
        layer = _Output(converted.get_submodule(name), None if outer is None else converted.get_submodule(outer))
        reference = _Output(original.get_submodule(name), None if outer is None else original.get_submodule(outer))
        if own:
            their_state = _advance(theirs, their_calls, sequence, their_state, position, indices[0])
            their_items = _inputs(original, theirs, their_calls, sequence, their_state, indices[0], indices, name)
        items = their_items if isolated else _inputs(converted, blocks, calls, sequence, state, indices[0], indices,
                                                     name)
        fitted = []
        with torch.no_grad():
            for k, (call, hidden, batch, rank, stream) in enumerate(items):
                if own:
                    their_call, their_hidden, _, _, their_stream = their_items[k]
                    goal = reference(their_call, their_hidden)
                    if target == "residual":
                        goal = goal + (their_stream - stream)
                else:
                    goal = reference(arguments[name][batch][rank], hidden)
                fitted.append((call, hidden, goal.detach(), masks[batch]))
        del items
        params = [p for p in layer.parameters() if p.requires_grad]
        saved = [p.detach().clone() for p in params]
        before = _error(layer, fitted)
        if solve_output:
            _solve_output(layer, fitted)
        bar = tqdm(range(steps), desc=f"fit {name}", disable=not progress, leave=False)
        with torch.enable_grad():  # also when called under torch.no_grad()
            _train(layer, params, fitted, steps, learning_rate, generator, bar)
        if solve_output:
            _solve_output(layer, fitted)
        after = _error(layer, fitted)
        kept = after < before
        if not kept:
            with torch.no_grad():
                for param, value in zip(params, saved):
                    param.copy_(value)
        report.layers.append(LayerFit(name, before, after if kept else before, after, kept, len(fitted),
                                      time.perf_counter() - start))
        if not isolated:
            state = _advance(blocks, calls, sequence, state, indices[0], indices[-1] + 1)
        if own:
            their_state = _advance(theirs, their_calls, sequence, their_state, indices[0], indices[-1] + 1)
        position = indices[-1] + 1
    return report


@torch.no_grad()
def _advance(blocks, calls, sequence, state, start: int, stop: int) -> list[torch.Tensor]:
    """The hidden states entering block call ``stop`` for every batch, from those entering call ``start``."""
    for k in range(start, stop):
        if k >= len(sequence):
            break
        state = [_hidden_of(calls[b][k][1](blocks[sequence[k]], hidden), hidden) for b, hidden in enumerate(state)]
    return state


@torch.no_grad()
def _inputs(model, blocks, calls, sequence, state, start: int, indices: list[int], name: str) -> list:
    """The attention layer ``name``'s inputs at its calls ``indices`` (block calls from ``start``, the block run up to
    the layer at the last one): (``_Call`` without the hidden states, hidden states, batch index, the call's number
    among the layer's calls in one pass, the hidden states entering the block) per batch and call."""
    captured = []
    current = [0, 0, None]

    def record(_, module, args, kwargs):
        call, hidden = _Call.of(args, kwargs)
        captured.append((call, hidden.detach(), *current))

    with HookedPasses(model, {name: model.get_submodule(name)}, record) as passes:
        for k in range(start, indices[-1] + 1):
            passes.stop_at = 1 if k == indices[-1] else None  # the last block call: only up to the layer
            following = []
            for b, hidden in enumerate(state):
                current[:] = [b, indices.index(k) if k in indices else -1, hidden]
                ended, output = passes.call(calls[b][k][1], blocks[sequence[k]], hidden)
                if not ended:
                    following.append(_hidden_of(output, hidden))
            state = following
    return captured


@torch.no_grad()
def _check_chain(blocks, calls: list, seen: list[torch.Tensor]) -> None:
    """Each block call's output is the next call's input (on the first batch): the model does nothing between its
    layers, so running it block by block is running it."""
    for k in range(len(calls) - 1):
        name, call = calls[k]
        output = _hidden_of(call(blocks[name], seen[k]), seen[k])
        scale = seen[k + 1].abs().max().clamp_min(1e-12)
        if output.shape != seen[k + 1].shape or (output - seen[k + 1]).abs().max() > 1e-4 * scale:
            raise NotImplementedError(
                f"{type(next(iter(blocks.values()))).__name__} call {k + 1} does not take what call {k} returns: this "
                "model does more between its layers than fit_to_original can run layer by layer"
            )
