"""File modes that follow the umask, for what recpipe writes through a temporary file or directory.

``mkstemp`` and ``mkdtemp`` create 0600/0700 on purpose, and safetensors writes its files 0600. What
recpipe leaves behind should look like what any other tool writes: files ``0666 & ~umask`` and
directories ``0777 & ~umask`` (0644 and 0755 with the usual umask 022).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_lock = threading.Lock()


def umask() -> int:
    """The process umask, read without changing it where the kernel allows (Linux >= 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere the umask can only be read by setting it; a file another thread creates in between
    # gets the temporary 022, which is at worst as strict as the usual default.
    with _lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


def follow_umask(root: Path) -> None:
    """chmod ``root`` and everything under it (symlinks untouched) to the umask's modes."""
    files, dirs = file_mode(), dir_mode()
    root = Path(root)
    if root.is_symlink():
        return
    if not root.is_dir():
        os.chmod(root, files)
        return
    os.chmod(root, dirs)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, dirs)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, files)
