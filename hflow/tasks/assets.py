"""The task assets' cache: what every built-in task module (`builtin_task`, `agent_task`, `judge_task`)
uses to build its data and tiny model once, reproducibly, and find them again.

**The cache protocol** (`ensure_cached_folder`): a task's assets live in one folder of the cache root
(``$HFLOW_CACHE``, default ``~/.cache/hflow``: `hflow.utils.cache.default_cache_root`). A build goes
into a temporary folder beside it (`new_folder` checks that it starts empty), writes its info file and
then its completion marker last (`finish_folder`), and is renamed into place under a file lock, so a
crashed or concurrent build never leaves a half-written folder that is used; a folder whose marker does
not read what the task expects (`has_marker`) is replaced, never used.

**The data**: rows of the hflow data contract, the question as the one user message of the prompt
(`task_row`, `prompt_ids` for its token ids), written as parquet (`write_parquet`).

**The model**: a random tiny Qwen2 pre-trained briefly, seeded and single-threaded (`init_and_pretrain`,
`fit`, `deterministic_torch`), so that the same version and spec give the same bytes (same torch build
and CPU family); where torch cannot be pinned to one thread in this process the build runs in a fresh
interpreter (`pretrained_model`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hflow.utils.cache import default_cache_root

__all__ = [
    "MARKER_NAME",
    "can_pin_one_thread",
    "deterministic_torch",
    "ensure_cached_folder",
    "file_lock",
    "finish_folder",
    "fit",
    "has_marker",
    "init_and_pretrain",
    "make_readable",
    "new_folder",
    "pretrained_model",
    "prompt_ids",
    "quiet_transformers",
    "remove_folder",
    "run_cache_command",
    "sha256_file",
    "spec_digest",
    "task_row",
    "write_parquet",
]

logger = logging.getLogger(__name__)

MARKER_NAME = "COMPLETE"  # the completion marker's file name, in every task's asset folder


# ----------------------------------------------------------------------------------------- data


def task_row(data_source: str, ability: str, question: str, answer: int, extra_info: dict) -> dict:
    """One row of the hflow data contract: the question as the one user message, scored by the answer."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": extra_info,
    }


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The token ids of the chat prompt with `question` as its one user message (as in `task_row`),
    generation prompt included."""
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def write_parquet(rows: list[dict], path: Path) -> None:
    """`rows` (dicts of the same keys) as one parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


# ---------------------------------------------------------------------------------------- model


@contextlib.contextmanager
def deterministic_torch(seed: int) -> Iterator[None]:
    """Seeded, single-threaded, deterministic torch for the duration; the caller's state is restored."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_num_threads(threads)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No "Loading weights" / "Writing model shards" progress bars in the caller's log."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def can_pin_one_thread() -> bool:
    """False when `torch.set_num_threads` has been disabled in this process (an in-process vLLM
    engine replaces it with a no-op), so bit-reproducible training must run in a fresh process."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ok = torch.get_num_threads() == 1
    torch.set_num_threads(before)
    return ok


