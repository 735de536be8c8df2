"""Training from a folder of JPEG images with real worker daemons: the workers share the host's copy of the encoded
files, decode each batch on the pipeline's Rust threads, and learn; a file that does not decode stops the run with
an error naming its row while the workers keep serving."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

import ddlf

from ..conftest import pooled

Image = pytest.importorskip("PIL.Image")


def write_folder(root, per_class: int = 150, side: int = 24) -> None:
    """Two classes a small CNN tells apart: dark and bright noisy images, as JPEG of varying sizes."""
    rng = np.random.default_rng(0)
    for name, base in (("dark", 60), ("bright", 190)):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = side + int(rng.integers(0, 9)), side + int(rng.integers(0, 9))  # resized on decode
            px = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(px).save(buf, format="JPEG")
            (root / name / f"{i:04d}.jpg").write_bytes(buf.getvalue())


def make_app(path: str, key: str) -> type[ddlf.IApp]:
    class Folder(ddlf.IApp):
        dataset_key = key

        def load_dataset(self):
            return ddlf.datasets.image_folder(path, size=(24, 24), flip=True)

        def create_model(self):
            import keras

            model = keras.Sequential(
                [
                    keras.Input((24, 24, 3)),
                    keras.layers.Rescaling(1 / 255),
                    keras.layers.Conv2D(4, 3, activation="relu"),
                    keras.layers.GlobalAveragePooling2D(),
                    keras.layers.Dense(2, activation="softmax"),
                ]
            )
            model.compile(
                optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
            )
            return model

    return Folder


def test_workers_train_from_an_image_folder_decoded_in_rust(tmp_path) -> None:
    write_folder(tmp_path / "train")
    App = make_app(str(tmp_path / "train"), f"images-{os.getpid()}")
    x_val, y_val = ddlf.datasets.image_folder(tmp_path / "train", size=(24, 24))
    with pooled(2) as c:
        app = App(c)
        h = app.train(epochs=4, batch_size=16, verbose=0, validation_data=(x_val, y_val))
        held = [d for w in c.datasets() for d in w if d["key"] == App.dataset_key]
        # Both workers hold the host's one copy of the encoded files, not decoded pixels.
        assert len(held) == 2 and all(d["node_shared"] and d["rows"] == 300 for d in held)
        assert held[0]["nbytes"] == x_val.nbytes + y_val.nbytes
        assert h.history["val_accuracy"][-1] > 0.9, h.history
        _, acc = app.evaluate(x_val, y_val, batch_size=64)
        assert acc > 0.9
        # Keras's steps: at most that many batches (the pass decodes batch by batch and names its own steps).
        _, first_two = app.evaluate(x_val, y_val, batch_size=64, steps=2)
        assert first_two == app.evaluate(x_val[:128], y_val[:128], batch_size=64)[1]
        assert c.run(lambda: 1) == [1, 1]


def test_an_undecodable_file_fails_the_run_by_row_and_the_workers_keep_serving(tmp_path) -> None:
    write_folder(tmp_path / "train", per_class=20)
    (tmp_path / "train" / "dark" / "zz-broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    App = make_app(str(tmp_path / "train"), f"images-bad-{os.getpid()}")
    with pooled(2) as c:
        with pytest.raises(ddlf.DdlfError, match=r"image at row 40 .*could not be decoded"):
            App(c).train(epochs=1, batch_size=8, verbose=0)
        assert c.run(lambda: "still serving") == ["still serving"] * 2
