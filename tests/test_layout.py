"""The package's layout as docs/layout.md states it, read from the code's own imports (``ast``, nothing imported):
no module imports another's private (``_``) name, and ``collab_attn/fitting/`` sits above ``collab_attn/models/``
(the fits import the conversion; the conversion, and everything below it, never imports the fits)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "collab_attn"

# Private names imported across modules before the rule was written down (issue 90): they may only go, and a test
# below fails when one has gone and is still listed here. Nothing may be added.
KNOWN_PRIVATE = {
    ("collab_attn.decomposition.rotary_tucker", "collab_attn.decomposition.rotary_cp", "_energies"),
    ("collab_attn.decomposition.rotary_tucker", "collab_attn.decomposition.rotary_cp", "_overall"),
}


def modules() -> dict[str, ast.Module]:
    """Every module of the package by its dotted name, parsed."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return found


def imports(name: str, tree: ast.Module, is_package: bool) -> list[tuple[str, str]]:
    """(module, name) of every ``from X import name`` in the module (anywhere, functions included), relative imports
    resolved; ``import X`` as (X, "")."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            found += [(base, alias.name) for alias in node.names]
    return found


def cross_module(parsed: dict[str, ast.Module]):
    for name, tree in parsed.items():
        is_package = (PACKAGE.parent / name.replace(".", "/") / "__init__.py").is_file()
        for module, imported in imports(name, tree, is_package):
            if module.split(".")[0] == "collab_attn" and module != name:
                yield name, module, imported


def test_no_module_imports_another_modules_private_name():
    parsed = modules()
    private = {(name, module, imported) for name, module, imported in cross_module(parsed)
               if imported.startswith("_") and f"{module}.{imported}" not in parsed}  # a private submodule is fine
    new = sorted(private - KNOWN_PRIVATE)
    assert not new, (f"{new}: a module imports another's private name; give the helper a public name in the module "
                     "that owns it (or a module the two share) and import that")
    gone = sorted(KNOWN_PRIVATE - private)
    assert not gone, f"{gone} no longer import a private name: strike them from KNOWN_PRIVATE"


def test_the_fits_sit_above_the_conversion():
    """``collab_attn.fitting`` imports ``collab_attn.models``; ``models``, ``nn`` and ``decomposition`` import
    nothing of ``fitting`` (a circle between the two rooms would come back here)."""
    below = ("collab_attn.models", "collab_attn.nn", "collab_attn.decomposition")
    parsed = modules()
    wrong = sorted((name, f"{module}.{imported}".rstrip(".")) for name, module, imported in cross_module(parsed)
                   if name.startswith(below) and f"{module}.{imported}".startswith("collab_attn.fitting"))
    assert not wrong, f"{wrong}: below collab_attn/fitting/, these import it (docs/layout.md)"


def test_no_two_modules_share_a_file_name():
    """Every module of the package has its own file name (``__init__.py`` aside): a name says what the module holds,
    not only where it sits (issue 90)."""
    seen = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"{shared}: modules that share a file name; give each a name that says what it holds"


def runtime_imports(name: str, tree: ast.Module, is_package: bool) -> list[tuple[str, str]]:
    """``imports``, less those under ``if TYPE_CHECKING:`` (read by type checkers only, never run)."""
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            hidden |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    visible = ast.Module(body=[node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                               and id(node) not in hidden], type_ignores=[])
    return imports(name, visible, is_package)


def test_the_kinds_sit_below_the_conversion():
    """``collab_attn.kinds`` (one package per layer kind) imports nothing of ``collab_attn.models``,
    ``collab_attn.fitting`` or ``collab_attn.serving``, which build, fit and export its layers (issue 90); the
    shared plain-torch room ``collab_attn.nn`` imports no kind (it names the common modules lazily)."""
    above = {"collab_attn.kinds": ("collab_attn.models", "collab_attn.fitting", "collab_attn.serving"),
             "collab_attn.nn": ("collab_attn.kinds", "collab_attn.models", "collab_attn.fitting",
                                "collab_attn.serving")}
    wrong = []
    for name, tree in modules().items():
        is_package = (PACKAGE.parent / name.replace(".", "/") / "__init__.py").is_file()
        for room, forbidden in above.items():
            if name == room or name.startswith(room + "."):
                wrong += [(name, module) for module, _ in runtime_imports(name, tree, is_package)
                          if module.startswith(forbidden)]
    assert not wrong, f"{sorted(wrong)}: these import a room above their own (docs/layout.md)"


def test_every_kind_is_one_package_that_registers_itself():
    """Each layer kind's package under ``collab_attn/kinds/`` registers exactly its own kind, and every registered
    kind of the library comes from one of them."""
    import importlib

    from collab_attn.kinds import KIND_PACKAGES, LAYER_KINDS

    folders = sorted(path.name for path in (PACKAGE / "kinds").iterdir() if (path / "__init__.py").is_file())
    assert folders == sorted(KIND_PACKAGES)
    owners = {cls.__module__.split(".")[2] for cls in LAYER_KINDS.values() if cls.__module__.startswith(
        "collab_attn.kinds.")}
    assert owners == set(KIND_PACKAGES)
    for package in KIND_PACKAGES:
        module = importlib.import_module(f"collab_attn.kinds.{package}")
        kinds = [kind for kind, cls in LAYER_KINDS.items() if cls.__module__.startswith(module.__name__ + ".")]
        assert [kind.replace("-", "_") for kind in kinds] == [package]
