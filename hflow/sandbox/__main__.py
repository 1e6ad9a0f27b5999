"""Run a file in the sandbox and print the result as one JSON object.

    python -m hflow.sandbox prog.py [--stdin input.txt] [--wall-time-s 5] [--url http://host:8080/run_code]

The local sandbox fails closed: where the kernel refuses the namespaces that isolate the code, it
refuses to run it (the message says what is missing and the ways out) unless --allow-unisolated is
given, which runs it anyway after a warning.

Exit status: 0 when the sandbox ran the file (whatever the program did: see "status"), 1 when the
sandbox itself failed or refused ("sandbox_error"), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hflow.sandbox import LocalSandbox, SandboxLimits, make_sandbox, missing_isolation, sandbox_capabilities
from hflow.sandbox.base import sandbox_error_result
from hflow.sandbox.isolation import unisolated_message, warn_unisolated

_PROG = "python -m hflow.sandbox"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="the Python program to run")
    parser.add_argument("--stdin", type=Path, help="a file whose text is the program's standard input")
    parser.add_argument("--url", help="run on this Sandbox Fusion endpoint instead of locally")
    defaults = SandboxLimits()
    for name, kind in (
        ("cpu_time_s", float),
        ("wall_time_s", float),
        ("memory_mb", int),
        ("max_processes", int),
        ("max_output_bytes", int),
        ("max_file_bytes", int),
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"default {getattr(defaults, name)}")
    parser.add_argument("--network", action="store_true", help="allow network access (default: none)")
    parser.add_argument("--allow-unisolated", action="store_true",
                        help="run locally even where the kernel refuses the namespaces that isolate the code "
                             "(default: refuse)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    texts = {}
    for name in ("file", "stdin"):
        path = getattr(args, name)
        if path is None:
            continue
        try:
            texts[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            parser.error(f"cannot read {name} {str(path)!r}: {err}")  # exits 2
    config = {key: value for key, value in vars(args).items() if key not in ("file", "stdin")}
    config["network"] = args.network or None
    config["allow_unisolated"] = args.allow_unisolated or None
    if args.url:
        config["backend"] = "remote"
    try:
        sandbox = make_sandbox(config)
    except ValueError as err:
        parser.error(str(err))
    if isinstance(sandbox, LocalSandbox):
        missing = missing_isolation(sandbox_capabilities(), sandbox.limits.network)
        if missing and not args.allow_unisolated:
            message = unisolated_message(missing, where="cli")
            print(json.dumps(sandbox_error_result(message, time.monotonic()).to_dict()))
            print(f"{_PROG}: error: {message}", file=sys.stderr)
            return 1
        if missing:
            warn_unisolated(missing, [str(args.file)])
    result = sandbox.run(texts["file"], stdin=texts.get("stdin", ""))
    print(json.dumps(result.to_dict()))
    return 1 if result.status == "sandbox_error" else 0


if __name__ == "__main__":
    sys.exit(main())
