"""Typed method settings: the ``collab`` config group as one validated object, built once per run.

``MethodSettings.from_config(cfg["collab"])`` turns the composed group (``configs/collab/<method>.yaml`` plus
overrides) into a ``MethodSettings``: the method (``collab_attn.models.methods``), the rank or budget, the method's
own options dataclass, and what the method needs measured first (``CalibrationSettings`` for a method that can be
fitted to activations, ``ImportanceSettings`` for one that ranks heads). The keys a method's group takes are derived
from the method (``group_keys``): ``method``, ``rank``, ``budget`` where it takes budgets, its options' fields,
``calibration*`` and ``importance_*`` where it needs them; their defaults are the dataclasses' and a test holds each
YAML group to them. Unknown keys, wrong types and values a method cannot take stop here, with the key named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from collab_attn import cli
from collab_attn.decomposition.rank_selection import RankBudget
from collab_attn.models import importance
from collab_attn.models.conversion import BANDS, check_request, cuts_values_on_rotary_models
from collab_attn.models.methods import METHODS, ConversionMethod, get_method
from collab_attn.own_text import OWN_TEXTS
from collab_attn.texts import CALIBRATION_SAMPLES, DEFAULT_MAX_LENGTH

NO_CONVERSION = "none"  # keep the concatenated heads (a GLUE pipeline baseline)


def choices() -> tuple[str, ...]:
    """What ``collab.method`` may be: ``none`` or a registered method (read when asked: methods registered later
    count)."""
    return (NO_CONVERSION, *METHODS)

AWARE = "-aware"  # the label suffix of an activation-aware fit


def labels() -> tuple[str, ...]:
    """The method labels of a grid without solver choices: ``none``, each method, and each calibrated method's
    activation-aware form (``cp``, ``cp-aware``, ...)."""
    return (NO_CONVERSION, *(n for n, m in METHODS.items() for n in ((n, n + AWARE) if m.calibrated else (n,))))


def parse_label(label: str) -> tuple[ConversionMethod | None, bool]:
    """``labels()``'s entry ``label`` as (method, activation-aware); (None, False) for ``none``."""
    if label not in labels():
        raise ValueError(f"unknown method {label!r}; choose one of {labels()}")
    if label == NO_CONVERSION:
        return None, False
    aware = label.endswith(AWARE)
    return METHODS[label.removesuffix(AWARE) if aware else label], aware


def _positive_int(name: str, value) -> None:
    if not (type(value) is int and value > 0):
        raise ValueError(f"collab.{name} must be a positive integer, got {value!r}")


OWN_TEXT = "own"  # collab.calibration=own: the original model's own samples (collab_attn.own_text)
# or sampled another way: collab.calibration=owncode, ownnucleus, ... (collab_attn.own_text.OWN_TEXTS)
OWN_WINDOWS = 64  # own text (or a decoder's text file): windows calibrated and layer-fitted on (16,384 tokens, as
OWN_LENGTH = 256  # the SmolLM2 race), of this many tokens each


@dataclass(frozen=True)
class CalibrationSettings:
    """Activation-aware fitting: the texts to calibrate on (``source``: a text file with one text per line, a GLUE
    train.tsv/dev.tsv, ``"task"``, the task's training texts in the GLUE pipeline, or ``"own"``, the original
    decoder's own samples), how many are sampled and how long each may be in tokens (None: ``CALIBRATION_SAMPLES``
    texts of at most ``DEFAULT_MAX_LENGTH`` tokens, or ``OWN_WINDOWS`` windows of ``OWN_LENGTH`` of own text).
    ``windows``: a text file read as windows, as own text is (a decoder's, ``scripts/reparametrize.py``), not line by
    line."""

    source: str
    samples: int | None = None
    max_length: int | None = None
    windows: bool = False

    def __post_init__(self):
        if not (isinstance(self.source, str) and self.source.strip()):
            raise ValueError(f"collab.calibration must be a file path, 'task', {', '.join(map(repr, OWN_TEXTS))} or "
                             f"null, got {self.source!r}")
        if self.windows and (self.from_own or self.from_task or self.source.endswith(".tsv")):
            raise ValueError(f"collab.calibration={self.source}: only a text file is read as windows")
        if self.samples is None:
            object.__setattr__(self, "samples", OWN_WINDOWS if self.from_windows else CALIBRATION_SAMPLES)
        if self.max_length is None:
            object.__setattr__(self, "max_length", OWN_LENGTH if self.from_windows else DEFAULT_MAX_LENGTH)
        _positive_int("calibration_samples", self.samples)
        _positive_int("calibration_max_length", self.max_length)
        if self.from_windows and self.max_length < 2:
            raise ValueError(f"collab.calibration_max_length={self.max_length}: a window holds the "
                             "beginning-of-text token and at least one more")

    @property
    def from_task(self) -> bool:
        return self.source == "task"

    @property
    def from_own(self) -> bool:
        return self.source in OWN_TEXTS

    @property
    def from_windows(self) -> bool:
        """Whether the fits read windows (own text, or a text file read as windows) rather than texts."""
        return self.from_own or self.windows


