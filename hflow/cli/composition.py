"""The composition table: which of hflow's features combine in one run, read from the checks themselves.

    python -m hflow.cli.composition              # print the table (markdown)
    python -m hflow.cli.composition --write      # write docs/composition.md
    python -m hflow.cli.composition --check      # exit 1 when docs/composition.md disagrees with the checks

Each feature is an *axis*: the overrides that turn it on (with what it needs, such as split placement for
async k-step). For every pair of axes the two sets of overrides are composed onto one configuration of the
node users run (8 devices, GRPO on a small model) and put through what `main_ppo` runs before any process
starts: the typed config, the by-device defaults and preflight. A cell is then

- **tested**: accepted, and `TESTED` names the test that runs the two features together;
- **accepted**: preflight lets it through, but no test runs the pair (so nobody has seen it work);
- **refused**: preflight stops it; the cell quotes the reason the message gives.

The table is generated, never written by hand: `tests/test_composition.py` fails when the committed table
disagrees with the checks, or when a "tested" cell names a test that does not exist.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs" / "composition.md"


@dataclass(frozen=True)
class Axis:
    name: str
    overrides: tuple[str, ...]  # `{assets}` stands for the folder `write_assets` filled


AXES = (
    Axis("split", ("trainer.placement=split", "trainer.rollout_n_gpus=4")),
    Axis("async", ("trainer.placement=split", "trainer.rollout_n_gpus=4", "trainer.async_steps=2",
                   "algorithm.rollout_is=token")),  # (k >= 2: the sampler's log-probs correct the staleness)
    Axis("async-colocate", ("trainer.async_steps=1",)),  # async k-step beside training, on the same devices
    Axis("partial", ("trainer.placement=split", "trainer.rollout_n_gpus=4", "trainer.async_steps=2",
                     "algorithm.rollout_is=token", "actor_rollout_ref.rollout.partial_rollout=true")),
    Axis("multi-turn", ("actor_rollout_ref.rollout.multi_turn.enable=true",)),
    Axis("endpoint", ("actor_rollout_ref.rollout.multi_turn.enable=true",
                      "actor_rollout_ref.rollout.multi_turn.endpoint.enable=true",
                      "actor_rollout_ref.rollout.multi_turn.endpoint.agent_path={assets}/agent.py")),
    Axis("continuous", ("actor_rollout_ref.rollout.admission=continuous",)),
    Axis("tp2", ("actor_rollout_ref.rollout.tensor_model_parallel_size=2",)),
    Axis("router-replay", ("actor_rollout_ref.model.path={assets}/moe", "actor_rollout_ref.actor.router_replay=true")),
    Axis("images", ("data.train_files={assets}/images.parquet", "data.val_files={assets}/images.parquet")),
    Axis("lora", ("actor_rollout_ref.model.lora_rank=8",)),
    Axis("health", ("trainer.health.enable=true",)),
    Axis("deterministic", ("trainer.deterministic=true",)),
    Axis("distill", ("teacher.model.path={assets}/dense", "algorithm.distill.coef=0.1")),
    Axis("critic", ("algorithm.adv_estimator=gae", "critic.model.path={assets}/dense")),
    Axis("turn-rewards", ("actor_rollout_ref.rollout.multi_turn.enable=true", "algorithm.turn_rewards=token")),
    Axis("judge", ("reward_model.enable=true", "reward_model.style=generative",
                   "reward_model.model.path={assets}/dense")),
)

# The node users run: 8 devices, GRPO; the memory plan is off (the assets' models have no weights to plan).
BASE = (
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.model.path={assets}/dense",
    "data.train_files={assets}/train.parquet",
    "data.val_files={assets}/train.parquet",
    "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.n_gpus_per_node=8",
    "trainer.memory_plan=off",
    "ray_init.num_cpus=64",  # the node's CPUs, not this machine's
)

# Pairs a test runs together (a training run, or the workers' own path for the pair), with that test.
ASYNC_AGENT = ("tests/trainer/test_agent_task_learns.py::"
               "test_grpo_learns_with_generation_on_its_own_devices_two_steps_off_with_partial_rollouts")
CONTINUOUS_ASYNC = "tests/trainer/test_async.py::test_continuous_admission_over_two_engines_learns_within_the_bound"
HEALTH_ASYNC = ("tests/trainer/test_async.py::"
                "test_the_health_watch_rolls_back_two_steps_off_dropping_the_batch_the_discarded_weights_sampled")
DETERMINISTIC_ASYNC = ("tests/trainer/test_deterministic.py::"
                       "test_two_deterministic_runs_two_steps_off_write_the_same_metrics_and_checkpoints")
TESTED: dict[frozenset[str], str] = {
    frozenset({"split", "async"}): CONTINUOUS_ASYNC,
    frozenset({"split", "continuous"}): CONTINUOUS_ASYNC,
    frozenset({"async", "continuous"}): CONTINUOUS_ASYNC,
    frozenset({"split", "partial"}): "tests/trainer/test_async.py::test_four_steps_off_with_partial_rollouts_learns_within_the_bound",
    frozenset({"async", "partial"}): "tests/trainer/test_async.py::test_four_steps_off_with_partial_rollouts_learns_within_the_bound",
    frozenset({"split", "multi-turn"}): ASYNC_AGENT,
    frozenset({"async", "multi-turn"}): ASYNC_AGENT,
    frozenset({"partial", "multi-turn"}): ASYNC_AGENT,
    frozenset({"multi-turn", "endpoint"}): ("tests/workers/test_agent_endpoint.py::"
                                            "test_an_openai_agent_through_the_endpoint_gives_hflows_own_trajectories"),
    frozenset({"multi-turn", "critic"}): "tests/trainer/test_agent_task_learns.py::test_gae_learns_on_two_ranks_with_hf_generation",
    frozenset({"async", "distill"}): "tests/trainer/test_distillation_modes.py::test_async_student_with_a_teacher",
    frozenset({"async", "health"}): HEALTH_ASYNC,
    frozenset({"split", "health"}): HEALTH_ASYNC,
    frozenset({"async", "deterministic"}): DETERMINISTIC_ASYNC,
    frozenset({"split", "deterministic"}): DETERMINISTIC_ASYNC,
    frozenset({"lora", "distill"}): "tests/trainer/test_distillation_modes.py::test_lora_student_with_a_teacher",
}


def write_assets(root: Path) -> Path:
    """Model folders (config and tokenizer files, an empty weights file: preflight reads no weights), a
    train file, a train file with images, and an agent function file."""
    models = {"dense": {"model_type": "qwen2", "max_position_embeddings": 512, "vocab_size": 512},
              "moe": {"model_type": "qwen2_moe", "max_position_embeddings": 512, "vocab_size": 512,
                      "num_experts": 4, "num_experts_per_tok": 2}}
    for name, config in models.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "model.safetensors").write_bytes(b"")
        (folder / "tokenizer_config.json").write_text("{}")
    import pandas as pd

    rows = {"data_source": ["hflow/arithmetic"] * 2}
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame({**rows, "images": [[b"png"], [b"png"]]}).to_parquet(root / "images.parquet")
    (root / "agent.py").write_text("def run_episode(base_url, episode_id, row):\n    return None\n")
    return root


_BASE_CONFIGS: dict[Path, object] = {}


def compose_pair(assets: Path, *axes: Axis):
    """The base configuration with the axes' overrides (a later axis's value of a key wins). Hydra composes
    the base once per asset folder; the overrides are then set as `key=value` on a copy, as on a command line."""
    import yaml
    from omegaconf import OmegaConf, open_dict

    if assets not in _BASE_CONFIGS:
        from hydra import compose, initialize_config_dir

        from hflow import CONFIG_DIR

        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            _BASE_CONFIGS[assets] = compose(config_name="ppo_trainer",
                                            overrides=[o.format(assets=assets) for o in BASE])
    config = _BASE_CONFIGS[assets].copy()
    with open_dict(config):
        for override in (o for axis in axes for o in axis.overrides):
            key, value = override.format(assets=assets).split("=", 1)
            OmegaConf.update(config, key, yaml.safe_load(value), merge=False)
    return config


def verdict(assets: Path, *axes: Axis) -> str | None:
    """None when what `main_ppo` checks before any process starts accepts the features together, else the
    refusal's message."""
    from hflow.trainer.config import validate_config
    from hflow.trainer.memory.defaults import resolve_for_run
    from hflow.trainer.preflight import preflight_check
    from hflow.utils.errors import ConfigError

    try:
        config = validate_config(compose_pair(assets, *axes))
        resolve_for_run(config, target="cuda")  # the table is for the GPU node users run
        preflight_check(config)
    except ConfigError as err:
        return " ".join(str(err).replace(str(assets), "{assets}").split())  # the same table from any folder
    return None


