"""Code that lives in or beside the user's script reaches the workers by itself.

Each case runs a real script from its own directory with the workers started in another one (as on a remote
host, where the script's directory does not exist): classes and functions of the script travel by value, local
modules the sent code refers to are shipped, and what cannot be shipped is refused with a message naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import MNIST_DIR


def _run(tmp_path: Path, files: dict[str, str], timeout: float = 180) -> dict:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    for name, text in files.items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    out = subprocess.run(
        [sys.executable, str(project / "main.py")], cwd=elsewhere, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_script_values_functions_and_neighbour_modules_reach_the_workers(tmp_path) -> None:
    files = {
        "util.py": """
            OFFSET = 1000
            def shift(x):
                return x + OFFSET
            """,
        "helper.py": """
            from util import shift
            def triple(x):
                return shift(3 * x)
            class Point:
                def __init__(self, x):
                    self.x = x
            """,
        "pkgmod/__init__.py": "from .inner import name\n",
        "pkgmod/inner.py": "def name():\n    return 'inner'\n",
        "main.py": """
            import dataclasses, json
            import numpy as np
            import ddlf
            import helper
            import pkgmod

            @dataclasses.dataclass
            class Config:
                lr: float
                layers: tuple

            def make():
                return np.arange(12, dtype=np.float32).reshape(6, 2), np.arange(6)

            def apply(worker, f, x):
                return f(x) + worker.id

            def read_cfg(worker):
                cfg = worker.vars["cfg"]
                return [type(cfg).__name__, cfg.lr, list(cfg.layers)]

            def uses_helper(x):
                return helper.triple(x), pkgmod.name()

            def square(x):
                return x * x

            # As on a remote host, where the script's directory does not exist: the master reads its modules
            # (what it ships), then they disappear from this host, so the workers can only use the shipped copies.
            import os, shutil, ddlf.shipping
            for name in ("util", "helper", "pkgmod"):
                ddlf.shipping.Shipment.files(name)
            here = os.path.dirname(os.path.abspath(__file__))
            shutil.rmtree(os.path.join(here, "pkgmod"))
            os.remove(os.path.join(here, "helper.py"))
            os.remove(os.path.join(here, "util.py"))

            out = {}
            with ddlf.Cluster.local(2) as cluster:
                # A dataclass defined in the script: set, used on the workers, and back as the script's own class.
                cluster.set("cfg", Config(0.5, (3, 4)))
                out["cfg_on_workers"] = cluster.run(read_cfg)
                back = cluster.get("cfg")
                out["cfg_back_is_script_class"] = all(isinstance(c, Config) for c in back)
                # A loader function defined in the script.
                desc = cluster.load_dataset("k", make)
                out["dataset_rows"] = [d["rows"] for d in desc]
                # A script function passed as an argument and called there.
                out["function_argument"] = cluster.run(apply, square, 7)
                # A neighbour module (which imports another) and a package, referenced by a script function...
                out["neighbour_modules"] = cluster.run(uses_helper, 2)
                # ...and a neighbour module's own function and class, pickled by reference.
                out["neighbour_function"] = cluster.run(helper.triple, 1)
                out["neighbour_class"] = [p.x for p in cluster.run(lambda p: p, helper.Point(9))]
                out["imported_from"] = cluster.run(lambda: helper.__file__)
            print(json.dumps(out))
            """,
    }
    out = _run(tmp_path, files)
    assert out["cfg_on_workers"] == [["Config", 0.5, [3, 4]]] * 2
    assert out["cfg_back_is_script_class"] is True
    assert out["dataset_rows"] == [6, 6]
    assert out["function_argument"] == [49, 50]
    assert out["neighbour_modules"] == [[1006, "inner"]] * 2
    assert out["neighbour_function"] == [1003, 1003]
    assert out["neighbour_class"] == [9, 9]
    assert all("ddlf-modules-" in path for path in out["imported_from"])  # the shipped copies


def test_an_edited_neighbour_module_reaches_the_workers_again(tmp_path) -> None:
    """A module beside the script edited while the script runs (a notebook's reload): the workers import the new
    version, both for a script function that refers to it and for the module's own function, as the master does
    after ``importlib.reload``."""
    files = {
        "helper.py": "def value():\n    return 1\n",
        "main.py": """
            import importlib, json
            import ddlf
            import helper

            def use():
                return helper.value()

            out = {}
            with ddlf.Cluster.local(2) as cluster:
                out["before"] = cluster.run(use) + cluster.run(helper.value)
                with open(helper.__file__, "w") as f:
                    f.write("def value():\\n    return 20\\n")
                importlib.reload(helper)
                out["after"] = cluster.run(use) + cluster.run(helper.value)
                out["again"] = cluster.run(use)
            print(json.dumps(out))
            """,
    }
    out = _run(tmp_path, files)
    assert out == {"before": [1, 1, 1, 1], "after": [20, 20, 20, 20], "again": [20, 20]}


def test_a_neighbour_module_finds_the_data_beside_it_on_the_same_host(tmp_path) -> None:
    # The master's file exists on this host with the same content: workers import it from there, so a path
    # computed from its __file__ (the data directory beside it) means the same on both sides.
    files = {
        "settings.txt": "lr=0.5\n",
        "paths.py": """
            import os
            HERE = os.path.dirname(os.path.abspath(__file__))
            def read_settings():
                with open(os.path.join(HERE, "settings.txt")) as f:
                    return f.read().strip()
            """,
        "main.py": """
            import json
            import ddlf
            import paths

            with ddlf.Cluster.local(2, preload=None) as cluster:
                print(json.dumps({"settings": cluster.run(lambda: paths.read_settings()),
                                  "here": cluster.run(lambda: paths.HERE), "master": paths.HERE}))
            """,
    }
    out = _run(tmp_path, files)
    assert out["settings"] == ["lr=0.5", "lr=0.5"]
    assert out["here"] == [out["master"]] * 2


@pytest.mark.slow
def test_an_app_importing_a_helper_module_trains(tmp_path) -> None:
    files = {
        "models.py": """
            import keras
            def build():
                model = keras.Sequential([keras.Input(shape=(784,)), keras.layers.Dense(10, "softmax")])
                model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
                return model
            """,
        "main.py": f"""
            import json
            import numpy as np
            import ddlf
            import models

            class App(ddlf.IApp):
                dataset_key = "script-code-mnist"
                def load_dataset(self):
                    (x, y), _ = ddlf.datasets.mnist({str(MNIST_DIR)!r})
                    return x[:1200], y[:1200]
                def preprocess(self, x, y):
                    return x.reshape(len(x), -1).astype(np.float32) / 255.0, y
                def create_model(self):
                    return models.build()

            if __name__ == "__main__":
                with ddlf.Cluster.local(2) as cluster:
                    h = App(cluster).train(epochs=1, batch_size=64, verbose=0)
                    print(json.dumps({{"samples": sum(s.samples for s in h.stats), "loss": h.history["loss"]}}))
            """,
    }
    out = _run(tmp_path, files)
    assert out["samples"] == 1200
    assert len(out["loss"]) == 1 and np_isfinite(out["loss"][0])


def np_isfinite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def test_a_module_over_the_shipping_limit_is_refused_by_name_and_upload_module_still_works(tmp_path) -> None:
    files = {
        "bighelper.py": "DATA = " + repr("x" * 4096) + "\ndef f():\n    return 5\n",
        "main.py": """
            import json
            import ddlf, ddlf.shipping
            import bighelper

            ddlf.shipping.SHIP_LIMIT = 1024  # bighelper.py is over 4 KiB
            out = {}
            with ddlf.Cluster.local(1) as cluster:
                try:
                    cluster.run(lambda: bighelper.f())
                except ddlf.SerializationError as exc:
                    out["error"] = str(exc)
                out["still_serving"] = cluster.run(lambda: "ok")
                cluster.upload_module(bighelper)  # the user's explicit choice has no limit
                out["after_upload"] = cluster.run(lambda: bighelper.f())
            print(json.dumps(out))
            """,
    }
    out = _run(tmp_path, files)
    assert "'bighelper'" in out["error"] and "upload_module('bighelper')" in out["error"]
    assert out["still_serving"] == ["ok"]
    assert out["after_upload"] == [5]


def test_a_helper_module_that_trains_at_import_fails_clearly_instead_of_spawning_workers(tmp_path) -> None:
    """A module beside the script that trains at its top level (no ``__main__`` guard) is imported by the workers
    too: each one's ``Cluster.local`` started workers of its own, and those theirs, until the machine ran out of
    memory. A worker refuses to start workers, so the script fails at once, saying why."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "side.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            import ddlf

            class App(ddlf.IApp):
                dataset_key = "script-code-side"
                def load_dataset(self):
                    rng = np.random.default_rng(0)
                    return rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64)
                def create_model(self):
                    import keras
                    model = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(2, "softmax")])
                    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
                    return model

            with ddlf.Cluster.local(2) as cluster:  # at import: no __main__ guard
                App(cluster).train(epochs=1, batch_size=16, verbose=0)
            """
        )
    )
    (project / "main.py").write_text("import side\n")
    out = subprocess.run(
        [sys.executable, str(project / "main.py")], cwd=project, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0
    assert "Cluster.local() was called inside a ddlf worker" in out.stderr, out.stderr[-4000:]
    assert 'if __name__ == "__main__":' in out.stderr, out.stderr[-4000:]
