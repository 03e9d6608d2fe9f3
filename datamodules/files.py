"""File helpers shared by the data modules (the bottom of datamodules/: it imports no other project module)."""
from __future__ import annotations

import os
import pathlib


def default_cache_dir() -> pathlib.Path:
    """Where tokenizers and token caches live: ``$DYNCOMP_CACHE``, else ``~/.cache/dyncomp``."""
    return pathlib.Path(os.environ.get("DYNCOMP_CACHE", pathlib.Path.home() / ".cache" / "dyncomp"))


def follow_umask(path) -> None:
    """``mkstemp`` creates files 0600; cache files get the permissions the user's umask gives new files."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
