"""Layers only point down (issue 11): checked statically on the source with ``ast``.

Every import counts, at module level and inside functions, so an import made lazy to dodge a cycle
or a layer is still caught.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from blockloop.data.tasks import TaskTokenizer, get_task

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "blockloop"
# What the data layer sits below: it imports none of these (nor anything under them).
ABOVE_DATA = ("models", "config", "convert", "train", "serve", "cli", "families", "bench", "demo")
# The layers above data (ARCHITECTURE.md): what each may not import. Models name their family's config class
# for type checking only, so families is not on their list.
FORBIDDEN = {
    "models": ("data", "train", "convert", "serve", "bench", "cli", "demo"),
    "families": ("train", "convert", "serve", "bench", "cli", "demo"),
    "serve": ("train", "convert", "bench", "cli", "demo"),
    "train": ("serve", "bench", "cli", "demo"),
    "convert": ("serve", "bench", "cli", "demo"),
    "bench": ("evals", "cli", "demo"),
    "evals": ("cli", "demo"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of blockloop's source."""
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> set[str]:
    """Modules ``path`` imports anywhere in its body; ``from package import submodule`` names the submodule."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this one
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
    return found


def modules_under(folder: str) -> dict[str, set[str]]:
    return {module_name(path): imports(path) for path in sorted((PACKAGE / folder).rglob("*.py"))}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_shared_layers_import_only_torch_the_standard_library_and_themselves():
    """And Triton, PyTorch's kernel language, in the one module that is a Triton kernel: nothing imports that module
    unless a cache reads its pages with it (``attention`` imports it where it calls it). ``device.py`` is a leaf as
    ``errors.py`` is (its memory check before a cache is allocated), so the caches may use it."""
    leaves = ("blockloop.errors", "blockloop.device")
    for leaf in leaves:
        outside = {name for name in imports(SRC.joinpath(*leaf.split(".")).with_suffix(".py"))
                   if name.split(".")[0] not in sys.stdlib_module_names and name != "torch" and name not in leaves}
        assert not outside, f"{leaf} must import only torch, the standard library and the other leaves: {outside}"
    allowed = ("torch", "blockloop.nn", *leaves)
    kernels = {"blockloop.nn.paged_decode": ("triton",)}
    wrong = {
        (module, name)
        for module, names in modules_under("nn").items()
        for name in names
        if name.split(".")[0] not in sys.stdlib_module_names
        and not any(within(name, ok) for ok in allowed + kernels.get(module, ()))
    }
    assert not wrong, f"nn/ imports outside torch / stdlib / blockloop.nn / errors / device: {sorted(wrong)}"


def test_the_data_layer_imports_nothing_above_it():
    wrong = {
        (module, name)
        for module, names in modules_under("data").items()
        for name in names
        if any(within(name, f"blockloop.{above}") for above in ABOVE_DATA)
    }
    assert not wrong, f"data/ imports from a layer above it: {sorted(wrong)}"


def test_every_layer_imports_only_the_layers_below_it():
    wrong = {
        (module, name)
        for layer, above in FORBIDDEN.items()
        for module, names in modules_under(layer).items()
        for name in names
        if any(within(name, f"blockloop.{a}") for a in above)
    }
    assert not wrong, f"imports that point up (see ARCHITECTURE.md): {sorted(wrong)}"


def test_the_data_layer_has_no_import_cycle():
    graph = {module: {n for n in names if within(n, "blockloop.data")} for module, names in modules_under("data").items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module not in done:
            for name in sorted(graph.get(module, ())):
                visit(name, path + [module])
            done.add(module)

    for module in graph:
        visit(module, [])


def test_a_saved_task_tokenizer_loads_through_the_checkpoint_loader(tmp_path):
    """The checkpoint loader (train.run) has the task tokenizer registered, whatever the caller imported."""
    TaskTokenizer("random-walk", get_task("random-walk").vocab).save(tmp_path)
    code = f"from blockloop.train.run import load_tokenizer; print(load_tokenizer({str(tmp_path)!r}).name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=SRC)
    assert out.stdout.strip() == "task:random-walk"
