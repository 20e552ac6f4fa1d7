"""Draft heads shipped in the repository: configs/heads/MODEL/METHOD (see its README for how each was
trained). Paths are relative to the repository root, where `make` and the scripts run."""

from __future__ import annotations

from pathlib import Path

HEAD_METHODS = ("medusa", "eagle", "eagle3", "mtp")
SHIPPED_HEADS_DIR = Path("configs") / "heads"


def shipped_head(model: str, method: str) -> str | None:
    """The shipped head directory for (model name, head method), or None when there is none."""
    path = SHIPPED_HEADS_DIR / model / method
    return str(path) if method in HEAD_METHODS and (path / "jaxspec_head.json").is_file() else None
