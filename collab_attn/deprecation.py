"""Names that were renamed, and the one way an old name is still taken: with a ``FutureWarning`` that names the new
one, or refused with one clear message when the old and the new name are both given different values; never
ignored.

One name per size: the query/key width of an attention layer is its ``rank`` and its value width its ``value_rank``
(``collab_attn.kinds.converted.SIZES``) everywhere, in settings, configs, keywords and run records. ``key_size`` /
``key_sizes`` (the Tiny Shakespeare pipeline, the from-scratch classifier, ``SharedKeyAttention``) are accepted in
place of ``rank`` / ``ranks``, and ``value_size`` (the Tiny Shakespeare pipeline: ``train_lm``'s setting,
``gpt_config``, ``run_name``, ``Conversion``) in place of ``value_rank``, until ``REMOVED_IN``. Committed run records
that hold ``key_size`` or ``value_size`` are read as holding ``rank`` or ``value_rank``
(``collab_attn.run_store.current_names``); they are not rewritten.
"""

from __future__ import annotations

import warnings

REMOVED_IN = "0.2.0"
# old name -> new name, for settings (configs, command lines), keywords and run records alike (the functions renamed
# outright, resolved_key_size and key_sizes_for, have no alias: docs/extending.md)
RENAMED = {"key_size": "rank", "key_sizes": "ranks", "value_size": "value_rank"}


def warn_renamed(old: str, new: str, where: str = "", stacklevel: int = 3) -> None:
    """The ``FutureWarning`` of an old name ``old`` used in place of ``new`` (``where``: what it was given to)."""
    place = f" ({where})" if where else ""
    warnings.warn(f"{old} is deprecated{place}: use {new}; {old} goes in collab_attn {REMOVED_IN}", FutureWarning,
                  stacklevel=stacklevel)


def conflict(old: str, new: str, old_value, new_value) -> str:
    """The message refusing an old name and its new one given different values."""
    return (f"{old}={old_value} and {new}={new_value} are both set; {old} is the deprecated name of {new}: "
            f"give {new} only")


def renamed_keyword(old: str, new: str, old_value, new_value, where: str, stacklevel: int = 4):
    """The value of keyword ``new`` of ``where`` when the deprecated ``old`` may have been given instead: ``old``'s
    value with a ``FutureWarning`` (``stacklevel``: the caller's frame, as seen from ``warn_renamed``), ``TypeError``
    when both are given different values, else ``new_value``."""
    if old_value is None:
        return new_value
    if new_value is not None and new_value != old_value:
        raise TypeError(conflict(old, new, old_value, new_value))
    warn_renamed(old, new, where, stacklevel=stacklevel)
    return old_value