@dataclass(frozen=True)
class ImportanceSettings:
    """Head importance (``collab_attn.models.importance.head_importance``): the mean over ``samples`` labelled
    training examples, drawn with the job's seed; ``batch_size`` changes speed and memory only."""

    samples: int = importance.DEFAULT_SAMPLES
    batch_size: int = importance.DEFAULT_BATCH_SIZE

    def __post_init__(self):
        _positive_int("importance_samples", self.samples)
        _positive_int("importance_batch_size", self.batch_size)


# The flat keys of the config group that the two dataclasses above read, and their fields.
CALIBRATION_KEYS = {"calibration": "source", "calibration_samples": "samples",
                    "calibration_max_length": "max_length"}
IMPORTANCE_KEYS = {"importance_samples": "samples", "importance_batch_size": "batch_size"}


def rank_tag(rank) -> str:
    """A rank, per-layer ranks or a budget as names carry it: ``128``, ``384-128``, ``mean128``."""
    return "-".join(map(str, rank)) if isinstance(rank, list) else str(rank).replace(":", "")


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


# The fits after a conversion, by their step setting: what a step is and what the fit does
STEPS = {"fit_steps": ("steps per layer", "fits the converted layers"),
         "e2e_steps": ("optimizer steps", "fits the converted layers end to end"),
         "distill_steps": ("optimizer steps", "distils every weight")}


def group_keys(method: ConversionMethod) -> dict:
    """The keys of ``method``'s config group besides ``method`` and ``rank``, with their defaults."""
    keys = {"budget": None} if method.budgets else {}
    if cuts_values_on_rotary_models(method):  # key-svd shares its values on rotary models only
        keys["value_rank"] = None
    if method.rotary_budgets:  # rotary models: each layer's split of the pairs among the bands, or one for all
        keys["bands"] = None  # null: per-layer
    keys.update(_defaults(method.options))
    if method.calibrated:
        fields = {**_defaults(CalibrationSettings), "source": None}  # sizes None: by source
        keys.update({key: fields[field] for key, field in CALIBRATION_KEYS.items()})
        keys["fit_steps"] = None  # fit_to_original on the calibration texts after the conversion (null or 0: off)
        keys["e2e_steps"] = None  # then fit_end_to_end on the same texts (null or 0: off)
        keys["e2e_texts"] = None  # fit_end_to_end on these texts instead (a file; null: the calibration texts)
        keys["distill_steps"] = None  # then every weight distilled from the original (decoders; null or 0: off)
    if method.needs_importance:
        fields = _defaults(ImportanceSettings)
        keys.update({key: fields[field] for key, field in IMPORTANCE_KEYS.items()})
    return keys


def all_group_keys() -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for m in METHODS.values() for k in ("method", "rank", *group_keys(m))))


