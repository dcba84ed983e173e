"""The compiled ``Writer.add`` (``shmbuf.addcompile``): what a normal writer runs; specs whose
field names would shadow the method's names fall back to the plain method; every input stores
byte-identical rows to the plain ``Writer.add`` and every bad input raises the same error and
changes nothing; a one-env ``VectorWriter`` stores what ``Writer.add`` stores. Every test runs
twice: with the compiled store of a whole row (``_add_c.c``) in front, and without it, as where
no compiler was at hand. The usual inputs take the compiled store; the rest, and waits for
room, take the Python path.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import shmbuf
from shmbuf import addcompile, slots
from shmbuf.writer import Writer

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64"]
SHAPES = [(), (1,), (3,), (2, 3)]


@pytest.fixture(params=["compiled", "python"], autouse=True)
def store_path(request, monkeypatch):
    """The compiled store of a whole row (``_add_c``, skipped where it was not built), or the
    Python path alone."""
    if request.param == "compiled" and addcompile.RowPut is None:
        pytest.skip("_add_c was not built")
    if request.param == "python":
        monkeypatch.setattr(addcompile, "RowPut", None)
    return request.param


@contextlib.contextmanager
def twin_buffers(spec, **kw):
    """Two buffers of ``spec``: rows go to the first through the compiled add, to the second
    through the plain ``Writer.add``."""
    with shmbuf.ReplayBuffer.create(spec, capacity=64, **kw) as a, \
            shmbuf.ReplayBuffer.create(spec, capacity=64, **kw) as b:
        with a.writer(lane=0) as wa, b.writer(lane=0) as wb:
            assert type(wa).add is not Writer.add and hasattr(type(wa).add, "__source__")
            assert (wa._put is None) == (addcompile.RowPut is None)
            yield a, b, wa, wb


# An x87 long double (63-bit mantissa) holds its value in the first 10 of its 16 bytes; the rest
# is padding that NumPy's conversions leave undefined, so it is not compared.
LONG_DOUBLE_BYTES = 10 if np.finfo(np.longdouble).nmant == 63 else np.dtype(np.longdouble).itemsize


def column_bytes(col: np.ndarray) -> bytes:
    """The bytes of a column that hold its values."""
    if col.dtype.base.type not in (np.longdouble, np.clongdouble):
        return col.tobytes()
    size = np.dtype(np.longdouble).itemsize
    parts = np.ascontiguousarray(col).view(np.uint8).reshape(-1, size)
    return parts[:, :LONG_DOUBLE_BYTES].tobytes()


def segment_bytes(buf):
    st = buf.storage
    return (b"".join(column_bytes(c) for c in st.columns.values()), st.stamps.tobytes(),
            st.meta.tobytes(), st.committed.tobytes(), st.reserved.tobytes())


def add_both(wa, wb, row):
    """The same row through both paths: equal results, or the same error type and message."""
    try:
        want = Writer.add(wb, **row)
    except Exception as e:  # noqa: BLE001 - whatever the plain path raises, compare it
        with pytest.raises(type(e)) as got:
            wa.add(**row)
        assert str(got.value) == str(e)
        return None
    assert wa.add(**row) == want
    return want


def inputs_for(dtype: np.dtype, shape: tuple, rng: np.random.Generator) -> list:
    """Every kind of value a field of ``dtype`` and ``shape`` can be given."""
    base = (rng.random(shape) * 100).astype(dtype) if dtype.kind != "b" else rng.random(shape) < .5
    out: list = [base, np.ascontiguousarray(base), base.astype(dtype.newbyteorder(">"))]
    wide = np.zeros((*shape[:-1], 2 * shape[-1]) if shape else (2,), dtype)
    if shape:
        wide[..., ::2] = base
        out.append(wide[..., ::2])  # not contiguous
    else:
        out += [base[()], np.asarray(base), wide[::2][:1].reshape(())]  # scalar, 0-d arrays
    for other in ("int8", "uint8", "int16", "float32", "float64", "int64", "bool"):
        out.append(base.astype(other))  # casts: safe ones store, unsafe ones raise alike
    if shape == ():
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            out += [int(info.min), int(info.max), int(info.min) - 1, int(info.max) + 1, 0, True]
        elif dtype.kind == "f":
            fi = np.finfo(dtype)
            out += [float(fi.max), -float(fi.max), float(fi.max) * 2, 1.5, 7, 2**60, True,
                    float("nan"), float("inf")]
        else:
            out += [True, False, 0, 1, 2, 0.5]
    return out


def python_stores_of(writer, monkeypatch) -> list:
    """Records each row ``slots.write_row`` stores into ``writer``'s lane."""
    stored, write_row = [], slots.write_row

    def recorded(*args):
        if args[5] is writer._cols:
            stored.append(args[4])
        write_row(*args)

    monkeypatch.setattr(slots, "write_row", recorded)
    return stored


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_input_stores_byte_identical_rows_to_the_plain_add(dtype, store_path, monkeypatch):
    """... and where the compiled store exists, it stores every row the checker lets through
    (converted to the field's dtype first where needed): the Python stores are not used."""
    rng = np.random.default_rng(DTYPES.index(dtype))
    dt = np.dtype(dtype)
    spec = shmbuf.Spec({f"f{k}": (shape, dtype) for k, shape in enumerate(SHAPES)}
                       | {"tag": ((), "int64")})
    with twin_buffers(spec) as (a, b, wa, wb):
        python_stored = python_stores_of(wa, monkeypatch)
        for k, shape in enumerate(SHAPES):
            for value in inputs_for(dt, shape, rng):
                row = {f"f{j}": np.zeros(s, dtype) for j, s in enumerate(SHAPES)}
                row[f"f{k}"] = value
                row["tag"] = int(rng.integers(1 << 40))
                add_both(wa, wb, row)
                assert segment_bytes(a) == segment_bytes(b), (shape, type(value), value)
        assert wa.committed > 20
        if store_path == "python":
            assert len(python_stored) == wa.committed
        elif dtype != "float16":  # (Python numbers into float16 are NumPy's to convert)
            assert python_stored == []


