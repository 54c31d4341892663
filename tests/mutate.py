"""Break the library on purpose and check that the suite notices: each mutation below changes one line of a copy of
the project, and the tests named beside it must fail there.

The mutations are the bugs that once passed the whole suite (a reduced-rank conversion installing other weights than
it fitted, a static cache's own mask seeing an unwritten slot, the sampler's cache) and a few the suite caught already
(kept so that it goes on catching them). A mutation whose text is no longer in the code counts as not caught: change
the mutation with the code.

    python tests/mutate.py            # a Markdown table: mutation, the tests run, what failed
    python tests/mutate.py --json     # one JSON object per mutation (what tests/test_mutations.py reads)

The copy is made once; torch, transformers and the rest are imported once, and each mutation runs in a forked child
that imports the mutated ``collab_attn`` from the copy and runs its tests with ``-x`` (stop at the first failure).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = "tests/test_installed_weights.py"

# name: (file, text, replacement, the tests that must catch it)
MUTATIONS = {
    "key mixing x 1.1 below full rank": (
        "collab_attn/models/methods/decomposition.py",
        '**_mixing_state("", fit.mixing, fit.core)}',
        '**_mixing_state("", fit.mixing * 1.1, fit.core)}',
        [f"{INSTALLED}::test_each_installed_head_is_the_fit[cp-None-bert]"],
    ),
    "key mixing rows swapped between heads below full rank": (
        "collab_attn/models/methods/decomposition.py",
        '**_mixing_state("", fit.mixing, fit.core)}',
        '**_mixing_state("", fit.mixing[[1, 0, *range(2, len(fit.mixing))]], fit.core)}',
        [f"{INSTALLED}::test_each_installed_head_is_the_fit[tucker-None-gpt2]"],
    ),
    "shared-value mixing x 1.1": (
        "collab_attn/models/methods/decomposition.py",
        '_mixing_state("value_", fit.mixing, fit.core)',
        '_mixing_state("value_", fit.mixing * 1.1, fit.core)',
        [f"{INSTALLED}::test_each_installed_head_is_the_fit[cp-24-bert]"],
    ),
    "shared-value mixing rows swapped between heads": (
        "collab_attn/models/methods/decomposition.py",
        '_mixing_state("value_", fit.mixing, fit.core)',
        '_mixing_state("value_", fit.mixing[[1, 0, *range(2, len(fit.mixing))]], fit.core)',
        [f"{INSTALLED}::test_each_installed_head_is_the_fit[tucker-24-gpt2]"],
    ),
    "thin keys: two heads' query maps swapped (a fit not of the head products: no run-time check)": (
        "collab_attn/models/methods/key_svd.py",
        'query = torch.einsum("hdr,hdi->hri", per_head, layer.w_query).flatten(0, 1)',
        'query = torch.einsum("hdr,hdi->hri", per_head[[1, 0, *range(2, layer.heads)]], layer.w_query).flatten(0, 1)',
        [f"{INSTALLED}::test_each_installed_head_is_the_fit[key-svd-None-bert]"],
    ),
    "latent attention: the value up-projection scaled": (
        "collab_attn/models/methods/kv_svd.py",
        "values.replaced_by(up_value, values.w_output.flatten(0, 1).T,",
        "values.replaced_by(up_value * 1.1, values.w_output.flatten(0, 1).T,",
        [f"{INSTALLED}::test_each_installed_head_is_the_fit[kv-svd-None-gpt2]"],
    ),
    "the static cache's own causal mask lets a query see one unwritten slot": (
        "collab_attn/kinds/converted.py",
        "return (positions[None, :] <= last_seen[:, None])[None, None]",
        "return (positions[None, :] <= last_seen[:, None] + 1)[None, None]",
        ["tests/test_static_cache.py::test_a_static_cache_passed_in_equals_recomputation[False-cp-gpt2]"],
    ),
    "the sampler's cache: a prompt's values cached in reverse order": (
        "collab_attn/nn/attention.py",
        "packed, values = kv_cache(self._pack(keys, content), values)",
        "packed, values = kv_cache(self._pack(keys, content), values.flip(2))",
        ["tests/test_lm.py::test_samples_longer_than_the_context_use_the_cache"],
    ),
    "CP-ALS: the factors not scaled back": (
        "collab_attn/decomposition/cp_als.py",
        "result.query, result.key = result.query / query_scale, result.key / key_scale",
        "result.query, result.key = result.query, result.key",
        ["tests/test_cp_als.py::test_cp_als_is_scale_invariant"],
    ),
    "a stored run made with other settings reused": (
        "collab_attn/run_store.py",
        'wanted = {**({"signature": self.signature} if self.signature is not None else {}), **(expected or {})}',
        "wanted = {}",
        ["tests/test_run_store.py::test_a_run_made_with_other_settings_is_refused_naming_what_differs"],
    ),
    "a rank of 0 accepted": (
        "collab_attn/models/conversion.py",
        "or not 0 < value <= full_rank:",
        "or not 0 <= value <= full_rank:",
        ["tests/test_reparam.py::test_bad_rank_is_explained_and_leaves_the_model_alone"],
    ),
}


def copy_project(destination: Path) -> Path:
    """The package, its tests, configs, scripts and pytest settings under ``destination``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("collab_attn", "tests", "configs", "scripts"):
        shutil.copytree(ROOT / folder, destination / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", destination / "pyproject.toml")
    return destination


def _preload(copy: Path) -> None:
    """Import the package once from the unchanged copy (torch, transformers and the rest come with it), then forget
    the package itself: each forked child imports its own, mutated, copy and pays only for that. No bytecode is
    written, so a child never reads a compiled module of another mutation."""
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(copy))
    import hydra  # noqa: F401  (imported by the tests; after pytest starts, its assertion rewriting would redo it)
    import pytest  # noqa: F401

    import collab_attn  # noqa: F401

    for name in [m for m in sys.modules if m == "collab_attn" or m.startswith("collab_attn.")]:
        del sys.modules[name]


