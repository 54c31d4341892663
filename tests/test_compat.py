"""Compatibility: the installed transformers and torch lie in the range collab-attn declares (read from the installed
package's metadata, so pyproject.toml is the one place that states it), and the call conventions that differ between
the transformers releases of that range are handled. ``.ci/compat`` runs this module with the lowest supported
transformers, ``.ci/run`` with the newest."""

import dataclasses
from importlib import metadata

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

# collab_attn is imported inside the tests, so that the range check runs (and says what is wrong) even where an
# unsupported transformers makes the import fail.


def declared_specifier(name: str):
    """The version specifier collab-attn's installed metadata gives for the dependency ``name``."""
    try:
        requirements = metadata.requires("collab-attn") or []
    except metadata.PackageNotFoundError:
        pytest.fail("collab-attn is not installed; install it with pip install -e '.[dev]'")
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == name and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
            return requirement.specifier
    pytest.fail(f"collab-attn declares no {name} requirement: {requirements}")


@pytest.mark.parametrize("name", ["transformers", "torch"])
def test_installed_version_lies_in_the_declared_range(name):
    specifier = declared_specifier(name)
    installed = Version(metadata.version(name))
    assert specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is installed but collab-attn declares {name}{specifier} (pyproject.toml); the tests "
        f"only vouch for that range: pip install '{name}{specifier}', or widen the range after testing"
    )


def test_a_transformers_without_dataclass_configs_is_refused_clearly():
    from collab_attn.models.families import FAMILIES
    from collab_attn.models.hf import _collab_config_class

    class OldConfig:  # what configs were before transformers 5.4: a class with an __init__, not a dataclass
        model_type = "bert"

    family = dataclasses.replace(FAMILIES["bert"], config_class=OldConfig)
    with pytest.raises(ImportError, match=r"strict dataclasses \(5.4 and newer\).*OldConfig"):
        _collab_config_class(family)


def small_layer():
    from collab_attn.kinds import CollaborativeSelfAttention

    torch.manual_seed(0)
    layer = CollaborativeSelfAttention(16, 2, 8, head_dim=8, dropout=0.0, bias=True, output_projection=True)
    return layer.attach(is_causal=True, layer_idx=0).eval()


def test_one_cache_under_two_names_is_one_cache():
    from transformers import DynamicCache

    layer, hidden, cache = small_layer(), torch.randn(1, 5, 16), DynamicCache()
    with torch.no_grad():
        full, _ = layer(hidden)
        first, _ = layer(hidden[:, :3], cache=cache, past_key_values=cache)
        rest, _ = layer(hidden[:, 3:], past_key_values=cache, past_key_value=cache)
    assert cache.get_seq_length(0) == 5  # each call appended once
    assert torch.allclose(torch.cat([first, rest], dim=1), full, atol=1e-5)


def test_two_different_caches_are_refused_with_both_names():
    from transformers import DynamicCache

    with pytest.raises(TypeError, match="two caches at once.*cache and past_key_values are different objects"):
        small_layer()(torch.randn(1, 3, 16), cache=DynamicCache(), past_key_values=DynamicCache())


def test_the_cache_goes_in_under_the_name_this_transformers_takes():
    """``cache_keyword``: ``cache`` from transformers 5.24, ``past_key_values`` before (benchmarks/decode.py feeds
    caches by it); a converted GPT-2 given its cache under that name fills it and decodes as it recomputes."""
    import transformers
    from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

    from collab_attn import reparametrize
    from collab_attn.kinds import cache_keyword

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=50, n_positions=16)).eval()
    reparametrize(model, 8, "cp", progress=False, n_iter_max=3)
    expected = "cache" if Version(transformers.__version__) >= Version("5.24.0") else "past_key_values"
    assert cache_keyword(model) == expected
    ids = torch.randint(0, 50, (1, 6))
    cache = DynamicCache()
    with torch.no_grad():
        full = model(ids).logits
        steps = [model(ids[:, :4], use_cache=True, **{expected: cache}).logits]
        steps += [model(ids[:, i:i + 1], use_cache=True, **{expected: cache}).logits for i in (4, 5)]
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
