"""The preload hook library: where it is written, `configure_subprocess()`, this process's registration, and the
routing blocks `memory_saver` enters in hook_mode="preload".

The library (built from `rust/preload/cumem_rs_preload.c`, embedded in the extension) defines `cudaMalloc`,
`cudaFree`, `tms_pause` and `tms_resume`. It must be loaded before the CUDA runtime, so it is `LD_PRELOAD`ed into
a process at its start; the extension, imported later, installs its hooks there (`activate`). It is written once
per content to a private directory (mode 0700, owned by this user; the file name holds the content's hash, so
versions never overwrite each other and a written file is never changed), through a temporary file renamed
into place, so concurrent writers and readers only ever see a complete library.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import Optional

from . import _native
from ._native import CumemError, CumemValueError
from ._pools import _get_alloc_conf

_LOCK = threading.Lock()
_PATH: Optional[str] = None
_DIR_MODE = 0o700

# torch settings under which its caching allocator maps memory itself instead of calling cudaMalloc.
_REFUSED_CONF = (
    (re.compile(r"backend\s*:\s*cudaMallocAsync"), "backend:cudaMallocAsync (torch then allocates with "
     "cudaMallocAsync, which the hook does not see)"),
    (re.compile(r"expandable_segments\s*:\s*true", re.IGNORECASE), "expandable_segments:True (torch then maps "
     "memory itself with cuMemCreate, past cudaMalloc)"),
)


def _private_dir() -> str:
    """This user's directory for the library, created 0700; refused if someone else could write into it."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, f"cumem_rs-{os.getuid()}")
    try:
        os.mkdir(path, _DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CumemError(
            f"{path} exists but is not a private directory of this user (mode 0700): refusing to put the preload "
            "library there; remove it or set XDG_RUNTIME_DIR to a private directory"
        )
    return path


def library_path() -> str:
    """The path of the preload hook library, written on first use (see the module docstring)."""
    global _PATH
    with _LOCK:
        if _PATH is not None and os.path.isfile(_PATH):
            return _PATH
        data = _native.preload_library()
        digest = hashlib.sha256(data).hexdigest()[:16]
        directory = _private_dir()
        path = os.path.join(directory, f"libcumem_rs_preload-{digest}.so")
        if not _holds(path, data):
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".preload-", suffix=".so")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o500)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        _PATH = path
        return path


def _holds(path: str, data: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """Put the preload library first in LD_PRELOAD for child processes started inside the block (as
    torch_memory_saver does); the previous value (or its absence) is restored at exit."""
    path = library_path()
    previous = os.environ.get("LD_PRELOAD")
    others = [p for p in (previous or "").split(":") if p and p != path]
    os.environ["LD_PRELOAD"] = ":".join([path, *others])
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = previous


def activate() -> bool:
    """Install the hooks if the library is loaded in this process (idempotent); whether they are installed."""
    return _native.preload_registered() or _native.preload_register()


def active() -> bool:
    """Whether the hooks are installed in this process."""
    return _native.preload_registered()


def check_alloc_conf(environ: Mapping[str, str]) -> None:
    """Refuse torch allocator settings that bypass cudaMalloc (CumemValueError naming the variable, or the
    settings torch holds when they were set at run time)."""
    named = [(name, environ.get(name) or "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")]
    for name, conf in [*named, ("torch's allocator settings", _get_alloc_conf())]:
        for pattern, why in _REFUSED_CONF:
            if pattern.search(conf):
                raise CumemValueError(
                    f"{name}={conf!r} cannot be used with hook_mode='preload': {why}. Remove that setting, or "
                    "use hook_mode='torch'"
                )


@contextlib.contextmanager
def routed(tag: str) -> Iterator[None]:
    """cudaMalloc calls on this thread inside the block are cumem_rs's, under `tag`."""
    _native.preload_push_region(tag)
    try:
        yield
    finally:
        _native.preload_pop()


@contextlib.contextmanager
def forwarded() -> Iterator[None]:
    """cudaMalloc calls on this thread inside the block go to the CUDA runtime (`disable()`)."""
    _native.preload_push_disabled()
    try:
        yield
    finally:
        _native.preload_pop()
