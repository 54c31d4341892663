"""Forward passes that end early: a hook before every call of some modules of a model, and each pass after the first
ended right after a chosen call (the calibration's statistics and the layer fit's captures need nothing after it)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

from torch import nn


class _Stop(Exception):
    """Ends a pass after its ``stop_at``-th hooked call."""


class HookedPasses:
    """``hook(key, module, args, kwargs)`` before every call of ``modules`` (key -> module) in each pass of ``model``.
    Once ``stop_at`` is set (the first pass, run to the end, says what to: its ``calls``), a pass ends right after the
    hook of its ``stop_at``-th call. A context manager: the hooks go when it ends."""

    def __init__(self, model: nn.Module, modules: Mapping[Hashable, nn.Module], hook: Callable):
        self.model = model
        self.stop_at: int | None = None
        self.calls = 0  # hooked calls of the last pass

        def pre(key):
            def run(module, args, kwargs):
                hook(key, module, args, kwargs)
                self.calls += 1
                if self.calls == self.stop_at:
                    raise _Stop

            return run

        self.handles = [module.register_forward_pre_hook(pre(key), with_kwargs=True) for key, module in
                        modules.items()]

    def run(self, inputs: Mapping) -> bool:
        """One pass of the model on ``inputs``; whether it ended at ``stop_at``."""
        return self.call(self.model, **inputs)[0]

    def call(self, function: Callable, *args, **kwargs) -> tuple[bool, object]:
        """``function(*args, **kwargs)`` as one pass (a part of the model run on its own): whether it ended at
        ``stop_at``, and what it returned (None where it ended)."""
        self.calls = 0
        try:
            return False, function(*args, **kwargs)
        except _Stop:
            return True, None

    def close(self) -> None:
        """The hooks removed."""
        for handle in self.handles:
            handle.remove()

    def __enter__(self) -> HookedPasses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