def reason(message: str) -> str:
    """The refusal, short enough for a cell: its first error's first sentence, without the numbering."""
    message = re.sub(r"^\d+ problems in the configuration; fix each of them: 1\. ", "", message)
    message = re.split(r" \d+\. ", message, maxsplit=1)[0]  # the first of several errors
    first = re.split(r"(?<=\.)\s", message, maxsplit=1)[0]
    return first.replace("|", "\\|")[:240]


def cells(assets: Path, quiet: bool = True) -> dict[frozenset[str], str]:
    import contextlib
    import io

    alone = {}
    out = {}
    for axis in AXES:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            alone[axis.name] = verdict(assets, axis)
    for a, b in itertools.combinations(AXES, 2):
        pair = frozenset({a.name, b.name})
        if alone[a.name] or alone[b.name]:
            out[pair] = "alone refused"
            continue
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            message = verdict(assets, a, b)
        if message is not None:
            out[pair] = f"refused: {reason(message)}"
        elif pair in TESTED:
            out[pair] = f"tested: `{TESTED[pair]}`"
        else:
            out[pair] = "accepted"
    out.update({frozenset({name}): (f"refused alone: {reason(m)}" if m else "works alone")
                for name, m in alone.items()})
    return out


def render(table: dict[frozenset[str], str]) -> str:
    names = [axis.name for axis in AXES]
    counts = {kind: sum(1 for k, v in table.items() if len(k) == 2 and v.startswith(kind))
              for kind in ("tested", "accepted", "refused")}
    lines = [
        "# Which features combine",
        "",
        "Generated by `python -m hflow.cli.composition --write` from the checks `main_ppo` runs before any",
        "process starts (the typed config, the by-device defaults for a GPU node, preflight), on a node of 8",
        "devices running GRPO. Do not edit by hand: `tests/test_composition.py` fails when this file and the checks",
        "disagree. **tested**: a test runs the two together; **accepted**: preflight lets the pair through, but",
        "no test runs it yet; **refused**: preflight stops it, with the reason quoted.",
        "",
        f"Pairs: {counts['tested']} tested, {counts['accepted']} accepted without a test, "
        f"{counts['refused']} refused.",
        "",
        "## The axes (the overrides each turns on)",
        "",
        "| axis | overrides |",
        "|---|---|",
        *[f"| {axis.name} | `{' '.join(axis.overrides)}` |" for axis in AXES],
        "",
        "## The matrix",
        "",
        "T = tested, a = accepted (no test), **R** = refused (reasons below).",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    mark = {"tested": "T", "accepted": "a", "refused": "**R**", "alone refused": "-"}
    for row in names:
        marks = []
        for col in names:
            if row == col:
                marks.append("·")
                continue
            value = table[frozenset({row, col})]
            marks.append(next(m for k, m in mark.items() if value.startswith(k)))
        lines.append(f"| {row} | " + " | ".join(marks) + " |")
    lines += ["", "## Refused pairs and why", "", "| pair | reason |", "|---|---|"]
    for a, b in itertools.combinations(names, 2):
        value = table[frozenset({a, b})]
        if value.startswith("refused"):
            lines.append(f"| {a} + {b} | {value.removeprefix('refused: ')} |")
    lines += ["", "## Tested pairs", "", "| pair | test |", "|---|---|"]
    for a, b in itertools.combinations(names, 2):
        value = table[frozenset({a, b})]
        if value.startswith("tested"):
            lines.append(f"| {a} + {b} | {value.removeprefix('tested: ')} |")
    refused_alone = [f"- {name}: {table[frozenset({name})]}" for name in names
                     if not table[frozenset({name})].startswith("works")]
    if refused_alone:
        lines += ["", "## Axes refused alone (their pairs are not checked)", "", *refused_alone]
    return "\n".join(lines) + "\n"


def generate() -> str:
    with tempfile.TemporaryDirectory(prefix="hflow-composition-") as tmp:
        return render(cells(write_assets(Path(tmp))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {TABLE.relative_to(REPO)}")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when {TABLE.relative_to(REPO)} is stale")
    args = parser.parse_args(argv)
    text = generate()
    if args.write:
        TABLE.write_text(text)
        print(f"wrote {TABLE}")
    elif args.check:
        if not TABLE.is_file() or TABLE.read_text() != text:
            print(f"{TABLE} disagrees with the checks: run python -m hflow.cli.composition --write", file=sys.stderr)
            return 1
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
