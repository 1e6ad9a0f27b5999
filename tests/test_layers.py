"""The house's layers point down (docs/architecture.md): a module imports only from its own layer or
below. Checked on the source, so a new upward import fails here rather than in a review.

    trainer -> workers -> single_controller / protocol -> config_schema / algorithms / utils
    workers -> workers/fsdp (the engine: models, FSDP2, checkpoints) -> utils
    workers -> agent (the multi-turn loop, tools) -> utils -> sandbox (stdlib only)
"""

import ast
from pathlib import Path

import pytest

HFLOW = Path(__file__).resolve().parent.parent / "hflow"

# layer (a package or module under hflow/) -> packages it must never import
FORBIDDEN = {
    "algorithms": ("hflow.trainer", "hflow.workers", "hflow.single_controller"),
    "config_schema.py": ("hflow.trainer", "hflow.workers", "hflow.single_controller", "hflow.protocol"),
    "utils": ("hflow.trainer", "hflow.workers", "hflow.single_controller"),
    "protocol": ("hflow.trainer", "hflow.workers", "hflow.single_controller"),
    "single_controller": ("hflow.trainer", "hflow.workers"),
    "workers": ("hflow.trainer",),
    # the workers' engine (model loading, FSDP2, checkpoints): below the workers that use it
    "workers/fsdp": ("hflow.trainer", "hflow.single_controller", "hflow.agent", "hflow.protocol",
                     "hflow.workers.fsdp_workers", "hflow.workers.supervised_workers", "hflow.workers.actor",
                     "hflow.workers.critic", "hflow.workers.rollout", "hflow.workers.sharding_manager",
                     "hflow.workers.reward_manager"),
    "agent": ("hflow.trainer", "hflow.workers", "hflow.single_controller"),
    "sandbox": ("hflow.trainer", "hflow.workers", "hflow.single_controller", "hflow.agent", "hflow.utils",
                "hflow.protocol", "hflow.config_schema", "hflow.algorithms", "hflow.tasks"),
}


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name `path` imports, at any depth (lazy imports inside functions count)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources(layer: str) -> list[Path]:
    root = HFLOW / layer
    return [root] if root.is_file() else sorted(root.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_only_point_down(layer):
    upward = [
        f"{path.relative_to(HFLOW.parent)} imports {name}"
        for path in sources(layer)
        for name in sorted(imported_modules(path))
        if name.startswith(FORBIDDEN[layer])
    ]
    assert not upward, "\n".join(upward)