def test_mixed_spec_with_derived_next_obs_stores_the_same_rows_and_final_rows():
    spec = shmbuf.Spec(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                       done=((), "bool"))
    with twin_buffers(spec, next_obs="derived") as (a, b, wa, wb):
        for t in range(30):
            o = np.full(4, t, np.float32)
            row = {"obs": o, "action": t % 3, "reward": 0.5 * t, "done": t % 7 == 6,
                   "next_obs": o + 1}
            add_both(wa, wb, row)
            if t % 7 == 6:
                assert wa.end_episode() == wb.end_episode()
        assert segment_bytes(a) == segment_bytes(b)


BAD_ROWS = [
    {},  # nothing
    {"x": 1},  # missing fields
    {"obs": np.zeros(3, np.float32), "action": 1},  # missing reward
    {"obs": np.zeros(3, np.float32), "action": 1, "reward": 0.0, "extra": 1},
    {"obs": np.zeros(4, np.float32), "action": 1, "reward": 0.0},  # wrong shape
    {"obs": np.zeros((1, 3), np.float32), "action": 1, "reward": 0.0},
    {"obs": np.zeros(3, np.complex64), "action": 1, "reward": 0.0},  # unsafe dtype
    {"obs": np.zeros(3, np.float32), "action": 1.5, "reward": 0.0},  # float into int
    {"obs": np.zeros(3, np.float32), "action": 2**63, "reward": 0.0},  # out of range
    {"obs": np.zeros(3, np.float32), "action": "1", "reward": 0.0},
    {"obs": np.zeros(3, np.float32), "action": None, "reward": 0.0},
    {"obs": [0.0, 1.0], "action": 1, "reward": 0.0},
    {"obs": np.zeros(3, np.float32), "action": 1, "reward": np.zeros(2, np.float32)},
]


