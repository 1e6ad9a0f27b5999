"""Where a command-line tool may write: never over, around or inside what it reads or a training checkpoint.

Every tool of hflow that writes (`hflow.cli.convert_checkpoint`, `hflow.cli.plot`, `hflow.cli.memory_plan`,
`hflow.reward.audit`, the task builders' `--cache-dir`) checks its output here BEFORE doing any work:

- `check_output_folder` / `check_output_file` refuse an output that is, contains or lies inside one of the
  tool's inputs, or a checkpoint folder (an experiment root -- a folder with
  `latest_checkpointed_iteration.txt` or `global_step_*` folders --, a `global_step_N` folder, or a worker's
  checkpoint with `model_optim/`), a file where a folder is meant (or the reverse), and a place that cannot
  be written. Paths are compared after `~`, relative parts, `.`, `..` and symlinks are resolved.
- A folder is replaced (`--overwrite`, a training run's Hugging Face export) only when hflow wrote all of it:
  every folder `staged_folder` writes carries a manifest (`MANIFEST`) of the files in it, and
  `check_replaceable` refuses a non-empty folder without one, or holding anything the manifest does not
  list (a user's file put there later), naming those files. Nothing else is ever taken for an earlier output.
- `staged_folder` / `staged_file` write the new output into a temporary name beside it and rename it into
  place at the end: the old output is removed only once the new one is complete (and, for a folder, only
  after `check_replaceable` passes once more), and a failure part way leaves the old output as it was and
  no half-written one.

A refusal is an `OutputError` (a `UserError`): the tool prints its message as one `hflow: error:` paragraph
and exits with status 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

from hflow.utils.errors import UserError

__all__ = ["MANIFEST", "OutputError", "check_output_file", "check_output_folder", "check_replaceable",
           "checkpoint_around", "is_checkpoint_folder", "paths_in_overrides", "real_path", "staged_file",
           "staged_folder"]

LATEST = "latest_checkpointed_iteration.txt"  # hflow.trainer.checkpoints' marker of an experiment root
MANIFEST = ".hflow-output.json"  # in every folder `staged_folder` writes: who wrote it, and its files
_SCAN_LIMIT = 10_000  # entries of a folder to replace that are searched for checkpoints


class OutputError(UserError, ValueError):
    """An output path that the tool refuses to write; the message names the argument and what to pass."""


def real_path(path: str | os.PathLike) -> Path:
    """`path` with `~` expanded, made absolute and its symlinks resolved (as far as it exists)."""
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop, an unknown ~user
        raise OutputError(f"{path} cannot be resolved to a folder ({err}); pass another path") from None


def is_checkpoint_folder(path: Path) -> bool:
    """An experiment root (a `latest_checkpointed_iteration.txt` or `global_step_*` folders), a step folder
    (`global_step_N`, also its `.incomplete` / `.replaced` copies) or a worker's checkpoint (`model_optim/`)."""
    try:
        if not path.is_dir():
            return False
        if path.name.startswith("global_step_") or (path / LATEST).exists() or (path / "model_optim").is_dir():
            return True
        return any(p.is_dir() for p in path.glob("global_step_*"))
    except OSError:  # unreadable: the write below fails with its own message
        return False


def checkpoint_around(path: Path) -> Path | None:
    """The outermost checkpoint folder that `path` is or lies in (the experiment root when there is one)."""
    found = None
    for folder in (path, *path.parents):
        if is_checkpoint_folder(folder):
            found = folder
    return found


def _checkpoint_within(folder: Path) -> Path | None:
    """A checkpoint folder somewhere below `folder`; `folder` itself when it holds too much to search."""
    seen = 0
    for root, dirs, files in os.walk(folder):
        seen += len(dirs) + len(files)
        if seen > _SCAN_LIMIT:
            return folder
        if LATEST in files or "model_optim" in dirs or any(d.startswith("global_step_") for d in dirs):
            return Path(root)
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_inputs(dst: Path, arg: str, shown: str, inputs: Mapping[str, str | os.PathLike | None], what: str,
                  container: bool) -> None:
    for name, given in inputs.items():
        if given is None:
            continue
        src = real_path(given)
        if dst == src:
            raise OutputError(f"{arg} {shown} is {name} {given}, which this tool reads; writing {what} there "
                              f"would destroy it. Name another {'folder' if container else 'file'} for {arg}")
        if container and _inside(src, dst):
            raise OutputError(f"{arg} {shown} contains {name} {given}, which this tool reads (an output never "
                              f"holds an input: replacing or cleaning it would take the input along). Name a new "
                              f"folder for {what} that is not a parent of {given}, e.g. "
                              f"{dst.parent / (dst.name + '-out')}")
        if _inside(dst, src):
            raise OutputError(f"{arg} {shown} lies inside {name} {given}, which this tool reads; write {what} "
                              f"outside it, e.g. {src.parent / (src.name + '-out')}")


def _check_place(dst: Path, arg: str, shown: str, folder: bool, what: str) -> None:
    """No checkpoint around `dst`, a folder (or file) as meant, a writable existing ancestor."""
    checkpoint = checkpoint_around(dst)
    if checkpoint is not None:
        raise OutputError(f"{arg} {shown} is in the training checkpoint folder {checkpoint} (a run's folder, with "
                          f"global_step_* folders or {LATEST}: the trainer resumes from it and deletes old steps "
                          f"in it); write {what} outside it, e.g. {checkpoint.parent / (checkpoint.name + '-out')}")
    if dst.exists() and dst.is_dir() != folder:
        raise OutputError(f"{arg} {shown} is a {'file' if folder else 'folder'}; name a "
                          f"{'folder' if folder else 'file'} for {what}")
    ancestor = dst.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{arg} {shown} cannot be created: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{arg} {shown} cannot be written: no permission to write in {ancestor}; "
                          "choose a folder you can write to")


