from typing import Any

from . import pytree as pytree

def __getattr__(name: str) -> Any: ...
