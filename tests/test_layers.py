"""The house's layers point down (docs/architecture.md): a module imports only from its own layer or
below, and the import graph has no circle. Checked on the source, so a new upward import or a circle
fails here rather than in a review. Every folder and top-level module of hflow/ must have a layer.
"""

import ast
from pathlib import Path

import pytest

HFLOW = Path(__file__).resolve().parent.parent / "hflow"

# Lowest first. A module may import its own layer and every layer listed before it, nothing after it.
LAYERS = [
    ("__init__.py",),  # the package itself: where the shipped config folder is
    ("sandbox",),  # untrusted code: stdlib only
    ("utils", "config_schema.py"),  # general helpers (device, masked tensor math, datasets, user code, errors,
    # ...) and the configuration's generic machinery (merge, validate, the check helpers)
    ("protocol",),  # DataProto and its wire format
    ("algorithms",),  # advantages, losses, KL: pure torch
    ("agent",),  # the multi-turn loop, parsers, the model's tools
    ("single_controller",),  # Worker, WorkerGroup, @register, Ray and local backends
    ("workers",),  # SPMD workers: FSDP actor/critic/ref, rollouts, weight sync
    ("reward",),  # scorers, managers, shaping, the generative judge, the audit
    ("tasks",),  # built-in tasks: their data and small pre-trained models
    ("trainer",),  # the drivers: main_ppo / main_sft / main_rm / main_dpo, preflight, the memory plan, RayPPOTrainer
    ("cli",),  # offline command-line tools: checkpoint converter, the memory plan's command line, plot
]
# Imports nothing of hflow at all (its processes start from a bare interpreter).
SELF_CONTAINED = {"sandbox"}


def layer_of(path: Path) -> int:
    top = path.relative_to(HFLOW).parts[0]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{path.relative_to(HFLOW.parent)} is in no layer: add {top!r} to LAYERS in {__file__}")


def module_name(path: Path) -> str:
    parts = path.relative_to(HFLOW.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every hflow module `path` imports, at any depth (lazy imports inside functions count)."""
    names = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "hflow" or name.startswith("hflow.")}


SOURCES = sorted(HFLOW.rglob("*.py"))
MODULES = {module_name(path): path for path in SOURCES}


def resolve(name: str) -> str | None:
    """The hflow module file that an imported name lives in (`hflow.x.y.func` -> `hflow.x.y`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def test_every_folder_has_a_layer():
    for path in SOURCES:
        layer_of(path)


@pytest.mark.parametrize("layer", [names[0] for names in LAYERS])
def test_imports_only_point_down(layer):
    upward = []
    for path in SOURCES:
        if path.relative_to(HFLOW).parts[0] != layer:
            continue
        own = layer_of(path)
        for name in sorted(imported_modules(path)):
            target = resolve(name)
            if target is None or target == "hflow" and name == "hflow":
                continue
            target_layer = layer_of(MODULES[target])
            if target_layer > own or (layer in SELF_CONTAINED and target_layer != own):
                upward.append(f"{path.relative_to(HFLOW.parent)} imports {name} ({LAYERS[target_layer][0]})")
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    """Modules, not folders: a module importing its own package's __init__ while the __init__ imports it
    is the one circle Python tolerates by design, so a package's __init__ edges to its children are
    left out."""
    graph = {}
    for name, path in MODULES.items():
        targets = {resolve(imported) for imported in imported_modules(path)} - {None, name}
        if path.name == "__init__.py":
            targets = {t for t in targets if not t.startswith(name + ".")}
        graph[name] = targets
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_no_private_name_imported_across_modules():
    """Shared code is public: `from hflow.x import _helper` in another module means `_helper` belongs in a
    public module (or should not be shared)."""
    private = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hflow"):
                private += [f"{path.relative_to(HFLOW.parent)}: from {node.module} import {alias.name}"
                            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                # `module._name` through an imported hflow module (e.g. fsdp_utils._named_weights)
                if isinstance(node.value, ast.Name) and node.value.id in _imported_hflow_aliases(path):
                    private.append(f"{path.relative_to(HFLOW.parent)}: {node.value.id}.{node.attr}")
    assert not private, "\n".join(private)


def _imported_hflow_aliases(path: Path, _cache={}) -> set[str]:
    if path not in _cache:
        aliases = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hflow"):
                aliases.update(alias.asname or alias.name for alias in node.names
                               if f"{node.module}.{alias.name}" in MODULES)
            elif isinstance(node, ast.Import):
                aliases.update(alias.asname for alias in node.names if alias.name.startswith("hflow") and alias.asname)
        _cache[path] = aliases
    return _cache[path]


def test_no_file_over_700_lines():
    long = [f"{path.relative_to(HFLOW.parent)}: {n} lines" for path in SOURCES
            if (n := len(path.read_text().splitlines())) > 700]
    assert not long, "\n".join(long)