@pytest.mark.parametrize("k", range(len(BAD_ROWS)))
def test_bad_input_raises_the_same_typed_error_and_changes_nothing(k):
    spec = shmbuf.Spec(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"))
    with twin_buffers(spec) as (a, b, wa, wb):
        good = {"obs": np.ones(3, np.float32), "action": 2, "reward": 1.0}
        add_both(wa, wb, good)
        before = segment_bytes(a)
        with pytest.raises(Exception) as plain:
            Writer.add(wb, **BAD_ROWS[k])
        assert isinstance(plain.value, (shmbuf.ShmbufError, ValueError, TypeError))
        with pytest.raises(type(plain.value)) as compiled:
            wa.add(**BAD_ROWS[k])
        assert str(compiled.value) == str(plain.value)
        assert segment_bytes(a) == before
        assert add_both(wa, wb, good) == 1  # and the writer goes on


@pytest.mark.parametrize("name", ["lane", "i", "q", "s", "slots", "L", "np", "values", "fields"])
def test_a_field_named_like_a_name_of_the_method_falls_back_to_the_plain_add(name):
    spec = shmbuf.Spec({name: ((), "int64"), "x": ((2,), "float32")})
    with shmbuf.ReplayBuffer.create(spec, capacity=8) as buf:
        with buf.writer(lane=0) as w:
            assert type(w).add is Writer.add
            for j in range(10):
                assert w.add(**{name: j, "x": np.full(2, j, np.float32)}) == j
        rows = buf.get(np.arange(2, 10))
        assert rows[name].tolist() == list(range(2, 10))
        assert rows["x"][:, 1].tolist() == list(range(2, 10))
        with buf.writer(num_envs=1) as v:  # the one-env vector writer falls back too
            assert v.add(**{name: np.array([10]), "x": np.full((1, 2), 10, np.float32)}) == [10]


def test_one_env_vector_writer_stores_what_writer_add_stores_and_rejects_two_rows():
    spec = shmbuf.Spec(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"),
                       img=((2, 2), "uint8"))
    with shmbuf.ReplayBuffer.create(spec, capacity=16) as a, \
            shmbuf.ReplayBuffer.create(spec, capacity=16) as b:
        rng = np.random.default_rng(1)
        with a.writer(num_envs=1) as v, b.writer(lane=0) as w:
            assert type(v).add is not Writer.add and hasattr(type(v).add, "__source__")
            for t in range(40):
                row = {"obs": rng.random(3, dtype=np.float32), "action": int(rng.integers(9)),
                       "reward": float(rng.random()),
                       "img": rng.integers(0, 255, (2, 2)).astype(np.uint8)}
                got = v.add(**{k: np.asarray(x, spec[k].dtype)[None] for k, x in row.items()})
                assert got.tolist() == [Writer.add(w, **row)]
                assert got.dtype == np.int64 and got.shape == (1,) and got.flags.writeable
                if t % 9 == 8:
                    v.end_episode(np.array([True]))
                    w.end_episode()
            before = segment_bytes(a)
            assert before == segment_bytes(b)
            two = {k: np.zeros((2, *f.shape), f.dtype) for k, f in spec.items()}
            with pytest.raises((shmbuf.SpecMismatchError, ValueError)):
                v.add(**two)
            assert segment_bytes(a) == before


@pytest.mark.parametrize("make_row", [lambda x: x[None], lambda x: x.reshape(1, *x.shape),
                                      lambda x: np.expand_dims(x, 0)],
                         ids=["x[None]", "reshape", "expand_dims"])
def test_one_env_rows_of_each_usual_making_take_the_fast_path(make_row, monkeypatch):
    """``obs[None]`` has stride 0 on its first axis, ``reshape`` does not: both are one
    C-contiguous row, so both skip the full checker (``_add_checked``)."""
    spec = shmbuf.Spec(obs=((3,), "float32"), img=((2, 2), "uint8"), reward=((), "float32"))
    with shmbuf.ReplayBuffer.create(spec, capacity=16) as buf, buf.writer(num_envs=1) as v:
        slow = []
        monkeypatch.setattr(v, "_add_checked", lambda *a: slow.append(a))
        row = {"obs": np.arange(3, dtype=np.float32), "img": np.ones((2, 2), np.uint8),
               "reward": np.float32(0.5)}
        v.add(**{k: make_row(np.asarray(x)) for k, x in row.items()})
        assert slow == []
        got = buf.get(np.array([0]), 0)
        for k, x in row.items():
            np.testing.assert_array_equal(got[k][0], x)


# --------------------------------------------------------------------------------------------
# Which inputs the compiled store takes
# --------------------------------------------------------------------------------------------
USUAL = shmbuf.Spec(obs=((5,), "float32"), img=((2, 3), "uint8"), action=((), "int64"),
                    reward=((), "float32"), done=((), "bool"), value=((), "float64"))


def usual_row(t: int) -> dict:
    return {"obs": np.full(5, t, np.float32), "img": np.full((2, 3), t % 256, np.uint8),
            "action": t, "reward": 0.5 * t, "done": t % 3 == 0, "value": -1.5 * t}


@contextlib.contextmanager
def counting_python_path(monkeypatch):
    """Counts the rows the full checker took (``_add_checked``), the rows stored through
    ``slots.write_row`` and the waits for room."""
    counts = {"checked": 0, "write_row": 0, "room": 0}
    add_checked, write_row, make_room = Writer._add_checked, slots.write_row, Writer._make_room

    def counted(key, fn):
        def call(*args):
            counts[key] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(Writer, "_add_checked", counted("checked", add_checked))
    monkeypatch.setattr(slots, "write_row", counted("write_row", write_row))
    monkeypatch.setattr(Writer, "_make_room", counted("room", make_room))
    yield counts


def test_the_usual_inputs_take_the_compiled_store_and_the_checked_ones_too(store_path,
                                                                          monkeypatch):
    """Arrays of the field's dtype, Python numbers that fit and the field's own NumPy scalars
    go straight to the compiled store; a value to convert takes the full checker, which gives
    the compiled store values of the fields' dtypes: it stores every row (atari rows stay
    streamed), and they hold what the Python path stores (the byte-identity tests above)."""
    if store_path != "compiled":
        pytest.skip("the compiled store's own inputs")
    own = {"obs": np.zeros(5, np.float32), "img": np.zeros((2, 3), np.uint8),
           "action": np.int64(7), "reward": np.float32(2.5), "done": np.bool_(True),
           "value": np.float64(3.0)}
    converted = [("obs", np.arange(5.0)), ("action", np.int32(3)), ("reward", np.float64(1.0)),
                 ("img", np.eye(2, 3, dtype=bool)), ("value", 2**70)]
    with shmbuf.ReplayBuffer.create(USUAL, capacity=64) as buf, buf.writer() as w, \
            counting_python_path(monkeypatch) as counts:
        for t in range(10):
            w.add(**usual_row(t))
        w.add(**own)
        assert counts == {"checked": 0, "write_row": 0, "room": 1}  # room: the first add
        for k, (name, value) in enumerate(converted):
            w.add(**{**usual_row(20 + k), name: value})
            assert counts == {"checked": 1 + k, "write_row": 0, "room": 1}, name
        rows = buf.get(np.arange(11, 11 + len(converted)))
        for k, (name, value) in enumerate(converted):
            np.testing.assert_array_equal(rows[name][k], np.asarray(value, USUAL[name].dtype))


def test_room_from_the_rate_limiter_is_the_python_paths_business(store_path, monkeypatch):
    """The compiled store stores nothing once the room granted is used up or void (a new
    limiter generation); the Python path waits for room as it always did, then stores the row
    (through the compiled store where there is one)."""
    with shmbuf.ReplayBuffer.create(USUAL, capacity=64) as buf, buf.writer() as w, \
            counting_python_path(monkeypatch) as counts:
        w.add(**usual_row(0))
        w.add(**usual_row(1))
        assert counts["room"] == 1
        w._room_until = w.committed  # used up
        w.add(**usual_row(2))
        w._lim_gen = -1  # void: the pool changed the limit
        w.add(**usual_row(3))
        w.add(**usual_row(4))
        assert counts == {"checked": 0, "room": 3,
                          "write_row": 0 if store_path == "compiled" else 5}
        assert buf.get(np.arange(5))["action"].tolist() == [0, 1, 2, 3, 4]


def test_a_closed_writer_lets_the_buffer_unmap_its_segment(recwarn):
    """The compiled store holds the segment's memory: closing the writer lets it go, so the
    buffer unmaps without its "stays mapped" warning."""
    buf = shmbuf.ReplayBuffer.create(USUAL, capacity=8)
    w = buf.writer()
    w.add(**usual_row(0))
    w.close()
    with pytest.raises(shmbuf.ClosedError):
        w.add(**usual_row(1))
    buf.close()
    assert not [str(x.message) for x in recwarn if "stays mapped" in str(x.message)]


def test_row_put_refuses_what_does_not_fit_its_lane(store_path):
    if store_path != "compiled":
        pytest.skip("_add_c's own checks")
    words = memoryview(bytearray(8 * 64)).cast("q")
    at = (0, 1, 2, 8, 16, 8, (1 << 40) - 1)  # committed, reserved, lim_gen, stamps, meta, C
    f32 = np.dtype(np.float32)

    def field(dest, shape=(3,), numbers=False):
        return (f32, shape, dest, 4 * int(np.prod(shape)), False, numbers, False, False, 1, 0,
                1.0, 0.0)

    addcompile.RowPut(words, at, [field(np.zeros((8, 3), f32))])  # fits
    with pytest.raises(ValueError, match="destination"):
        addcompile.RowPut(words, at, [field(np.zeros((7, 3), f32))])
    with pytest.raises(ValueError, match="outside the segment"):
        addcompile.RowPut(words, (0, 1, 2, 8, 60, 8, 1), [field(np.zeros((8, 3), f32))])
    with pytest.raises(ValueError, match="scalar"):
        addcompile.RowPut(words, at, [field(np.zeros((8, 3), f32), numbers=True)])
    with pytest.raises(ValueError, match="fields"):
        addcompile.RowPut(words, at,
                          [field(np.zeros((8, 3), f32))] * (addcompile.PUT_MAX_FIELDS + 1))
    put = addcompile.RowPut(words, at, [field(np.zeros((8, 3), f32))]).put
    assert put(0, 0, 0, 0, 0, np.ones(3, f32)) is None  # no room: nothing stored
    assert not any(words.tolist())


def test_ci_builds_the_compiled_store(store_path):
    """Where ``SHMBUF_REQUIRE_COMPILED`` is set (``.ci/run``), ``_add_c`` must have been built."""
    import os

    if store_path == "python":
        pytest.skip("a check of the compiled store's build")
    if not os.environ.get("SHMBUF_REQUIRE_COMPILED"):
        pytest.skip("SHMBUF_REQUIRE_COMPILED is not set")
    assert addcompile.RowPut is not None
    with shmbuf.ReplayBuffer.create(USUAL, capacity=4) as buf, buf.writer() as w:
        assert w._put is not None


def test_wide_scalar_fields_store_what_the_plain_add_stores():
    """Scalars wider than the compiled store's scratch (complex of two long doubles) and long
    doubles: a writer opens, and its rows hold what the plain ``add`` stores."""
    spec = shmbuf.Spec(z=((), "clongdouble"), x=((), "longdouble"), c=((), "complex64"),
                       v=((2,), "clongdouble"))
    with twin_buffers(spec) as (a, b, wa, wb):
        for t in range(12):
            row = {"z": np.clongdouble(t + 0.5j) if t % 2 else complex(t, -t),
                   "x": np.longdouble(t) / 3 if t % 3 else float(t), "c": complex(t, 1),
                   "v": np.full(2, t - 1j, np.clongdouble)}
            add_both(wa, wb, row)
        assert segment_bytes(a) == segment_bytes(b)