def _child(copy: Path, tests: list[str], log: Path) -> int:
    """In the forked child: the mutated package from the copy, its tests, their exit status."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.chdir(copy)
    import pytest

    import collab_attn

    if not collab_attn.__file__.startswith(str(copy)):
        print(f"the copy was not imported: {collab_attn.__file__}")
        return 3
    # no installed pytest plugins (none of these tests uses one; their modules would be rewritten for asserts in each
    # child) and no collection of garbage at the end for unraisable exceptions: a second a child
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception", "-rf", *tests]))


def run(name: str, copy: Path) -> dict:
    """Apply mutation ``name`` to the copy, run its tests in a forked child, put the file back."""
    file, text, replacement, tests = MUTATIONS[name]
    target = copy / file
    original = target.read_text()
    if original.count(text) != 1:
        return {"name": name, "tests": tests, "status": None, "failed": [], "caught": False, "seconds": 0.0,
                "output": f"the mutation's text is not (once) in {file}: update tests/mutate.py"}
    log = copy / "mutation.log"
    start = time.perf_counter()
    target.write_text(original.replace(text, replacement))
    try:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            status = 4
            try:
                status = _child(copy, tests, log)
            finally:
                os._exit(status)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        target.write_text(original)
    output = log.read_text()
    failed = re.findall(r"^FAILED (\S+)", output, flags=re.MULTILINE)
    # caught: tests ran and failed (pytest's status 1), not a collection error (2) or no tests (5)
    return {"name": name, "tests": tests, "status": status, "failed": failed, "caught": status == 1 and bool(failed),
            "seconds": round(time.perf_counter() - start, 1), "output": output[-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per mutation")
    parser.add_argument("--only", action="append", help="run this mutation only (repeatable)")
    args = parser.parse_args(argv)
    names = args.only or list(MUTATIONS)
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; choose from {list(MUTATIONS)}")
    with tempfile.TemporaryDirectory() as folder:
        copy = copy_project(Path(folder))
        _preload(copy)
        results = [run(name, copy) for name in names]
    if args.json:
        for result in results:
            print(json.dumps(result))
    else:
        print("| mutation | tests run | failed (caught) | seconds |\n|---|---|---|---:|")
        for r in results:
            caught = ", ".join(f.split("::")[-1] for f in r["failed"]) if r["caught"] else "NOT CAUGHT"
            print(f"| {r['name']} | {', '.join(t.split('::')[-1] for t in r['tests'])} | {caught} | {r['seconds']} |")
    return 0 if all(r["caught"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
