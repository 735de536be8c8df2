"""The small ``ddlf.IApp`` the accuracy benchmarks share: a task's arrays, preprocessing and model as an app."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def task_app(
    key: str, load: Callable[[], tuple[Any, Any]], prepare: Callable[[Any], Any], build: Callable[[], Any]
) -> Any:
    """An app class whose workers load ``load()`` (``(x, y)``, once per host under ``key``), feed
    ``prepare(x)`` batch by batch and train ``build()``."""
    import ddlf

    class TaskApp(ddlf.IApp):
        dataset_key = key

        def load_dataset(self) -> Any:
            return load()

        def preprocess(self, bx: Any, by: Any) -> Any:
            return prepare(bx), by

        def create_model(self) -> Any:
            return build()

    return TaskApp
