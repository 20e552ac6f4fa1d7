"""Files shipped with jaxspec (tree presets, trained draft heads), found from the package, never from
the current folder.

In a source checkout (or an editable install) they live in the repository's `configs/`, next to the
`jaxspec/` package; a built wheel carries the same folder as package data, `jaxspec/configs/`
(setup.py maps one onto the other).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def configs_dir() -> Path:
    """The shipped `configs/` folder: `jaxspec/configs` in an installed wheel, else the checkout's."""
    for candidate in (_PACKAGE_DIR / "configs", _PACKAGE_DIR.parent / "configs"):
        if candidate.is_dir():
            return candidate
    return _PACKAGE_DIR.parent / "configs"  # missing: callers report the path they looked in
