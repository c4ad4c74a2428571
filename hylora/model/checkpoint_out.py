"""Writing a model directory all or nothing (`hylora merge`, `hylora quantize`).

The files go into a hidden sibling of OUT_DIR (`.OUT_DIR.partial-<host>-<pid>-<random>`, same file
system), flushed to disk and renamed to OUT_DIR only once every one is written: a run that fails midway
(a full disk, a corrupt input shard, Ctrl-C) removes its sibling and leaves no OUT_DIR, or the empty
directory it was given untouched. A run killed outright (SIGKILL, the OOM killer, a power cut) cannot
remove its sibling; the next run for the same OUT_DIR on that machine does (`remove_stale_partials`).
A model already at OUT_DIR is never written over.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from safetensors import SafetensorError

# safetensors reports its own I/O errors (a full disk, a missing directory) as SafetensorError
_WRITE_ERRORS = (OSError, SafetensorError)
log = logging.getLogger(__name__)


class OutputDirError(ValueError):
    """OUT_DIR cannot be written (it holds something, its parent is not writable) or writing it failed."""


def refuse_filled(out_dir: Path) -> None:
    """An OUT_DIR that is a file or holds anything is never written over (merge, quantize, demo-model)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise OutputDirError(f"{out_dir} is not an empty directory; give a new one")


@contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `out_dir` to write into; on a clean exit it becomes
    `out_dir`, on any exception it is removed (an OSError or SafetensorError raised as OutputDirError).
    `out_dir` must not exist or be an empty directory; missing parents are created."""
    out_dir = Path(out_dir)
    target = Path(os.path.abspath(out_dir))
    try:
        refuse_filled(out_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(target)
        tmp = partial_sibling(target)
        tmp.mkdir()
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise OutputDirError(f"cannot create {out_dir}: {e}") from None
        where = Path(e.filename).parent if e.filename else target.parent
        raise OutputDirError(
            f"cannot create {out_dir}: {where} is not writable ({e.strerror}); "
            "give an OUT_DIR in a directory you can write to"
        ) from None
    try:
        yield tmp
        for path in tmp.rglob("*"):  # contents on disk before the name that says they are complete
            if path.is_file():
                _fsync(path)
        if target.is_dir():  # the empty directory given keeps its permissions
            tmp.chmod(stat.S_IMODE(target.stat().st_mode))
        tmp.replace(target)  # POSIX rename: atomic, and fails (ENOTEMPTY) rather than replace a filled directory
    except _WRITE_ERRORS as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputDirError(f"writing {out_dir} failed ({e}); nothing was left behind") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with suppress(OSError):  # the rename on disk too; some file systems cannot sync a directory
        _fsync(target.parent)


def partial_sibling(target: Path) -> Path:
    """A fresh hidden sibling of `target` to write into before renaming it to `target`."""
    return target.parent / f".{target.name}.partial-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the siblings of `target` that a run on this machine left when it was killed before it could
    (its process is gone), and return them. Those of a running process, of another machine (a shared file
    system) or without a host in their name are kept."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.partial-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}")
    removed = []
    with suppress(OSError):
        for path in target.parent.iterdir():
            match = pattern.fullmatch(path.name)
            if match is None or match["host"] != socket.gethostname() or _running(int(match["pid"])):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed %s, left by a run of pid %s that was killed before it finished", path, match["pid"])
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def checkpoint_copy(model_dir: Path, out_dir: str | Path) -> Iterator[Path]:
    """`atomic_dir(out_dir)` holding `model_dir`'s files other than its weights (config, tokenizer,
    index, ...), for the caller to write the weights into."""
    if Path(out_dir).resolve() == model_dir.resolve():
        raise OutputDirError("the output directory must differ from the model directory")
    with atomic_dir(out_dir) as tmp:
        for item in model_dir.iterdir():
            if item.is_file() and item.suffix != ".safetensors":
                shutil.copy2(item, tmp / item.name)
        yield tmp
