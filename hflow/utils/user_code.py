"""Load a function from a user's Python file by path: custom reward functions and the model's function tools.

`FileFunction` pickles as (path, name, kwargs) and re-loads the file in the process that unpickles it, so a
function from a file that is not an importable module can still travel to scoring workers or tool
processes. Errors name the config key (`config_key`) the path and name came from.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hflow.utils.errors import UserError

__all__ = ["FileFunction", "UserFileImportError", "UserFileNotFoundError", "UserFunctionNotCallableError",
           "UserFunctionNotFoundError", "exec_file"]


# path → module, so that a worker (or the driver) executes each file once.
LOADED_FILES: dict[str, ModuleType] = {}


# A file or function name that cannot be used is the user's to fix: UserErrors (the trainer prints
# the message alone), each still the built-in type that callers of FileFunction have always caught.
class UserFileNotFoundError(UserError, FileNotFoundError):
    pass


class UserFileImportError(UserError, RuntimeError):
    pass


class UserFunctionNotFoundError(UserError, AttributeError):
    pass


class UserFunctionNotCallableError(UserError, TypeError):
    pass


class FileFunction:
    """The function `name` defined in the Python file `path`, with `kwargs` bound.

    Pickles as (path, name, kwargs), and the unpickling process loads the file itself: functions of
    a file loaded by path cannot be pickled by reference. Call-time keyword arguments override the
    bound ones. `config_key` names the config section in error messages, whose keys `.path` and `.name`
    hold the file and the function; `spec_key`, where one key holds both as "file.py:name" (a tool's
    `function`), is the key they name instead.
    """

    def __init__(
        self,
        path: str,
        name: str,
        kwargs: dict[str, Any] | None = None,
        config_key: str = "custom_reward_function",
        spec_key: str | None = None,
    ) -> None:
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self.name = name
        self.kwargs = dict(kwargs or {})
        self.config_key = config_key
        self.spec_key = spec_key
        self._fn = self._load()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **{**self.kwargs, **kwargs})

    @property
    def function(self) -> Callable[..., Any]:
        """The function itself, as the file defines it (without the bound kwargs)."""
        return self._fn

    def __repr__(self) -> str:
        return f"FileFunction({self.path!r}, {self.name!r}, kwargs={self.kwargs!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "_fn"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fn = self._load()

    def _load(self) -> Callable[..., Any]:
        spec_key = getattr(self, "spec_key", None)  # (absent from a state pickled before it existed)
        if spec_key:  # one key, "file.py:name": the messages name it and what to write there
            name_key, fix = spec_key, f"name the function to call after the ':' of {spec_key}"
        else:
            name_key, fix = f"{self.config_key}.name", f"set {self.config_key}.name to the function to call"
        if not os.path.isfile(self.path):
            where = spec_key or f"{self.config_key}.path"
            raise UserFileNotFoundError(f"{where}={self.path!r}: no such file")
        module = LOADED_FILES.get(self.path) or exec_file(self.path, self.config_key, spec_key)
        fn = getattr(module, self.name, None)
        if fn is None:
            defined = sorted(key for key, value in vars(module).items() if callable(value) and not key.startswith("_"))
            raise UserFunctionNotFoundError(
                f"{name_key}: {self.path} defines no such function {self.name!r} (it defines {defined}); {fix}"
                if spec_key else
                f"{name_key}={self.name!r}: {self.path} defines no such function (it defines {defined}); {fix}"
            )
        if not callable(fn):
            raise UserFunctionNotCallableError(
                f"{name_key}: {self.path} defines {self.name!r}, but it is not a function; {fix}"
                if spec_key else
                f"{name_key}={self.name!r}: {self.path} defines it, but it is not a function; {fix}")
        return fn


def exec_file(path: str, config_key: str, spec_key: str | None = None) -> ModuleType:
    # A stable module name per file, so classes defined there pickle between processes.
    module_name = "hflow_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        # The user sees this message without a traceback: say where in their file it failed (a
        # SyntaxError's own message names the line; its frames are the compiler's, not the file's).
        lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == path]
        where = f" at line {lines[-1]}" if lines else ""
        key = spec_key or f"{config_key}.path"
        raise UserFileImportError(
            f"{key}={path!r}: importing the file failed{where} with {type(exc).__name__}: {exc}; "
            f"fix the file, or set {key} to another one"
        ) from exc
    LOADED_FILES[path] = module
    return module
