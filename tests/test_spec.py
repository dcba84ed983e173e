"""Spec: what a transition holds. Construction errors, inference from examples and gymnasium
spaces, JSON round trips and equality."""

from __future__ import annotations

import json

import numpy as np
import pytest

import shmbuf
from shmbuf import Field, Spec, SpecMismatchError


def test_construction_from_kwargs_mapping_and_fields():
    a = Spec(obs=((4, 84, 84), "uint8"), action=((), "int64"), reward=((), np.float32))
    b = Spec({"obs": ((4, 84, 84), np.uint8), "action": ((), int)}, reward=((), "f4"))
    c = Spec({"obs": Field("obs", (4, 84, 84), np.dtype("u1")), "action": ([], "i8"),
              "reward": ((), "<f4")})
    assert a == b == c
    assert list(a) == ["obs", "action", "reward"] and len(a) == 3
    assert a["obs"] == Field("obs", (4, 84, 84), np.dtype("uint8"))
    assert a["obs"].row_nbytes == 4 * 84 * 84 and a.row_nbytes == 4 * 84 * 84 + 8 + 4
    assert Spec(x=(5, "float32"))["x"].shape == (5,)  # an int shape means (n,)
    assert "obs=((4, 84, 84), 'uint8')" in repr(a)


def test_big_endian_dtypes_are_stored_native():
    spec = Spec(x=((2,), ">f4"))
    assert spec["x"].dtype == np.dtype("<f4") and spec["x"].dtype.isnative


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        ((), {}, "at least one field"),
        (({"x": ((), "f4")},), {"x": ((), "f4")}, "given twice"),
        ((), {"_meta": ((), "f4")}, "'_meta'"),
        (({"": ((), "f4")},), {}, "''"),
        (({"a b": ((), "f4")},), {}, "'a b'"),
        (({1: ((), "f4")},), {}, "1"),
        ((), {"x": "float32"}, "(shape, dtype)"),
        ((), {"x": ((), "float32", "extra")}, "(shape, dtype)"),
        ((), {"x": (("a", 2), "float32")}, "'x'"),
        ((), {"x": ((2.5,), "float32")}, "tuple of ints"),  # was silently truncated to (2,)
        ((), {"x": (("2",), "float32")}, "tuple of ints"),
        ((), {"x": ((-1,), "float32")}, "negative"),
        ((), {"x": (2.5j, "float32")}, "shape must be a tuple of ints"),
        ((), {"x": ((), "nonsense")}, "not a NumPy dtype"),
        ((), {"x": ((), object)}, "not supported"),
        ((), {"x": ((), "U5")}, "not supported"),
        ((), {"x": ((), "datetime64[s]")}, "not supported"),
        ((), {"x": ((), [("a", "f4"), ("b", "i4")])}, "not supported"),
        ((), {"x": ((), "(2,)f4")}, "not supported"),
    ],
)
def test_construction_errors_name_the_field(args, kwargs, needle):
    with pytest.raises(SpecMismatchError) as ei:
        Spec(*args, **kwargs)
    assert needle in str(ei.value)


def test_from_example_infers_the_usual_rl_dtypes():
    spec = Spec.from_example({
        "obs": np.zeros((3, 2), np.float64),
        "pixels": np.zeros((2, 2), np.uint8),
        "action": 3,
        "reward": 1.0,
        "done": True,
        "probs": [0.1, 0.9],
        "count": np.int16(4),
    })
    assert spec == Spec(obs=((3, 2), "float64"), pixels=((2, 2), "uint8"), action=((), "int64"),
                        reward=((), "float32"), done=((), "bool"), probs=((2,), "float64"),
                        count=((), "int16"))
    with pytest.raises(SpecMismatchError, match="'bad'"):
        Spec.from_example({"ok": 1, "bad": {"a": 1}})
    with pytest.raises(SpecMismatchError, match="'text'"):
        Spec.from_example({"text": "hello"})


def test_from_example_rows_can_be_added():
    row = {"obs": np.arange(3, dtype=np.float32), "action": 2, "reward": 0.5, "done": False}
    with shmbuf.ReplayBuffer.create(Spec.from_example(row), capacity=4) as buf:
        with buf.writer() as w:
            w.add(**row)
        got = buf.get([0])
        assert got["obs"].tolist() == [[0, 1, 2]] and got["action"].tolist() == [2]


# --------------------------------------------------------------------------------------------
# gymnasium spaces
# --------------------------------------------------------------------------------------------
gym = pytest.importorskip("gymnasium")
spaces = gym.spaces


def test_from_spaces_box_and_discrete():
    spec = Spec.from_spaces(spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(5))
    assert spec == Spec({
        "obs": ((3,), "float32"), "next_obs": ((3,), "float32"), "action": ((), "int64"),
        "reward": ((), "float32"), "terminated": ((), "bool"), "truncated": ((), "bool"),
    })
    no_next = Spec.from_spaces(spaces.Box(0, 255, (2, 2), np.uint8), spaces.Discrete(2),
                               next_obs=False, reward_dtype="float64")
    assert list(no_next) == ["obs", "action", "reward", "terminated", "truncated"]
    assert no_next["obs"].dtype == np.uint8 and no_next["reward"].dtype == np.float64


