"""How values travel, without daemons: the fast path for plain data, ``__main__`` by value, local modules noted
and capped."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import ddlf
from ddlf import serialization
from ddlf import shipping as upload


def test_plain_data_and_installed_classes_take_the_c_pickler_unchanged() -> None:
    value = {"a": [1, 2.5, "s", b"b", None], "t": (1, 2), "d": np.float64(3), "arr": np.arange(4.0)}
    modules: set[str] = set()
    data, buffers = serialization.dumps(value, modules=modules)
    ref_buffers: list[pickle.PickleBuffer] = []
    assert data == pickle.dumps(value, protocol=5, buffer_callback=ref_buffers.append)
    assert len(buffers) == len(ref_buffers) == 1  # the array's memory travels out of band
    assert modules == set()
    back = serialization.loads(data, [b.raw() for b in buffers])
    assert back["a"] == value["a"] and np.array_equal(back["arr"], value["arr"])


def test_classes_and_functions_of_main_travel_by_value() -> None:
    # A fresh interpreter: the class and the function are defined in __main__, then loaded where __main__ lacks them.
    code = textwrap.dedent(
        """
        import dataclasses, sys
        from ddlf import serialization

        @dataclasses.dataclass
        class Config:
            lr: float

        def loader():
            return 41 + 1

        data, bufs = serialization.dumps({"cfg": Config(0.1), "f": loader})
        sys.stdout.buffer.write(data)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, timeout=60)
    value = serialization.loads(out.stdout)
    assert type(value["cfg"]).__name__ == "Config" and value["cfg"].lr == 0.1
    assert value["f"]() == 42


def test_a_script_run_by_multiprocessing_spawn_travels_by_value(tmp_path) -> None:
    # Under spawn (or forkserver) the child runs the script as __mp_main__: its classes and functions are as much
    # the script's as __main__'s, and no worker can import them.
    script = tmp_path / "sweep.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing as mp, sys
            from ddlf import serialization

            class Config:
                lr = 0.5

            def loader():
                return 41 + 1

            def child(q):
                data, _ = serialization.dumps({"cfg": Config(), "f": loader})
                q.put(data)

            if __name__ == "__main__":
                ctx = mp.get_context("spawn")
                q = ctx.Queue()
                p = ctx.Process(target=child, args=(q,))
                p.start()
                sys.stdout.buffer.write(q.get(timeout=60))
                p.join()
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, check=True, timeout=120)
    value = serialization.loads(out.stdout)
    assert type(value["cfg"]).__name__ == "Config" and value["cfg"].lr == 0.5
    assert value["f"]() == 42


def test_code_sent_by_value_keeps_its_file_name_for_remote_tracebacks() -> None:
    # cloudpickle >= 3.1.3 renames all code "<dynamic-code>"; a worker's traceback would name no file and show no line.
    def outer(x):
        def inner():
            raise ValueError(x)

        return inner

    data, buffers = serialization.dumps(outer(3))
    back = serialization.loads(data, [b.raw() for b in buffers])
    assert back.__code__.co_filename == __file__
    assert back.__code__.co_firstlineno == outer(3).__code__.co_firstlineno
    with pytest.raises(ValueError) as info:
        back()
    frame = info.traceback[-1]
    assert frame.path == __file__ or str(frame.path) == __file__
    assert "raise ValueError(x)" in str(frame.statement)


def test_unpicklable_values_are_refused_with_what_to_send_instead() -> None:
    import threading

    with pytest.raises(ddlf.SerializationError, match="must be picklable"):
        serialization.dumps({"lock": threading.Lock()})


