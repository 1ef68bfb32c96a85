"""Worker-side failure recording: the traceback of an uncaught exception goes to the error file.

The launcher names the file in the env contract (``FLEET_ERROR_FILE``, also exported as
``TORCHELASTIC_ERROR_FILE``). The JSON layout is the one torch.distributed.elastic's ``@record``
writes, so either side can read the other's files::

    {"message": {"message": "ValueError: ...",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1732300000"}}}

Use :func:`record` on ``main`` (as with torchrun), or nothing at all: fleetrun runs Python scripts
through :mod:`collective.bootstrap`, which installs :func:`install_excepthook` for you.
Standard library only.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger(__name__)


def _error_file() -> str | None:
    # The one place a worker reads these names besides collective.env: record must work before
    # (and without) parsing the whole contract, e.g. when the contract itself is broken.
    return os.environ.get("FLEET_ERROR_FILE") or os.environ.get("TORCHELASTIC_ERROR_FILE")


def _is_bootstrap_frame(filename: str) -> bool:
    return "runpy" in filename or filename.endswith(os.path.join("collective", "bootstrap.py"))


def trim_traceback(tb: Any) -> Any:
    """Drop the leading frames of fleetrun's bootstrap and runpy: the user's code comes first."""
    start = tb
    while tb is not None and _is_bootstrap_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb if tb is not None else start


def write_error_file(exc: BaseException, path: str | None = None) -> str | None:
    """Write ``exc`` with its traceback to the error file; return the path, or None if unset.

    The first error wins: an existing file is not overwritten (the first exception is the root
    cause; later ones are usually consequences).
    """
    path = path or _error_file()
    if not path or os.path.exists(path):
        return None
    message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    tb = trim_traceback(exc.__traceback__)
    callstack = "".join(traceback.format_exception(type(exc), exc, tb))
    payload = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))},
        }
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(tmp, path)
    return path


def record(fn: F) -> F:
    """Decorator for a worker's ``main``: an exception escaping it is written to the error file
    and re-raised (so the process still exits non-zero with the traceback on stderr)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as exc:
            write_error_file(exc)
            raise

    return wrapper  # type: ignore[return-value]


def install_excepthook() -> None:
    """Record any uncaught exception of this process (chains to the previous hook)."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        tb = trim_traceback(tb)
        if not issubclass(exc_type, (SystemExit, KeyboardInterrupt)):
            try:
                write_error_file(exc.with_traceback(tb))
            except OSError as err:  # the traceback still reaches stderr below
                logger.warning("could not write the error file: %s", err)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


__all__ = ["install_excepthook", "record", "write_error_file"]
