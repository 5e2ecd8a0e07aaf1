"""Failures a restart would repeat identically (tandem/contract.py's PermanentFailure): a model or data reference that
does not resolve, data the model cannot take, a custom command that cannot start (InvalidModelOrData), a checkpoint
directory that is not the run's to write (worker/checkpoint_owner.py's OwnershipError: CheckpointDirectoryTaken). A
rank that meets one ends its output with the report (the exception's line, then the frame that raised it) and exits
with PERMANENT_FAILURE_EXIT_CODE: the job fails at once with the failure's reason, the report as its message.

Torch-free: a custom command's rank checks its command here before replacing itself with it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.contract import INVALID_MODEL_OR_DATA, PermanentFailure

PYTHON = re.compile(r"python[0-9.]*")
"""The names a Python interpreter goes by (python, python3, python3.11)."""
PYTHON_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}
FIND_MODULE = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"


class InvalidModelOrData(PermanentFailure):
    """The job's model, data or custom command cannot work: the message names the field and the fix."""

    reason = INVALID_MODEL_OR_DATA


def report(error: PermanentFailure) -> str:
    """`<its reason>: <what is wrong and the fix>` and, below it, the frame that raised it (where the failure names
    it: PermanentFailure.names_its_frame)."""
    frame = raising_frame(error) if error.names_its_frame else None
    if frame is None:
        return f"{error.reason}: {error}"
    where = f"{short_path(frame.filename)}:{frame.lineno} in {frame.name}" + (f": {frame.line}" if frame.line else "")
    return f"{error.reason}: {error}\n  raised at {where}"


def raising_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The frame that raised the error `error` was raised from (its root cause), or `error` itself when nothing
    caused it: the innermost frame outside the standard library and torch, whose frames would only say where the
    mistake surfaced."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    for candidate in (root, error):
        frames = [frame for frame in traceback.extract_tb(candidate.__traceback__) if not _library_file(frame.filename)]
        if frames:
            return frames[-1]
    return None


def _library_file(filename: str) -> bool:
    torch = sys.modules.get("torch")
    return library_file(filename, stdlib=sysconfig.get_paths()["stdlib"],
                        torch_dir=str(Path(torch.__file__).parent) if torch else None)


def library_file(filename: str, *, stdlib: str, torch_dir: str | None) -> bool:
    """A frozen module's, the standard library's (not a package installed beside it, in its site-packages) or
    torch's file."""
    installed = bool(set(Path(filename).parts) & {"site-packages", "dist-packages"})
    standard = filename.startswith(stdlib + os.sep) and not installed
    return filename.startswith("<") or standard or bool(torch_dir and filename.startswith(torch_dir + os.sep))


def short_path(filename: str) -> str:
    """`filename` as its module's path (`tandem/worker/user_code.py`, not a site-packages path), where a loaded
    module is that file."""
    module = next((name for name, module in list(sys.modules.items())
                   if getattr(module, "__file__", None) == filename), None)
    return module_path(module, filename) if module else filename


def module_path(module: str, filename: str) -> str:
    """Module `module`'s path from its top package: `a/b.py` for module a.b, `a/b/__init__.py` for package a.b."""
    name = Path(filename).name
    parts = module.split(".")
    return "/".join([*parts, name] if name == "__init__.py" else [*parts[:-1], name])


def _module_found(python: str, module: str | None) -> bool:
    """Whether the interpreter `python` finds `module` (importing its parent packages, as `-m` would)."""
    if not module:
        return False
    return subprocess.run([python, "-c", FIND_MODULE, module], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=60).returncode == 0


def custom_command_problem(argv: Sequence[str], *, which: Callable[[str], str | None] = shutil.which,
                           module_found: Callable[[str, str | None], bool] = _module_found) -> str | None:
    """Why the custom command `argv` (spec.custom.command and args) cannot start, or None: a program not on PATH, a
    Python script that does not exist, a `python -m` module its interpreter cannot find."""
    program = which(argv[0])
    if program is None:
        return (f"spec.custom.command: {argv[0]!r} is not an executable on PATH: install it in the image, or give "
                "its full path")
    if not PYTHON.fullmatch(Path(argv[0]).name):
        return None
    kind, target = python_target(argv[1:])
    if kind == "module" and not module_found(program, target):
        return (f"spec.custom.command: {argv[0]} cannot import module {target!r} (`-m {target}`): install it in the "
                "image, or put its directory on PYTHONPATH")
    if kind == "script" and not Path(target).is_file():
        return (f"spec.custom.command: the Python script {target!r} does not exist (in {Path.cwd()}): give its path "
                "from the working directory, or an absolute one")
    return None


def python_target(arguments: Sequence[str]) -> tuple[str | None, str | None]:
    """What a Python command line runs: ("module", name) for `-m name`, ("script", path), or (None, None) for
    `-c` code or the interactive interpreter."""
    values = iter(arguments)
    for argument in values:
        if argument == "-m":
            return "module", next(values, None)
        if argument == "-c" or argument == "-":
            return None, None
        if argument in PYTHON_OPTIONS_WITH_VALUE:
            next(values, None)
        elif not argument.startswith("-"):
            return "script", argument
    return None, None