def test_local_modules_are_noted_and_their_imports_followed(tmp_path, monkeypatch) -> None:
    (tmp_path / "loc_a.py").write_text("import loc_b\ndef f():\n    return loc_b.g()\n")
    (tmp_path / "loc_b.py").write_text("def g():\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    upload._verdicts.clear()
    import loc_a

    try:
        modules: set[str] = set()
        serialization.dumps([loc_a.f], modules=modules)
        assert modules == {"loc_a"}
        assert upload.local_closure(modules) == ["loc_a", "loc_b"]
        # A string that merely equals a module's name (a key, a file name) is not a reference to it.
        modules = set()
        serialization.dumps({"loc_a": "loc_b", "loc_a.py": b"loc_b"}, modules=modules)
        assert modules == set()
        # A reference met again later in the stream (memoized) still counts once.
        modules = set()
        serialization.dumps([loc_a.f, loc_a.f, {"k": loc_a.f}], modules=modules)
        assert modules == {"loc_a"}
        # Installed packages, the standard library and ddlf itself are never local.
        assert not any(upload.is_local(m) for m in ("numpy", "json", "ddlf", "ddlf.cluster", "__main__"))
        digest, files = upload.Shipment.files("loc_b")
        assert files == {"loc_b.py": b"def g():\n    return 7\n"} and len(digest) == 64
    finally:
        for name in ("loc_a", "loc_b"):
            sys.modules.pop(name, None)
            upload.Shipment._cache.pop(name, None)
        upload._verdicts.clear()


def test_a_module_beside_the_script_stays_local_when_the_script_puts_another_path_first(tmp_path, monkeypatch) -> None:
    # A script that does sys.path.insert(0, "/somewhere/else") before importing its neighbour: sys.path[0] is no
    # longer its directory, and the neighbour was taken for an installed module the workers could not import.
    script_dir, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    script_dir.mkdir()
    elsewhere.mkdir()
    (script_dir / "main.py").write_text("")
    (script_dir / "loc_near.py").write_text("X = 1\n")
    monkeypatch.chdir(elsewhere)
    monkeypatch.syspath_prepend(str(script_dir))
    monkeypatch.syspath_prepend(str(elsewhere / "lib"))  # sys.path[0] is now neither the script's nor cwd
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script_dir / "main.py"), raising=False)
    upload._verdicts.clear()
    import loc_near  # noqa: F401

    try:
        assert upload.is_local("loc_near")
        assert not upload.is_local("numpy")
    finally:
        sys.modules.pop("loc_near", None)
        upload._verdicts.clear()


