"""Print the memory plan of a run before launching it:

    python -m hflow.cli.memory_plan <the same key=value overrides as hflow.trainer.main_ppo>
        [--device-memory-gb 80 --target cuda] [--no-remedies] [--out plan.md]

The plan itself is `hflow.trainer.memory` (the same one preflight applies with `trainer.memory_plan`). Exit
status 0 when the run fits, 1 when it does not, 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import sys

from omegaconf import DictConfig

from hflow.trainer.memory.facts import GIB
from hflow.trainer.memory.plan import format_plan, plan_memory, remedies
from hflow.utils.errors import UserError
from hflow.utils.safe_output import check_output_file, paths_in_overrides, staged_file


def compose(overrides: list[str]) -> DictConfig:
    """The configuration `hflow.trainer.main_ppo` would run with these overrides (model path filled in)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from hflow import CONFIG_DIR
    from hflow.tasks.defaults import fill_builtin_defaults
    from hflow.trainer.config import validate_config

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = hydra_compose(config_name="ppo_trainer", overrides=overrides)
    config = validate_config(config)
    fill_builtin_defaults(config, frozenset(o.split("=", 1)[0].lstrip("+~") for o in overrides))
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hflow.cli.memory_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for hflow.trainer.main_ppo")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="memory of one device in GiB (default: trainer.device_memory_gb, else this machine's)")
    parser.add_argument("--target", choices=("cuda", "cpu"), default=None,
                        help="plan for GPUs or CPU workers (default: this machine's device)")
    parser.add_argument("--no-remedies", action="store_true", help="do not search for the keys that make it fit")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    try:
        out = None if args.out is None else check_output_file(
            args.out, arg="--out", what="the memory plan", inputs=paths_in_overrides(args.overrides))
        config = compose(args.overrides)
        target = args.target or ("cuda" if _cuda() else "cpu")
        device_bytes = args.device_memory_gb * GIB if args.device_memory_gb else None
        from hflow.trainer.memory.defaults import resolve_for_run

        resolve_for_run(config, target, device_bytes)  # the "by the device" keys, as the trainer resolves them
        plan = plan_memory(config, target, device_bytes)
        found = [] if args.no_remedies else remedies(config, plan, target)
    except UserError as err:
        print(f"hflow: error: {err}", file=sys.stderr)
        return 2
    text = format_plan(plan, found)
    print(text)
    if out is not None:
        try:
            with staged_file(out) as tmp:
                tmp.write_text(text + "\n")
        except OSError as err:
            print(f"hflow: error: --out {args.out}: {err.strerror or err}; name a file you can write",
                  file=sys.stderr)
            return 2
    return 0 if plan.fits else 1


def _cuda() -> bool:
    from hflow.utils import device

    return device.is_cuda()


if __name__ == "__main__":
    sys.exit(main())