def fit(model, steps: int, lr: float, warmup_steps: int, batch_loss: Callable[[], Any]):
    """`steps` AdamW steps (betas 0.9/0.98, no weight decay; linear warm-up to `lr`, cosine decay to 0;
    gradients clipped at norm 1) on `batch_loss()`, a fresh batch's loss each call; the model is left in
    eval mode. Returns the last loss."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)

    def lr_factor(step: int) -> float:  # linear warm-up, cosine decay to 0
        return min(1.0, (step + 1) / warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * step / steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        loss = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return loss


def init_and_pretrain(
    model_dir: Path, seed: int, shape: dict, pretrain: Callable[[], dict], **build_kwargs: Any
) -> None:
    """A random tiny Qwen2 (a Qwen3-MoE with `num_experts` in `build_kwargs`) of `shape` (`build_causal_lm`'s shape arguments, `build_kwargs` its others)
    in `model_dir`, then `pretrain()` on it, seeded and single-threaded; its statistics go to
    pretrain_stats.json."""
    from hflow.tasks.tiny_models import build_causal_lm

    arch = "qwen3_moe" if build_kwargs.get("num_experts") else "qwen2"
    with deterministic_torch(seed):
        build_causal_lm(model_dir, preset="tiny", arch=arch, seed=seed, **build_kwargs, **shape)
        stats = pretrain()
    (model_dir / "pretrain_stats.json").write_text(json.dumps(stats))


def pretrained_model(build: Callable[[], None], module: str, model_dir: Path, spec: Any) -> dict:
    """Run `build()` (which writes the model and its pretrain_stats.json) here when torch can be pinned
    to one thread, else in a fresh interpreter as ``python -m <module> --_build-model <model_dir> <spec
    as JSON>`` (the task module's `_main` handles it). Returns the statistics (their file is removed)."""
    if can_pin_one_thread():
        build()
    else:
        cmd = [sys.executable, "-m", module, "--_build-model", str(model_dir), json.dumps(asdict(spec))]
        package_root = str(Path(__file__).resolve().parents[2])  # so that `-m hflow...` imports this hflow
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    stats_file = model_dir / "pretrain_stats.json"
    stats = json.loads(stats_file.read_text())
    stats_file.unlink()
    return stats


# --------------------------------------------------------------------------------------- folder


def spec_digest(fields: dict) -> str:
    """A build spec's short digest (its cache folder's suffix): same fields, same folder."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def new_folder(out_dir: str | Path, builder: str) -> Path:
    """`out_dir`, created if missing; FileExistsError (naming `builder`) if it is not empty."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; {builder} writes into a new folder")
    return out


def finish_folder(
    out: Path, info_name: str, marker_text: str, info: dict, sizes: tuple[int, int], stats: dict, base_model: dict
) -> None:
    """Write the info file (`info`, the (train, val) `sizes`, the pre-training `stats`, the `base_model`
    report and the SHA-256 of every file in `out`), then the completion marker."""
    info = {
        **info,
        "num_train": sizes[0],
        "num_val": sizes[1],
        "pretrain": stats,
        "base_model": base_model,
        "sha256": {str(p.relative_to(out)): sha256_file(p) for p in sorted(out.rglob("*")) if p.is_file()},
    }
    (out / info_name).write_text(json.dumps(info, indent=2) + "\n")
    # Written last: its presence (with the matching content) is what makes the folder usable.
    (out / MARKER_NAME).write_text(marker_text)


def has_marker(folder: Path, marker_text: str, files: Sequence[str]) -> bool:
    """`folder`'s completion marker reads `marker_text`, and `files` and the model's weights exist."""
    try:
        if (folder / MARKER_NAME).read_text() != marker_text:
            return False
    except OSError:
        return False
    model = folder / "model"
    return all(os.path.isfile(p) for p in [*files, model / "config.json", model / "model.safetensors"])


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (POSIX `flock`); a no-op where `fcntl` does not exist."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the temp-folder + rename protocol alone keeps the cache valid
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def make_readable(folder: Path) -> None:
    """Give the tree the permissions of ordinary new files (mkdtemp makes its folder private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def remove_folder(folder: Path) -> None:
    """Move `folder` out of the way atomically, then delete it."""
    trash = folder.with_name(f".{folder.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def ensure_cached_folder(
    cache_dir: str | Path | None,
    name: str,
    is_complete: Callable[[Path], bool],
    build: Callable[[Path], object],
    what: str,
) -> Path:
    """The folder `name` in the cache root `cache_dir` (default `default_cache_root()`), built with
    `build(tmp)` unless it is complete already (`is_complete`).

    The build goes into a temporary folder beside it and is renamed into place, under a file lock in
    the cache root, so a crashed or concurrent build never leaves a half-written folder that is used;
    an incomplete or outdated folder is replaced. `what` names the build in the log.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / name
    if is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{final.name}.lock"):
        if is_complete(final):  # another process built it while we waited for the lock
            return final
        logger.warning("hflow: generating %s into %s", what, final)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            build(tmp)
            make_readable(tmp)
            if final.exists():  # an incomplete or outdated folder: never used, replaced
                remove_folder(final)
            try:
                os.rename(tmp, final)
            except OSError:
                # Only without a lock (no fcntl) can another builder have won the race: use its folder.
                if not is_complete(final):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.warning("hflow: built in %.0f s: %s", time.perf_counter() - t0, final)
    return final


def run_cache_command(cache_dir: str | None, build: Callable[[], int]) -> int:
    """A task builder's command line: `cache_dir` checked before any work (a folder, writable, not in a
    training checkpoint folder: `hflow.utils.safe_output`), then `build()`; a refused or unwritable path is
    one `hflow: error:` paragraph and status 2, no traceback."""
    from hflow.utils.errors import UserError
    from hflow.utils.safe_output import check_output_folder

    try:
        if cache_dir is not None:
            check_output_folder(cache_dir, arg="--cache-dir", what="the cache", inputs={}, overwrite=None)
        return build()
    except UserError as err:
        print(f"hflow: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"hflow: error: {err.filename or cache_dir}: {err.strerror or err}; pass --cache-dir with a folder "
              "you can write (default $HFLOW_CACHE or ~/.cache/hflow)", file=sys.stderr)
        return 2