def test_a_local_module_over_the_limit_is_refused_by_name(tmp_path, monkeypatch) -> None:
    (tmp_path / "loc_big.py").write_text("X = " + repr("x" * 2000) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(upload, "SHIP_LIMIT", 1000)
    import loc_big  # noqa: F401

    try:
        with pytest.raises(ValueError, match=r"'loc_big' .* over the 1.0 KiB limit.*upload_module\('loc_big'\)"):
            upload.Shipment.files("loc_big")
    finally:
        sys.modules.pop("loc_big", None)
        upload._verdicts.clear()


def test_a_shipment_follows_edits_made_while_the_script_runs(tmp_path, monkeypatch) -> None:
    # The digest must match what a worker on this host would import from disk now; a snapshot from the first read
    # made the worker take a copy after any edit (and __file__-relative data paths broke there).
    pkg = tmp_path / "loc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("A = 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import loc_pkg  # noqa: F401

    try:
        first, files = upload.Shipment.files("loc_pkg")
        assert upload.Shipment.files("loc_pkg")[1] is files  # unchanged: not read again
        (pkg / "helper.py").write_text("B = 2\n")  # a file added under the running script
        second, files2 = upload.Shipment.files("loc_pkg")
        assert second != first and set(files2) == {"loc_pkg/__init__.py", "loc_pkg/helper.py"}
        (pkg / "helper.py").write_text("B = 30\n")  # and edited
        third, _ = upload.Shipment.files("loc_pkg")
        assert third not in (first, second) and third == upload.files_digest(upload.module_files(pkg)[1])
    finally:
        sys.modules.pop("loc_pkg", None)
        upload.Shipment._cache.pop("loc_pkg", None)
        upload._verdicts.clear()


def test_files_digest_tells_versions_apart() -> None:
    a = upload.files_digest({"m.py": b"x = 1\n"})
    assert a == upload.files_digest({"m.py": b"x = 1\n"})
    assert a != upload.files_digest({"m.py": b"x = 2\n"})
    assert a != upload.files_digest({"n.py": b"x = 1\n"})


def test_torch_compiler_after_tensorflow_is_refused_with_the_fix(monkeypatch) -> None:
    from ddlf.frameworks import loading as frameworks

    monkeypatch.setattr(frameworks, "installed", lambda name: True)
    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tensorflow"))
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    monkeypatch.delitem(sys.modules, frameworks.COMPILER_LLVM, raising=False)
    with pytest.raises(RuntimeError, match=r"Load PyTorch first.*--preload torch,keras"):
        frameworks.check_torch_compiler_can_load()
    # The import itself is refused, whatever asks for it (an optimizer built before its TorchModel); once installed
    guard = frameworks._TorchCompilerGuard()
    with pytest.raises(ddlf.FrameworkClash, match="Load PyTorch first"):
        guard.find_spec("torch._dynamo", None)
    assert guard.find_spec("torch.optim", None) is None
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    frameworks.guard_torch_compiler()
    frameworks.guard_torch_compiler()
    assert sum(isinstance(f, frameworks._TorchCompilerGuard) for f in sys.meta_path) == 1
    assert isinstance(sys.meta_path[0], frameworks._TorchCompilerGuard)
    with pytest.raises(ddlf.FrameworkClash, match="Load PyTorch first"):
        guard.find_spec(frameworks.COMPILER_LLVM, None)  # triton's LLVM, which the compiler loads, too
    # The compiler's LLVM loaded before TensorFlow (what a daemon preloading Keras does): the compiler may load now.
    monkeypatch.setitem(sys.modules, frameworks.COMPILER_LLVM, types.ModuleType(frameworks.COMPILER_LLVM))
    frameworks.check_torch_compiler_can_load()
    assert guard.find_spec("torch._dynamo", None) is None
    monkeypatch.delitem(sys.modules, frameworks.COMPILER_LLVM)
    monkeypatch.delitem(sys.modules, "tensorflow")
    frameworks.check_torch_compiler_can_load()  # TensorFlow not loaded: nothing to refuse
    assert guard.find_spec("torch._dynamo", None) is None


def test_a_daemon_preloading_keras_loads_only_the_compilers_llvm_first(monkeypatch) -> None:
    """Before TensorFlow, where the order matters: triton's library alone (0.1 s, not the 3.3 s compiler); the whole
    compiler where that library will not load by itself; nothing once TensorFlow is in or the order does not
    matter."""
    from ddlf.frameworks import loading as frameworks

    loaded: list[str] = []
    whole: list[bool] = []
    monkeypatch.setattr(frameworks, "clash_possible", lambda: True)
    monkeypatch.setattr(frameworks, "load_torch_compiler_first", lambda: whole.append(True))
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    monkeypatch.delitem(sys.modules, frameworks.COMPILER_LLVM, raising=False)
    monkeypatch.setattr(frameworks.importlib, "import_module", lambda name: loaded.append(name))
    frameworks.load_compiler_llvm_first()
    assert loaded == [frameworks.COMPILER_LLVM] and not whole

    def will_not_load(name):
        raise OSError("libtriton.so: cannot open shared object file")

    monkeypatch.setattr(frameworks.importlib, "import_module", will_not_load)
    frameworks.load_compiler_llvm_first()
    assert whole == [True]
    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tensorflow"))
    frameworks.load_compiler_llvm_first()  # too late to choose the order: nothing more is loaded
    monkeypatch.delitem(sys.modules, "tensorflow")
    monkeypatch.setattr(frameworks, "clash_possible", lambda: False)
    frameworks.load_compiler_llvm_first()
    assert whole == [True] and loaded == [frameworks.COMPILER_LLVM]
