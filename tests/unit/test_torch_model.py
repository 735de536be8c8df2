"""TorchModel's handling of structured batches, the pure logic (no torch needed): how a dict of inputs reaches
``forward``, structures sliced and counted, and losses given per output checked."""

from __future__ import annotations

import numpy as np
import pytest

from ddlf.frameworks import torch_batches as tb
from ddlf.frameworks import torch_model as tm


class _Module:
    """Stands in for a torch module: only its ``forward`` signature matters."""

    def __init__(self, forward):
        self.forward = forward


def test_a_dict_goes_by_keyword_when_forward_names_its_keys_else_whole() -> None:
    def two(a, b=None): ...
    def batch(inputs): ...
    def anything(**kwargs): ...
    def positional(*args): ...
    def needs_two(a, c): ...

    assert tb.takes_keywords(_Module(two), ("a", "b"))
    assert tb.takes_keywords(_Module(two), ("a",))
    assert tb.takes_keywords(_Module(anything), ("x", "y"))
    assert tb.takes_keywords(_Module(batch), ("inputs",))  # module(inputs=...): the same call
    assert not tb.takes_keywords(_Module(batch), ("image", "text"))  # module({"image": ..., "text": ...})
    assert not tb.takes_keywords(_Module(two), ("image", "text"))  # b has a default: a takes the dict
    assert not tb.takes_keywords(_Module(positional), ("image",))
    with pytest.raises(TypeError, match=r"keys \['a', 'b'\].*forward\(a, c\)"):
        tb.takes_keywords(_Module(needs_two), ("a", "b"))


def test_structures_are_mapped_sliced_and_counted_as_one_batch() -> None:
    x = {"image": np.zeros((5, 3)), "pair": (np.arange(5), [np.ones((5, 2))])}
    assert tb.count_rows(x) == 5 and tb.count_rows(np.zeros((4, 2))) == 4 and tb.count_rows((np.zeros(3),)) == 3
    part = tb.slice_rows(x, 1, 3)
    assert part["image"].shape == (2, 3) and part["pair"][0].tolist() == [1, 2]
    assert isinstance(part["pair"], tuple) and isinstance(part["pair"][1], list)  # the structure kept
    assert len(tb.leaves(x)) == 3
    with pytest.raises(ValueError, match="no samples"):
        tb.count_rows({})
    assert tb.output_name("digit") == "digit" and tb.output_name(1) == "output_1"


def test_losses_per_output_are_checked_up_front() -> None:
    def ce(o, t): ...
    def mse(o, t): ...

    per = tm.TorchModel._per_output_losses
    assert per(ce, None) is None  # one loss over whatever the module returns
    assert per({"digit": ce, "size": mse, "aux": None}, {"size": 0.5}) == [("digit", ce, 1.0), ("size", mse, 0.5)]
    assert per([ce, None, mse], [1.0, 0.0, 2.0]) == [(0, ce, 1.0), (2, mse, 2.0)]
    with pytest.raises(ValueError, match="loss_weights weigh one loss per output"):
        per(ce, [1.0])
    with pytest.raises(ValueError, match=r"loss_weights for \['sise'\], which loss_fn does not name"):
        per({"size": mse}, {"sise": 2.0})
    with pytest.raises(TypeError, match=r"a loss \(a callable\) or None per output"):
        per({"size": "mse"}, None)
    with pytest.raises(TypeError, match=r"a loss \(a callable\) or None per output"):
        per([None], None)
    with pytest.raises(TypeError, match="one for all outputs"):
        per({"size": mse}, 2.0)


def test_a_missing_output_or_target_is_named() -> None:
    with pytest.raises(ValueError, match=r"output 'size', but the outputs are keys \['digit'\]"):
        tb.entry({"digit": 1}, "size", "output")
    with pytest.raises(ValueError, match="target 2, but the targets are 2 entries"):
        tb.entry((1, 2), 2, "target")
    with pytest.raises(ValueError, match="output 'a', but the outputs are one tensor"):
        tb.entry(np.zeros(3), "a", "output")
