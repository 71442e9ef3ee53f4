"""One JSON file per cell of a study's grid, so an interrupted grid resumes where it stopped."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


class CellCache:
    """Cells ``(task, method, scale, seed)`` as JSON files under ``directory`` (``None``: cache nothing).

    ``name(task, method, scale, seed)`` gives a cell's file stem. A cached record counts only while
    its ``"config"`` equals ``task.config()``: changing a task's setup re-runs its cells.
    """

    def __init__(self, directory: Path | None, name: Callable[[Any, str, int, int], str]):
        self.directory = directory
        self._name = name

    def path(self, task: Any, method: str, scale: int, seed: int) -> Path:
        return self.directory / f"{self._name(task, method, scale, seed)}.json"

    def get(self, task: Any, method: str, scale: int, seed: int) -> dict | None:
        if self.directory is None:
            return None
        path = self.path(task, method, scale, seed)
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        return record if record.get("config") == json.loads(json.dumps(task.config())) else None

    def put(self, record: dict, task: Any) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(task, record["method"], record["scale"], record["seed"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
