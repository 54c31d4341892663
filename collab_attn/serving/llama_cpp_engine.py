"""llama-cpp-python for the scripts that measure exported models in llama.cpp (``benchmarks/llama_cpp_decode.py``,
``scripts/llama_cpp_half_cache.py``). It is not a dependency of the project: it builds llama.cpp from source
(``scripts/check_llama_cpp.sh`` installs it)."""

from __future__ import annotations

import ctypes

_QUIET = None  # the log callback, kept alive while llama.cpp may call it


def load_llama_cpp():
    """The ``llama_cpp`` module with its backend started and llama.cpp's own logging (a line per tensor it loads)
    silenced; an ImportError that says how to install it where it is missing."""
    global _QUIET
    try:
        import llama_cpp
    except ImportError:
        raise ImportError("llama-cpp-python is not installed: bash scripts/check_llama_cpp.sh installs it") from None
    llama_cpp.llama_backend_init()
    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
    return llama_cpp