def test_from_spaces_multidiscrete_multibinary_and_box_actions():
    spec = Spec.from_spaces(spaces.MultiBinary(4), spaces.MultiDiscrete([3, 4, 5]))
    assert spec["obs"] == Field("obs", (4,), np.dtype("int8"))
    assert spec["action"] == Field("action", (3,), np.dtype("int64"))
    spec = Spec.from_spaces(spaces.MultiBinary((2, 3)), spaces.Box(-2, 2, (6,), np.float64))
    assert spec["obs"].shape == (2, 3) and spec["action"].dtype == np.float64


def test_from_spaces_dict_and_tuple_flatten_to_slash_names():
    obs = spaces.Dict({
        "camera": spaces.Box(0, 255, (3, 8, 8), np.uint8),
        "state": spaces.Dict({"pos": spaces.Box(-1, 1, (3,), np.float32),
                              "mode": spaces.Discrete(4)}),
        "pair": spaces.Tuple((spaces.Discrete(2), spaces.MultiBinary(3))),
    })
    act = spaces.Dict({"steer": spaces.Box(-1, 1, (), np.float32), "gear": spaces.Discrete(3)})
    spec = Spec.from_spaces(obs, act)
    names = list(spec)
    for prefix in ("obs", "next_obs"):
        assert spec[f"{prefix}/camera"] == Field(f"{prefix}/camera", (3, 8, 8), np.dtype("uint8"))
        assert spec[f"{prefix}/state/pos"].shape == (3,)
        assert spec[f"{prefix}/state/mode"].dtype == np.int64
        assert spec[f"{prefix}/pair/0"].shape == ()
        assert spec[f"{prefix}/pair/1"].shape == (3,)
    assert "action/steer" in names and "action/gear" in names
    assert "obs" not in names and "action" not in names
    # Each flattened observation field has its next_obs twin, with the same shape and dtype.
    obs_fields = [n for n in names if n.startswith("obs/")]
    assert len(obs_fields) == 5
    for n in obs_fields:
        twin = spec["next_" + n]
        assert (twin.shape, twin.dtype) == (spec[n].shape, spec[n].dtype)
    # And the spec is usable: a buffer accepts a flattened transition.
    sample_obs = obs.sample()
    with shmbuf.ReplayBuffer.create(spec, capacity=2) as buf:
        with buf.writer() as w:
            row = {n: np.zeros(f.shape, f.dtype) for n, f in spec.items()}
            row["obs/camera"] = sample_obs["camera"]
            w.add(**row)
        assert np.array_equal(buf.get([0])["obs/camera"][0], sample_obs["camera"])


def test_from_spaces_rejects_unsupported_spaces_naming_where():
    with pytest.raises(SpecMismatchError, match="obs/text.*Text"):
        Spec.from_spaces(spaces.Dict({"text": spaces.Text(5)}), spaces.Discrete(2))


def test_from_spaces_rejects_keys_that_are_not_field_names():
    with pytest.raises(SpecMismatchError, match="obs/my camera"):
        Spec.from_spaces(spaces.Dict({"my camera": spaces.Discrete(2)}), spaces.Discrete(2))


# --------------------------------------------------------------------------------------------
# JSON and equality
# --------------------------------------------------------------------------------------------
def test_json_round_trip_preserves_everything():
    spec = Spec({
        "obs/camera": ((3, 8, 8), "uint8"),
        "vec": ((17,), "float64"),
        "c": ((2,), "complex64"),
        "flag": ((), "bool"),
        "big": ((), "uint64"),
        "half": ((4,), "float16"),
        "empty": ((0,), "int32"),
    })
    doc = json.loads(json.dumps(spec.to_json()))
    back = Spec.from_json(doc)
    assert back == spec and hash(back) == hash(spec)
    assert list(back) == list(spec)
    for name in spec:
        assert back[name].shape == spec[name].shape and back[name].dtype == spec[name].dtype


def test_equality_depends_on_names_shapes_dtypes_and_order():
    base = Spec(a=((2,), "f4"), b=((), "i8"))
    assert base == Spec(a=((2,), "float32"), b=((), np.int64))
    assert hash(base) == hash(Spec(a=((2,), "float32"), b=((), np.int64)))
    assert base != Spec(a=((3,), "f4"), b=((), "i8"))
    assert base != Spec(a=((2,), "f8"), b=((), "i8"))
    assert base != Spec(a=((2,), "f4"), c=((), "i8"))
    assert base != Spec(b=((), "i8"), a=((2,), "f4"))  # order is layout: column order differs
    assert base != {"a": ((2,), "f4"), "b": ((), "i8")}
    assert len({base, Spec(a=((2,), "f4"), b=((), "i8"))}) == 1