@dataclass(frozen=True)
class MethodSettings:
    """How to cut the query/key parameters of a model (one ``collab`` group)."""

    method: str  # a registered conversion method, or "none"
    rank: int | list[int] | None = None  # key/query size D~: one int, or one per attention layer
    budget: str | None = None  # per-layer ranks under a global budget ("params:F", "mean:R", "energy:E")
    options: object = None  # the method's options dataclass (None for "none")
    value_rank: int | list[int] | None = None  # shared values: D_v, one int or one per layer (None: per-head values)
    calibration: CalibrationSettings | None = None  # None: fit the raw weights
    importance: ImportanceSettings | None = None
    # after the conversion, each converted layer trained this many steps to give the original's attention output on
    # the calibration texts (collab_attn.fit_to_original); None: no fit (0 in a config means the same)
    fit_steps: int | None = None
    # then all the converted layers together trained this many steps to give the original's output on the same texts
    # (collab_attn.fit_end_to_end); None: no end-to-end fit
    e2e_steps: int | None = None
    # the texts of that end-to-end fit instead of the calibration texts (a text file or a GLUE train.tsv/dev.tsv):
    # fresh text, one batch of it per step; None: the calibration texts
    e2e_texts: str | None = None
    # then every weight of the converted model (a decoder) trained this many steps on the original's next-token
    # distributions, on windows of the same texts (collab_attn.pretrained.distill); None: no distillation
    distill_steps: int | None = None
    # rotary models (cp, tucker, key-svd): "per-layer" splits of the shared pairs among the bands, or "shared": one
    # split for every layer (what a standard checkpoint holds: collab_attn.export)
    bands: str = "per-layer"

    @classmethod
    def from_config(cls, collab: Mapping) -> MethodSettings:
        """The settings of a composed ``collab`` group (a plain dict or a DictConfig). A key no method takes is
        refused; one that another method takes must be unset (null). ``none`` takes every key and ignores them:
        ``collab=cp collab.method=none`` is a documented run."""
        if hasattr(collab, "_metadata"):  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            collab = OmegaConf.to_container(collab, resolve=True)
        known = all_group_keys()
        for key in collab:
            if key not in known:
                raise ValueError(f"unknown key collab.{key}; the collab group takes {', '.join(known)}")
        name = collab.get("method")
        if name is None:
            raise ValueError("collab.method is missing; choose one of " + ", ".join(choices()))
        if name not in choices():
            raise ValueError(f"unknown collab.method {name!r}; choose one of {choices()}")
        if name == NO_CONVERSION:
            return cls(NO_CONVERSION)
        method = get_method(name)
        takes = group_keys(method)
        for key, value in collab.items():
            if key not in ("method", "rank", *takes) and value is not None:
                raise ValueError(
                    f"collab.{key} does not apply to collab.method={name}; pick the method's group "
                    f"(collab={name}) rather than collab.method={name}, or set collab.{key}=null"
                )
        given = {k: v for k, v in collab.items() if v is not None}
        options = {k: given[k] for k in method.option_names if k in given}
        try:
            options = method.options(**options)
        except (TypeError, ValueError) as err:
            raise ValueError(f"collab.{err}") from err
        calibration = None
        if method.calibrated and (given.get("calibration") is not None or given.get("fit_steps")
                                  or given.get("e2e_steps") or given.get("distill_steps")):  # else own text
            calibration = CalibrationSettings(**{"source": OWN_TEXT} | {
                f: given[k] for k, f in CALIBRATION_KEYS.items() if k in given})
        importance = None
        if method.needs_importance:
            importance = ImportanceSettings(**{f: given[k] for k, f in IMPORTANCE_KEYS.items() if k in given})
        steps = {}
        for key, (what, _) in STEPS.items():
            value = given.get(key)
            if value is not None and not (type(value) is int and value >= 0):
                raise ValueError(f"collab.{key} must be a number of {what} (0 or null: no fit), got {value!r}")
            steps[key] = value or None
        return cls(name, collab.get("rank"), collab.get("budget"), options, collab.get("value_rank"), calibration,
                   importance, **steps, e2e_texts=given.get("e2e_texts"), bands=given.get("bands") or "per-layer")

    def __post_init__(self):
        if self.method == NO_CONVERSION:
            return
        method = get_method(self.method)
        if self.options is None:
            object.__setattr__(self, "options", method.options())
        if not isinstance(self.options, method.options):
            raise TypeError(f"collab.method={self.method} takes {method.options.__name__}, got {self.options!r}")
        if self.budget is not None:
            if not isinstance(self.budget, str):
                raise ValueError(f"collab.budget must be a string such as 'mean:128' or null, got {self.budget!r}")
            RankBudget.parse(self.budget)
        else:
            rank = self.rank
            is_int = type(rank) is int
            ok = is_int or (isinstance(rank, (list, tuple)) and rank and all(type(r) is int for r in rank))
            if not ok:
                raise ValueError(f"collab.rank must be an integer or a list of integers (one per layer), got {rank!r}")
            if isinstance(rank, tuple):
                object.__setattr__(self, "rank", list(rank))
        for key, (unit, what) in STEPS.items():  # each fit after the conversion reads the calibration texts
            steps = getattr(self, key)
            if steps is not None and not (type(steps) is int and steps > 0):
                raise ValueError(f"collab.{key} must be a positive number of {unit} or null, got {steps!r}")
            if steps is not None and self.calibration is None:
                raise ValueError(f"collab.{key}={steps} {what} on the calibration texts: set collab.calibration too "
                                 "(a text file, a GLUE train.tsv/dev.tsv or own)")
        if self.e2e_texts is not None:
            if not (isinstance(self.e2e_texts, str) and self.e2e_texts.strip()):
                raise ValueError(f"collab.e2e_texts must be a file path or null, got {self.e2e_texts!r}")
            if self.e2e_steps is None and self.distill_steps is None:
                raise ValueError(f"collab.e2e_texts={self.e2e_texts} is what the end-to-end fit and the distillation "
                                 "train on: set collab.e2e_steps or collab.distill_steps too, or collab.e2e_texts=null")
        if self.bands not in BANDS:
            raise ValueError(f"collab.bands must be one of {', '.join(BANDS)}, got {self.bands!r}")
        if self.bands != "per-layer" and not method.rotary_budgets:
            raise ValueError(f"collab.bands={self.bands} does not apply to collab.method={self.method}: it splits no "
                             "shared pairs among rotary bands")
        value = self.value_rank
        if value is not None:
            is_int = type(value) is int and value > 0
            if not (is_int or (isinstance(value, (list, tuple)) and value and all(type(v) is int for v in value))):
                raise ValueError(f"collab.value_rank must be a positive integer, a list of them (one per layer) or "
                                 f"null, got {value!r}")
            if isinstance(value, tuple):
                object.__setattr__(self, "value_rank", list(value))

    def to_group(self) -> dict:
        """The settings as the flat ``collab`` group their method takes (``from_config``'s inverse): every key of
        ``group_keys``, set or at its default; calibration keys at their defaults when calibration is off."""
        if not self.converts:
            return {"method": self.method}
        group = {"method": self.method, "rank": self.rank, **group_keys(self.conversion)}
        group.update(dataclasses.asdict(self.options))
        if self.conversion.budgets:
            group["budget"] = self.budget
        if cuts_values_on_rotary_models(self.conversion):
            group["value_rank"] = self.value_rank
        group.pop("bands", None)
        if self.bands != "per-layer":  # the default is left out: the keys of jobs made before it stay as they were
            group["bands"] = self.bands
        for settings, keys in ((self.calibration, CALIBRATION_KEYS), (self.importance, IMPORTANCE_KEYS)):
            if settings is not None:
                group.update({key: getattr(settings, field) for key, field in keys.items()})
        for key in ("fit_steps", "e2e_steps", "e2e_texts", "distill_steps"):
            if getattr(self, key) is not None:
                group[key] = getattr(self, key)
        return group

    # ----------------------------------------------------------------------------------------------------------
    # What the library and the results need

    @property
    def conversion(self) -> ConversionMethod | None:
        return None if self.method == NO_CONVERSION else METHODS[self.method]

    @property
    def converts(self) -> bool:
        """False for ``none`` (the model keeps its concatenated heads)."""
        return self.method != NO_CONVERSION

    @property
    def rank_request(self):
        """What ``reparametrize`` is asked for: the budget string when one is set, else the rank(s)."""
        return self.budget if self.budget else self.rank

    @property
    def label(self) -> str:
        """The method as results and tables name it: its name, then ``-tensorly`` for the paper's dense solver,
        ``-v<D_v>`` for shared values and ``-aware`` for activation-aware fitting."""
        label = self.method
        label += "-tensorly" if getattr(self.options, "solver", None) == "tensorly" else ""
        label += "" if self.value_rank is None else f"-v{rank_tag(self.value_rank)}"
        label += AWARE if self.calibration is not None else ""
        return label

    def keeps_full_size(self, width: int) -> bool:
        """Whether every layer keeps its full key/query size ``width`` (an exact conversion: nothing to fit)."""
        if self.budget:
            return False
        ranks = self.rank if isinstance(self.rank, list) else [self.rank]
        return all(r == width for r in ranks)

    def record_rank(self, report=None):
        """The rank a results record shows: the configured one, or the per-layer ranks a budget chose."""
        if not self.converts:
            return None
        if self.budget and report is not None:
            return [layer.rank for layer in report.layers]
        return self.rank_request

    def reparametrize_kwargs(self) -> dict:
        """``rank``, ``method`` and the method's options as arguments of ``collab_attn.reparametrize``; the caller
        adds ``seed``, ``calibration=`` / ``importance=`` (measured first) and ``progress``."""
        if not self.converts:
            raise ValueError("collab.method=none keeps the concatenated heads: there is nothing to reparametrize")
        shared = {} if self.value_rank is None else {"value_rank": self.value_rank}
        bands = {} if self.bands == "per-layer" else {"bands": self.bands}
        return {"rank": self.rank_request, "method": self.method, **shared, **bands, **dataclasses.asdict(self.options)}

    def refuse_fit(self, entry_point: str) -> None:
        """For an entry point that does not fit the converted layers to the original: refuse ``collab.fit_steps``,
        ``collab.e2e_steps`` and ``collab.distill_steps`` rather than ignore them."""
        for key in STEPS:
            if getattr(self, key):
                raise ValueError(f"collab.{key}={getattr(self, key)}: {entry_point} does not fit the converted layers "
                                 f"to the original; convert with scripts/reparametrize.py (which does), or set "
                                 f"collab.{key}=null")

    def check_calibration_source(self, task_allowed: bool) -> None:
        """The calibration texts exist: a file, or ``task`` where the caller has a task (the GLUE pipeline); and so
        do the end-to-end fit's own texts (``collab.e2e_texts``), where set."""
        if self.calibration is None:
            return
        source = self.calibration.source
        if self.calibration.from_task:
            if not task_allowed:
                raise ValueError(
                    "collab.calibration=task means the task's training texts and is only for the GLUE pipeline; "
                    "pass a text file (one text per line) or a GLUE train.tsv/dev.tsv"
                )
        elif not Path(source).is_file():
            raise FileNotFoundError(
                f"collab.calibration={source}: no such file; use a text file (one text per line) or a "
                "GLUE train.tsv/dev.tsv" + (", or 'task' (the task's training texts)" if task_allowed else "")
            )
        if self.e2e_texts is not None and not Path(self.e2e_texts).is_file():
            raise FileNotFoundError(f"collab.e2e_texts={self.e2e_texts}: no such file; use a text file (one text per "
                                    "line) or a GLUE train.tsv/dev.tsv")

    def check_model(self, config) -> None:
        """Before any work: can a model with this transformers ``config`` be converted with this method and rank? A
        refusal names the setting it is about (``collab.rank`` or ``collab.budget``)."""
        if self.converts:
            options = dataclasses.asdict(self.options)
            with cli.naming("collab.budget" if self.budget else "collab.rank", self.rank_request):
                check_request(config, self.method, self.rank_request, **options)
            if self.bands != "per-layer":
                with cli.naming("collab.bands", self.bands):
                    check_request(config, self.method, self.rank_request, bands=self.bands, **options)
            if self.value_rank is not None:
                with cli.naming("collab.value_rank", self.value_rank):
                    check_request(config, self.method, self.rank_request, self.value_rank, **options)