def _manifest_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest(folder: Path, written_by: str) -> None:
    (folder / MANIFEST).write_text(json.dumps({"written_by": written_by, "files": _manifest_files(folder)},
                                              indent=1) + "\n")


def _not_written_by_hflow(folder: Path) -> list[str] | None:
    """What in `folder` its manifest does not list (files, and folders holding none of its files); None when
    it has no manifest (or one that cannot be read): hflow did not write the folder."""
    try:
        listed = set(json.loads((folder / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    holders = {str(parent) for name in listed for parent in Path(name).parents}
    foreign = []
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.name == MANIFEST and path.parent == folder:
            continue
        if (path.is_dir() and not path.is_symlink() and name in holders) or (name in listed and path.is_file()):
            continue
        foreign.append(name + ("/" if path.is_dir() else ""))
    return foreign


def check_replaceable(folder: str | os.PathLike, *, arg: str) -> None:
    """Refuse (OutputError) to replace `folder` (given as `arg`) when it exists and is not empty, unless hflow
    wrote it: its manifest (`MANIFEST`) lists everything in it."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    foreign = _not_written_by_hflow(folder)
    if foreign is None:
        raise OutputError(f"{arg} {folder} is not empty and was not written by hflow (it has no {MANIFEST}, the list "
                          "of its files that hflow writes into every output folder), so it is not replaced: "
                          f"its files would be deleted. Name a new or empty folder for {arg} (an output of an older "
                          "hflow, written before the manifest, is not recognised: delete it yourself if you mean to)")
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputError(f"{arg} {folder} holds what hflow did not write there ({shown}; its {MANIFEST} lists the "
                          f"rest), so it is not replaced: that would delete them. Move them out of {folder}, or "
                          f"name a new folder for {arg}")


def check_output_folder(out: str | os.PathLike, *, arg: str, inputs: Mapping[str, str | os.PathLike | None],
                        what: str, overwrite: bool | None = False) -> Path:
    """The resolved folder `out` (argument `arg`) into which a tool writes `what`, or an OutputError.

    `inputs`: {how the message names it: path} of everything the tool reads. `overwrite`: False -- `out` must
    be new or empty; True -- an existing `out` is replaced, and must hold no checkpoint and pass
    `check_replaceable` (hflow wrote all of it); None -- files are added to an existing `out`, nothing is
    removed.
    """
    shown = str(out)
    dst = real_path(out)
    _check_inputs(dst, arg, shown, inputs, what, container=True)
    _check_place(dst, arg, shown, folder=True, what=what)
    if overwrite is None or not dst.is_dir() or not any(dst.iterdir()):
        return dst
    if not overwrite:
        raise OutputError(f"{arg} {shown} exists and is not empty; name a new folder, or pass --overwrite to "
                          f"replace an earlier output of this tool there")
    checkpoint = _checkpoint_within(dst)
    if checkpoint == dst:
        raise OutputError(f"{arg} {shown} holds more than {_SCAN_LIMIT} files and folders, which --overwrite "
                          f"would delete: it is not an earlier output of this tool; name a new folder for {arg}")
    if checkpoint is not None:
        raise OutputError(f"{arg} {shown} holds the training checkpoint folder {checkpoint}, which --overwrite "
                          f"would delete; name a new folder for {arg}")
    check_replaceable(dst, arg=arg)
    return dst


def paths_in_overrides(overrides: list[str]) -> dict[str, str]:
    """{key: path} of the `key=value` overrides (a value may be a list `[a,b]`) whose values name existing
    files or folders -- a model, data files: what a tool given them reads."""
    paths = {}
    for override in overrides:
        key, _, value = override.partition("=")
        for part in value.strip("[]").split(","):
            part = part.strip().strip("'\"")
            if part and os.path.exists(os.path.expanduser(part)):
                name = key.lstrip("+~")
                paths[name if name not in paths else f"{name} ({part})"] = part
    return paths


def check_output_file(out: str | os.PathLike, *, arg: str, inputs: Mapping[str, str | os.PathLike | None],
                      what: str) -> Path:
    """The resolved file `out` (argument `arg`) to which a tool writes `what` (replacing an earlier one), or
    an OutputError: it must not be, or lie in, an input or a checkpoint folder, nor be a folder."""
    shown = str(out)
    dst = real_path(out)
    _check_inputs(dst, arg, shown, inputs, what, container=False)
    _check_place(dst, arg, shown, folder=False, what=what)
    return dst


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_folder(final: Path, written_by: str, arg: str = "the output folder") -> Iterator[Path]:
    """A path beside `final` (in a new temporary folder) for the caller to write the new output to; when the
    block ends without an error the folder gets its manifest (`MANIFEST`: `written_by` and the files
    written) and replaces `final`, which must pass `check_replaceable` (`arg`: how its message names it;
    the old folder is removed after the rename). On an error `final` is left as it was and the partial
    output is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".hflow-tmp", dir=final.parent))
    try:
        new = stage / final.name
        yield new
        if not new.is_dir():
            raise OutputError(f"nothing was written for {final}")
        _write_manifest(new, written_by)
        os.chmod(new, 0o777 & ~_umask())
        check_replaceable(final, arg=arg)
        if final.exists():
            old = stage / (final.name + ".old")
            os.rename(final, old)
            try:
                os.rename(new, final)
            except BaseException:
                os.rename(old, final)
                raise
        else:
            os.rename(new, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def staged_file(final: Path) -> Iterator[Path]:
    """A temporary file beside `final` (same suffix) for the caller to write; it replaces `final` in one
    rename when the block ends without an error, and is removed otherwise."""
    final.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{final.stem}.", suffix=f".hflow-tmp{final.suffix}", dir=final.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
