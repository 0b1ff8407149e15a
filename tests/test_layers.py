"""The house is one-way: entry points -> lit_module -> models, data -> the batch contract ->
utils and errors. A layer imports only from itself and the layers below it."""

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "navit_lightning"
BOTTOM = ("navit_lightning.errors",)
# Each layer (a module or a package) and what else of the project it may import.
MAY_IMPORT = {
    "navit_lightning.errors": (),
    "navit_lightning.utils": (*BOTTOM, "navit_lightning"),  # the root holds only CONFIG_DIR
    "navit_lightning.batch": (),
    "navit_lightning.data": ("navit_lightning.batch", "navit_lightning.utils", *BOTTOM),
    "navit_lightning.models": ("navit_lightning.batch", *BOTTOM),
    "navit_lightning.strategies": ("navit_lightning.batch", "navit_lightning.utils", *BOTTOM),
    "navit_lightning.pictures": ("navit_lightning.batch",),
    "navit_lightning.resolution": ("navit_lightning.pictures",),
    "navit_lightning.lit_module": (
        "navit_lightning.models",
        "navit_lightning.batch",
        "navit_lightning.utils",
        *BOTTOM,
    ),
}
# The entry points take any layer but one another; the benchmarks measure train.py's build too.
BELOW_ENTRY_POINTS = (*MAY_IMPORT, "navit_lightning")
MAY_IMPORT |= {
    f"navit_lightning.{entry_point}": BELOW_ENTRY_POINTS for entry_point in ("train", "eval", "predict")
}
MAY_IMPORT["navit_lightning.bench"] = (*BELOW_ENTRY_POINTS, "navit_lightning.train")


def project_imports(path: Path) -> set[str]:
    """Every navit_lightning module a file imports, at its top or inside a function, relative
    imports by the module they name (`from .. import x` in models/: navit_lightning)."""
    package = ".".join(path.relative_to(PACKAGE.parent).parent.parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add(importlib.util.resolve_name("." * node.level + (node.module or ""), package))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.split(".")[0] == "navit_lightning"}


def inside(name: str, layer: str) -> bool:
    return name == layer or name.startswith(layer + ".")


@pytest.mark.parametrize("layer", MAY_IMPORT)
def test_a_layer_imports_only_itself_and_what_lies_below(layer):
    relative = Path(*layer.split(".")[1:])
    files = sorted((PACKAGE / relative).rglob("*.py")) or [PACKAGE / relative.with_suffix(".py")]
    assert all(f.exists() for f in files), files
    allowed = (layer, *MAY_IMPORT[layer])
    wrong = {
        f"{f.relative_to(PACKAGE)} imports {name}"
        for f in files
        for name in project_imports(f)
        # the root package itself ("navit_lightning") only where allowed by name
        if not any(inside(name, ok) if ok != "navit_lightning" else name == ok for ok in allowed)
    }
    assert not wrong, sorted(wrong)
