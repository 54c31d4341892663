"""Typed method settings: the ``collab`` config group as one validated object, built once per run.

``MethodSettings.from_config(cfg["collab"])`` turns the composed group (``configs/collab/{cp,tucker,svd,prune,none}
.yaml`` plus overrides) into a ``MethodSettings``: unknown keys, wrong types and values a method cannot take stop
there, with the key named. Every entry point goes through it (``scripts/reparametrize.py``, ``scripts/visualize.py``
and ``scripts/train_glue.py`` through ``collab_attn.glue.pipeline``) and asks it for what the library needs:
``reparametrize_kwargs()`` (the arguments of ``reparametrize`` that its method takes, and only those),
``rank_request`` (the budget string or the rank(s)), ``label`` (``cp``, ``cp-tensorly``, ``cp-aware``, ``svd``, ...)
and ``check_model(config)`` (can a model with this config be converted so, before any training).

Where the defaults live. The GLUE pipeline names each job's folder by a hash of the *composed* ``collab`` dict
(``pipeline.job_dir``: sha1 of its JSON), so the keys and values of the group files are part of the names of the
committed runs under ``experiments/*/runs/``: ``svd.yaml`` holds two keys, ``prune.yaml`` four, ``cp.yaml`` eleven,
and a job run as ``collab=cp collab.method=none`` hashes all eleven. Moving a default out of the YAML (or adding one,
such as an ``importance_data`` key) would rename committed runs. So the YAML group files are the one place a default
value is written down, and this class writes none of its own: a field left unset is ``None``, which means "off"
(``budget``, ``calibration``) or "not given", and a field not given is left out of the arguments, so the library
function's own default applies (``reparametrize(n_iter_max=100)``, ``load_texts(limit=512)``, ...), which is what a
Python caller building ``MethodSettings(method="cp", rank=128)`` by hand expects. The hashes are still computed from
the composed dicts, exactly as before, never from this object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from collab_attn.decomposition.decompose import METHODS as DECOMPOSITIONS
from collab_attn.decomposition.decompose import SOLVERS
from collab_attn.decomposition.rank_selection import RankBudget
from collab_attn.models.conversion import METHODS, check_request

CHOICES = ("none", *METHODS)  # "none": keep the concatenated heads (a GLUE pipeline baseline)
INITS = ("svd", "random")

_DECOMPOSITION_KEYS = (
    "budget", "solver", "init", "n_iter_max", "tol", "tucker_core_size", "calibration", "calibration_samples",
    "calibration_max_length",
)
# The keys each method takes besides ``method`` and ``rank``; a key another method takes must be unset (null).
# ``none`` takes every key and ignores them: ``collab=cp collab.method=none`` is a documented run.
TAKES = {
    "none": (),
    "cp": _DECOMPOSITION_KEYS,
    "tucker": _DECOMPOSITION_KEYS,
    "svd": (),
    "prune": ("importance_samples", "importance_batch_size"),
}
# The arguments of collab_attn.reparametrize these keys become (calibration and importance are measured first).
_REPARAMETRIZE_OPTIONS = ("solver", "init", "n_iter_max", "tol", "tucker_core_size")


def _is_int(value) -> bool:
    return type(value) is int


def _positive_int(name: str, value, nullable: bool = True) -> None:
    if value is None and nullable:
        return
    if not (_is_int(value) and value > 0):
        raise ValueError(f"collab.{name} must be a positive integer, got {value!r}")


def _choice(name: str, value, choices) -> None:
    if value is not None and value not in choices:
        raise ValueError(f"unknown collab.{name} {value!r}; choose one of {choices}")


@dataclass(frozen=True)
class MethodSettings:
    """How to cut the query/key parameters of a model (one ``collab`` group). ``None`` means unset: off for
    ``budget`` and ``calibration``, the library's default for the others."""

    method: str
    # Key/query size D~: one int, or one per attention layer; for svd a multiple of the heads.
    rank: int | list[int] | None = None
    # cp/tucker: per-layer ranks under a global budget ("params:F", "mean:R", "energy:E"), replacing rank.
    budget: str | None = None
    # cp/tucker: the decomposition (collab_attn.decompose_heads).
    solver: str | None = None
    init: str | None = None
    n_iter_max: int | None = None
    tol: float | None = None
    tucker_core_size: int | None = None
    # cp/tucker: activation-aware fitting on texts: a text file, a GLUE .tsv, or "task" (the GLUE pipeline only).
    calibration: str | None = None
    calibration_samples: int | None = None
    calibration_max_length: int | None = None
    # prune: head importance on labelled task examples.
    importance_samples: int | None = None
    importance_batch_size: int | None = None

    @classmethod
    def from_config(cls, collab: Mapping) -> MethodSettings:
        """The settings of a composed ``collab`` group (a plain dict or a DictConfig); unknown keys are refused."""
        if hasattr(collab, "_metadata"):  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            collab = OmegaConf.to_container(collab, resolve=True)
        known = [f.name for f in dataclasses.fields(cls)]
        for key in collab:
            if key not in known:
                raise ValueError(f"unknown key collab.{key}; the collab group takes {', '.join(known)}")
        if "method" not in collab:
            raise ValueError("collab.method is missing; choose one of " + ", ".join(CHOICES))
        return cls(**collab)

    def __post_init__(self):
        _choice("method", self.method, CHOICES)
        if self.method == "none":
            return
        for key in dataclasses.fields(self):
            if key.name not in ("method", "rank", *TAKES[self.method]) and getattr(self, key.name) is not None:
                raise ValueError(
                    f"collab.{key.name} does not apply to collab.method={self.method}; pick the method's group "
                    f"(collab={self.method}) rather than collab.method={self.method}, or set collab.{key.name}=null"
                )
        if self.budget is not None:
            if not isinstance(self.budget, str):
                raise ValueError(f"collab.budget must be a string such as 'mean:128' or null, got {self.budget!r}")
            RankBudget.parse(self.budget)
        else:
            rank = self.rank
            ok = _is_int(rank) or (isinstance(rank, (list, tuple)) and rank and all(_is_int(r) for r in rank))
            if not ok:
                raise ValueError(
                    f"collab.rank must be an integer or a list of integers (one per layer), got {rank!r}"
                )
            if isinstance(rank, tuple):
                object.__setattr__(self, "rank", list(rank))
        _choice("solver", self.solver, SOLVERS)
        _choice("init", self.init, INITS)
        for name in ("n_iter_max", "tucker_core_size", "calibration_samples", "calibration_max_length",
                     "importance_samples", "importance_batch_size"):
            _positive_int(name, getattr(self, name))
        if self.tol is not None and not (type(self.tol) in (int, float) and self.tol >= 0):
            raise ValueError(f"collab.tol must be a number >= 0, got {self.tol!r}")
        if self.calibration is not None and not (isinstance(self.calibration, str) and self.calibration.strip()):
            raise ValueError(f"collab.calibration must be a file path, 'task' or null, got {self.calibration!r}")

    # ----------------------------------------------------------------------------------------------------------
    # What the library and the results need

    @property
    def converts(self) -> bool:
        """False for ``none`` (the model keeps its concatenated heads)."""
        return self.method != "none"

    @property
    def rank_request(self):
        """What ``reparametrize`` is asked for: the budget string when one is set, else the rank(s)."""
        return self.budget if self.budget else self.rank

    @property
    def label(self) -> str:
        """The method as results and tables name it: ``cp``, ``tucker``, ``svd``, ``prune`` or ``none``, then
        ``-tensorly`` for the paper's dense solver and ``-aware`` for activation-aware fitting."""
        label = self.method
        if self.method in DECOMPOSITIONS:
            label += "-tensorly" if self.solver == "tensorly" else ""
            label += "-aware" if self.calibration else ""
        return label

    @property
    def calibrated(self) -> bool:
        return self.method in DECOMPOSITIONS and bool(self.calibration)

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
        """``rank``, ``method`` and the options of ``collab_attn.reparametrize`` this method takes, the unset ones
        left to the library's defaults; the caller adds ``seed``, ``calibration=`` / ``importance=`` and
        ``progress``."""
        if not self.converts:
            raise ValueError("collab.method=none keeps the concatenated heads: there is nothing to reparametrize")
        kwargs = {"rank": self.rank_request, "method": self.method}
        if self.method in DECOMPOSITIONS:
            kwargs.update({k: getattr(self, k) for k in _REPARAMETRIZE_OPTIONS if getattr(self, k) is not None})
        return kwargs

    def check_calibration_source(self, task_allowed: bool) -> None:
        """The calibration texts exist: a file, or ``task`` where the caller has a task (the GLUE pipeline)."""
        if not self.calibrated:
            return
        if self.calibration == "task":
            if not task_allowed:
                raise ValueError(
                    "collab.calibration=task means the task's training texts and is only for the GLUE pipeline; "
                    "pass a text file (one text per line) or a GLUE train.tsv/dev.tsv"
                )
        elif not Path(self.calibration).is_file():
            raise FileNotFoundError(
                f"collab.calibration={self.calibration}: no such file; use a text file (one text per line) or a "
                "GLUE train.tsv/dev.tsv" + (", or 'task' (the task's training texts)" if task_allowed else "")
            )

    def check_model(self, config) -> None:
        """Before any work: can a model with this transformers ``config`` be converted with this method and rank?"""
        if self.converts:
            check_request(config, self.method, self.rank_request, self.tucker_core_size)
