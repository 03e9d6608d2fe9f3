"""File helpers shared by the data modules (the bottom of datamodules/: it imports no other project module)."""
from __future__ import annotations

import os
import pathlib
import tempfile


def default_cache_dir() -> pathlib.Path:
    """Where tokenizers and token caches live: ``$DYNCOMP_CACHE``, else ``~/.cache/dyncomp``."""
    return pathlib.Path(os.environ.get("DYNCOMP_CACHE", pathlib.Path.home() / ".cache" / "dyncomp"))


def follow_umask(path) -> None:
    """``mkstemp`` creates files 0600; cache files get the permissions the user's umask gives new files."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def atomic_npy(path: pathlib.Path, array) -> None:
    """``np.save`` to ``path`` through a temporary file beside it (a killed write never leaves a torn array),
    with the umask's permissions (mkstemp's 0600 would hide it from other users of a shared cache)."""
    import numpy as np

    _atomic_write(path, ".npy", lambda tmp: np.save(tmp, array))


def atomic_text(path: pathlib.Path, text: str) -> None:
    """``text`` (UTF-8) to ``path``, as ``atomic_npy`` writes an array."""
    _atomic_write(path, "", lambda tmp: pathlib.Path(tmp).write_text(text, encoding="utf-8"))


def _atomic_write(path: pathlib.Path, suffix: str, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp", suffix=suffix)
    os.close(fd)
    try:
        follow_umask(tmp)
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
