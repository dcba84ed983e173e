"""The seqlock in ``shmbuf.slots``: a row is readable only once stamped even and published, an odd
slot left by a dead writer is never trusted, a new writer restamps idempotently, ``clear`` and
restores leave the windows they always did; ``Writer.add`` (its compiled store, ``_add_c.c``,
where built) leaves the same words as ``slots.write_row``; and no other module of shmbuf stores a
stamp, claim or ``committed``."""

from __future__ import annotations

import ast
import pathlib
import re

import numpy as np
import pytest

import shmbuf
from shmbuf import layout as L
from shmbuf import slots, store

SPEC = shmbuf.Spec(x=((), "int64"), obs=((3,), "float32"))
C = 8
PACKAGE = pathlib.Path(shmbuf.__file__).parent


def rows(start: int, n: int) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n)
    return {"x": i.astype(np.int64), "obs": np.repeat(i[:, None], 3, axis=1).astype(np.float32)}


def row(i: int) -> dict[str, object]:
    return {"x": i, "obs": np.full(3, i, np.float32)}


def word(buf: shmbuf.ReplayBuffer, lane: int, which: int) -> int:
    """Word offset (in ``buf.storage.words``) of lane word ``which`` of ``lane``."""
    return buf._layout.lane_word(lane, which) // 8


def window(buf: shmbuf.ReplayBuffer, lane: int = 0) -> tuple[int, int]:
    win = buf.windows()
    return int(win.lo[lane]), int(win.hi[lane])


def readable(buf: shmbuf.ReplayBuffer, index: int, lane: int = 0) -> bool:
    """Does a checked read of logical ``index`` (window ignored) find it whole?"""
    out = {n: np.empty((1, *f.shape), f.dtype) for n, f in buf.spec.items()}
    return bool(buf.storage.gather(np.array([lane]), np.array([index]), out)[0])


def words_of(buf: shmbuf.ReplayBuffer) -> dict[str, bytes]:
    """What the seqlock and the rows it guards leave: stamps, meta, columns, committed, claim."""
    return {"stamps": buf.storage.stamps.tobytes(), "meta": buf.storage.meta.tobytes(),
            "committed": buf.storage.committed.tobytes(), "reserved": buf.storage.reserved.tobytes(),
            **{n: c.tobytes() for n, c in buf.storage.columns.items()}}


# --------------------------------------------------------------------------------------------
# Writing: claim, odd, payload, even, committed
# --------------------------------------------------------------------------------------------
def test_a_claimed_row_is_readable_only_once_stamped_even_and_published():
    """Every step of one row's write into a full lane, checked from a reader's side: the claim
    takes the slot out of the window, the odd stamp fails the checked read of both the index it
    held and the one being written, an even stamp without ``committed`` is still outside the
    window, and only ``publish`` makes the row readable."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C) as buf:
        with buf.writer() as w:
            w.extend(rows(0, C))
        q, i, s = buf.storage.words, C, 0  # index 8 goes into slot 0, which holds index 0
        assert window(buf) == (0, C) and readable(buf, 0)

        slots.claim(q, word(buf, 0, L.LANE_RESERVED), i + 1)
        assert window(buf) == (1, C)  # the slot about to be rewritten left the window
        assert readable(buf, 0)  # (its stamp still guards it for readers that drew it before)

        slots.mark_writing(buf.storage.stamps, s, i)
        buf.storage.columns["x"][s] = 1000  # half the payload: a torn row
        assert not readable(buf, 0) and not readable(buf, i)
        assert 1000 not in buf.sample(500, rng=0)["x"]

        buf.storage.columns["obs"][s] = 1000.0
        buf.storage.meta[s] = L.pack_meta(0, i)
        slots.mark_held(buf.storage.stamps, s, i)
        assert window(buf) == (1, C)  # held, but not published
        with pytest.raises(shmbuf.StaleIndexError):
            buf.get([i])

        slots.publish(q, word(buf, 0, L.LANE_COMMITTED), i + 1)
        assert window(buf) == (1, C + 1)
        assert buf.get([i])["x"].tolist() == [1000]
        assert not readable(buf, 0)  # index 0 is gone for good


def test_an_odd_slot_left_by_a_dead_writer_is_rejected_and_restamped_idempotently():
    """Exactly what a writer killed in the middle of index 8 leaves (claim, odd stamp, half a
    row, no commit) is refused by the checked read; the next writer takes the lane over at
    ``committed`` and rewrites index 8, leaving the words an uninterrupted writer leaves."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C) as crashed, \
            shmbuf.ReplayBuffer.create(SPEC, capacity=C) as clean:
        with crashed.writer() as w:
            w.extend(rows(0, C))
        slots.claim(crashed.storage.words, word(crashed, 0, L.LANE_RESERVED), C + 1)
        slots.mark_writing(crashed.storage.stamps, 0, C)
        crashed.storage.columns["x"][0] = -1  # ... and the writer died here
        assert not readable(crashed, C) and not readable(crashed, 0)
        assert window(crashed) == (1, C)
        assert -1 not in crashed.sample(500, rng=0)["x"]

        with crashed.writer() as w:  # takes the lane over
            assert w.committed == C
            w.add(**row(C))
        with clean.writer() as w:
            w.extend(rows(0, C))
            w.add(**row(C))
        got, want = words_of(crashed), words_of(clean)
        del want["meta"]  # the new writer opened a new episode: only the episode ids differ
        assert {k: got[k] for k in want} == want
        assert crashed.get([C])["x"].tolist() == [C] and readable(crashed, C)


def test_take_over_trims_a_claim_more_than_a_lap_ahead():
    words = np.zeros(2, np.int64)
    words[:] = [20, 20 + 3 * C]  # committed, reserved: died in an extend of 3 laps
    assert slots.take_over(words, 0, 1, C) == (20, 20 + C)
    assert words.tolist() == [20, 20 + C]
    words[:] = [20, 23]  # an ordinary claim is kept
    assert slots.take_over(words, 0, 1, C) == (20, 23)
    assert words.tolist() == [20, 23]


def test_ring_stamps_agree_with_row_stamps():
    """``mark_ring_writing``/``mark_ring_held`` over a wrapped run stamp what row-by-row
    ``mark_writing``/``mark_held`` stamp."""
    ring, one_by_one = np.zeros(C, np.int64), np.zeros(C, np.int64)
    first, n = 13, 6  # slots 5, 6, 7, 0, 1, 2
    segments = shmbuf.checks.ring_segments(first, n, C)
    slots.mark_ring_writing(ring, segments, first, 2 * np.arange(C), np.zeros((), np.int64))
    for i in range(first, first + n):
        slots.mark_writing(one_by_one, i % C, i)
    assert ring.tolist() == one_by_one.tolist()
    slots.mark_ring_held(ring, segments)
    for i in range(first, first + n):
        slots.mark_held(one_by_one, i % C, i)
    assert ring.tolist() == one_by_one.tolist()
    assert sorted(ring[ring > 0].tolist()) == [L.stamp_held(i) for i in range(first, first + n)]


# --------------------------------------------------------------------------------------------
# Writer.add (compiled: _add_c.c) and the vector writer leave slots.write_row's words
# --------------------------------------------------------------------------------------------
def test_writer_add_leaves_the_words_of_slots_write_row():
    n = 2 * C + 3  # wraps twice
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C) as added, \
            shmbuf.ReplayBuffer.create(SPEC, capacity=C) as reference:
        with added.writer() as w:
            assert w._store.compiled == (store.CompiledStore is not None)
            for i in range(n):
                w.add(**row(i))
        with reference.writer() as w:
            q, lay = reference.storage.words, reference._layout
            at = (lay.stamp(0) // 8, lay.meta.offset // 8, word(reference, 0, L.LANE_COMMITTED),
                  word(reference, 0, L.LANE_RESERVED), C)
            cols = [reference.storage.columns[name][:C] for name in SPEC]
            for i in range(n):
                slots.write_row(q, at, i, cols, list(row(i).values()), L.pack_meta(0, i))
            w._next = n  # (the writer's own count, so that its close() is ordinary)
            del cols
        assert words_of(added) == words_of(reference)


def test_extend_and_add_leave_the_same_words():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C) as by_rows, \
            shmbuf.ReplayBuffer.create(SPEC, capacity=C) as by_batch:
        with by_rows.writer() as w:
            for i in range(C + 5):
                w.add(**row(i))
        with by_batch.writer() as w:
            w.extend(rows(0, 3))
            w.extend(rows(3, C + 2))  # wraps
        assert words_of(by_rows) == words_of(by_batch)


def test_vector_writer_leaves_the_words_of_one_writer_per_lane():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=2) as vector, \
            shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=2) as single:
        with vector.writer(num_envs=2, lanes=[0, 1]) as vw:
            for i in range(C + 3):
                vw.add(x=np.array([i, 100 + i]), obs=np.stack([np.full(3, i, np.float32),
                                                               np.full(3, 100 + i, np.float32)]))
        for lane, base in ((0, 0), (1, 100)):
            with single.writer(lane=lane) as w:
                for i in range(C + 3):
                    w.add(x=base + i, obs=np.full(3, base + i, np.float32))
        assert words_of(vector) == words_of(single)


def test_vector_and_single_writers_end_episodes_alike():
    """Episode ends (FINAL rows of a derived buffer, records, the next episode's lane words) go
    through the one core of both lane writers: a vector writer ending each env's episodes at
    its own steps leaves the words and episode records of one writer per lane doing the same."""
    spec = shmbuf.Spec(obs=((2,), "float32"), x=((), "int64"))
    episode_spec = shmbuf.Spec(score=((), "float64"))
    ends = [[2, 5, 6, 11], [3, 4, 9]]  # steps after which each lane ends an episode
    steps = 12

    def step_row(lane: int, i: int) -> dict[str, object]:
        v = 100 * lane + i
        return {"obs": np.full(2, v, np.float32), "next_obs": np.full(2, v + 0.5, np.float32),
                "x": v}

    kw = dict(capacity=C, lanes=2, next_obs="derived", episode_spec=episode_spec)
    with shmbuf.ReplayBuffer.create(spec, **kw) as vector, \
            shmbuf.ReplayBuffer.create(spec, **kw) as single:
        with vector.writer(num_envs=2, lanes=[0, 1]) as vw:
            for i in range(steps):
                rows = [step_row(k, i) for k in (0, 1)]
                vw.add(**{n: np.stack([np.asarray(r[n]) for r in rows]) for n in rows[0]})
                done = np.array([i in ends[0], i in ends[1]])
                vw.end_episode(done, truncated=np.array([False, True]),
                               score=np.array([i, -i], np.float64))
        for lane in (0, 1):
            with single.writer(lane=lane) as w:
                for i in range(steps):
                    w.add(**step_row(lane, i))
                    if i in ends[lane]:
                        w.end_episode(truncated=bool(lane), score=float(i if lane == 0 else -i))
        assert words_of(vector) == words_of(single)
        got, want = vector.episodes(), single.episodes()
        assert got.keys() == want.keys() and got["episode"].size == 7
        for name in want:
            assert got[name].tolist() == want[name].tolist(), name


# --------------------------------------------------------------------------------------------
# Empty a lane, restore a lane
# --------------------------------------------------------------------------------------------
def test_clear_empties_each_window_at_committed_and_keeps_the_rows():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=2) as buf:
        with buf.writer(lane=0) as w:
            w.extend(rows(0, C + 3))
        with buf.writer(lane=1) as w:
            w.extend(rows(0, 2))
        stamps_before = buf.storage.stamps.tobytes()
        buf.clear()
        assert buf.storage.committed.tolist() == [C + 3, 2]
        assert buf.storage.reserved.tolist() == [C + 3 + C, 2 + C]  # reserved = committed + C
        assert [window(buf, k) for k in (0, 1)] == [(C + 3, C + 3), (2, 2)]
        assert buf.storage.stamps.tobytes() == stamps_before  # rows untouched, only unreachable
        with buf.writer(lane=1) as w:  # the next row is the first readable one again
            w.add(**row(7))
        assert window(buf, 1) == (2, 3) and buf.get([2], lanes=1)["x"].tolist() == [7]


@pytest.mark.parametrize("first,n", [(0, 3), (5, C), (13, 6), (40, 1)])
def test_restore_stamps_exactly_the_rows_copied_and_opens_the_window_at_first(first, n):
    """What ``_restore_lane`` (load, load_state_dict) leaves: the copied indices held in their
    slots, every other slot never-written, ``committed = end``, ``reserved = max(end, first+C)``
    so the window is ``[first, end)``; and nothing readable while the rows are copied."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=2) as buf:
        with buf.writer(lane=1) as w:
            w.extend(rows(0, 2 * C))  # old rows that the restore must hide
        end = first + n
        lease = buf.storage.lock_all_lanes()
        try:
            lane_stamps = buf.storage.stamps[C:]
            at = (word(buf, 1, L.LANE_COMMITTED), word(buf, 1, L.LANE_RESERVED))
            slots.begin_restore(lane_stamps, buf.storage.words, *at, end, C)
            assert window(buf, 1) == (end, end) and not buf.storage.stamps[C:].any()
            segments = shmbuf.checks.ring_segments(first, n, C)
            slots.finish_restore(lane_stamps, segments, first, buf.storage.words, at[1], end, C)
            del lane_stamps
        finally:
            lease.close()
        assert window(buf, 1) == (first, end) and window(buf, 0) == (0, 0)
        assert buf.storage.committed[1] == end and buf.storage.reserved[1] == max(end, first + C)
        want = np.zeros(C, np.int64)
        for i in range(first, end):
            want[i % C] = L.stamp_held(i)
        assert buf.storage.stamps[C:].tolist() == want.tolist()

        # The same through the public path.
        state = buf.state_dict()
        with shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=2) as other:
            other.load_state_dict(state)
            assert [window(other, k) for k in (0, 1)] == [(0, 0), (first, end)]
            assert other.storage.stamps.tolist() == buf.storage.stamps.tolist()


# --------------------------------------------------------------------------------------------
# Checked reads
# --------------------------------------------------------------------------------------------
def test_checked_reads_trust_only_stamps_held_before_and_after():
    expected = slots.held_stamps(np.array([0, 1, 2, 3]))
    assert expected.tolist() == [2, 4, 6, 8]
    before = np.array([2, 4, 5, 8])  # index 2 being written at the first load
    after = np.array([2, 20, 6, 8])  # index 1's slot overwritten meanwhile
    assert slots.held_whole(before, after, expected).tolist() == [True, False, False, True]
    held = np.array([True, True, False, True])
    assert slots.overwritten_since(before, after, held).tolist() == [False, True, False, False]
    is_held, ids = slots.held_records(np.array([0, 1, 2, 7, 8]))
    assert is_held.tolist() == [False, False, True, False, True]
    assert ids[is_held].tolist() == [0, 3]
    records = np.array([L.stamp_held(4), L.stamp_held(5), L.stamp_writing(6), 0], np.int64)

    def copy_while_record_1_is_rewritten():
        records[1] = L.stamp_writing(9)
        return "copied"

    rows, ids, copied = slots.copy_held_records(records, copy_while_record_1_is_rewritten)
    assert (rows.tolist(), ids.tolist(), copied) == ([0], [4], "copied")
    stamps = np.array([L.stamp_held(i) for i in (8, 9, 2, 3, 4, 5, 6, 7)], np.int64)
    segments = shmbuf.checks.ring_segments(6, 4, C)  # indices 6..9 in slots 6, 7, 0, 1
    assert slots.still_held_run(stamps, segments, 0, 6, 10).tolist() == [True] * 4
    stamps[0] = L.stamp_writing(16)
    assert slots.still_held_run(stamps, segments, 0, 6, 10).tolist() == [True, True, False, True]


def test_read_windows_loads_the_claim_before_committed():
    loads = []

    class Recorded(np.ndarray):
        def copy(self, *a, **k):
            loads.append(self.name)
            return np.asarray(self).copy()

    reserved = np.array([30, 5]).view(Recorded)
    reserved.name = "reserved"
    committed = np.array([28, 5]).view(Recorded)
    committed.name = "committed"
    lo, hi = slots.read_windows(reserved, committed, C)
    assert loads == ["reserved", "committed"]
    assert lo.tolist() == [22, 0] and hi.tolist() == [28, 5]
    words = np.array([28, 30])
    assert slots.read_window(words, 1, 0, C) == (22, 28)


# --------------------------------------------------------------------------------------------
# Nothing else in shmbuf stores a seqlock word
# --------------------------------------------------------------------------------------------
SEQLOCK_WORD = re.compile(r"stamp|committed|reserved", re.IGNORECASE)


def _names(node: ast.AST) -> list[str]:
    return [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))]


def _names_a_seqlock_word(node: ast.AST) -> bool:
    """A store target (or an ``out=`` array) that is a stamp, claim or ``committed`` word: a
    subscript of a view so named (``buf._stamps[s]``, ``table.stamp[r]``, ``_reserved_v[k]``)
    or a subscript at an offset so named (``q[self._w_committed]``, ``q[stamp]``)."""
    if isinstance(node, ast.Subscript):
        return any(SEQLOCK_WORD.search(n) for n in _names(node))
    if isinstance(node, (ast.Name, ast.Attribute)):
        return any(SEQLOCK_WORD.search(n) for n in _names(node))
    return False


def _calls_slots(call: ast.Call) -> bool:
    """``slots.something(...)``: the sanctioned way to store (its arguments name the words)."""
    func = call.func
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "slots")


def _stores(tree: ast.AST) -> list[tuple[str, int, str]]:
    """(qualified function, line, source) of every store to a seqlock word in ``tree``."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            targets: list[ast.AST] = []
            if isinstance(child, ast.Assign):
                targets = [t for t in child.targets if isinstance(t, ast.Subscript)]
            elif isinstance(child, ast.AnnAssign):
                targets = [child.target] if isinstance(child.target, ast.Subscript) else []
            elif isinstance(child, ast.AugAssign):  # in place: ``stamps += 1`` stores too
                targets = [child.target]
            elif isinstance(child, ast.Call) and not _calls_slots(child):
                # ufunc/copy outputs: np.add(a, b, stamps[..]), out=stamps, np.copyto(stamps, ..),
                # stamps.fill(..)
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                targets = child.args[2:] + [k.value for k in child.keywords if k.arg == "out"]
                if name == "copyto" and child.args:
                    targets.append(child.args[0])
                if name in ("fill", "put", "itemset") and isinstance(func, ast.Attribute):
                    targets.append(func.value)
            for t in targets:
                if _names_a_seqlock_word(t):
                    found.append((where, child.lineno, ast.unparse(t)))
            visit(child, where)

    visit(tree, "")
    return found


def test_only_slots_stores_stamps_claims_and_committed():
    """No Python code stores a seqlock word but slots.py's (the compiled twin of ``write_row``
    in ``_add_c.c`` is held to it byte for byte by tests/test_add_compiled.py)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "slots.py":
            continue
        for where, line, target in _stores(ast.parse(path.read_text())):
            offenders.append(f"shmbuf/{rel}:{line} ({where}) stores {target}")
    assert not offenders, "seqlock stores outside slots.py:\n" + "\n".join(offenders)


def test_the_store_scan_sees_the_stores_it_must_refuse():
    """The scan above would catch each way this code base ever stored a seqlock word."""
    code = """
def f(self, q, stamps, table, buf, add, one):
    q[self._w_reserved] = 1
    q[stamp] = 2
    self._stamps[0:4] = 0
    table.stamp[r] = 3
    buf._committed_v[lanes] = 4
    q[lay.lane_word(k, L.LANE_RESERVED) // 8] = 5
    add(ramp2[:n], k0, stamps[a:b])
    np.add(view, one, out=stamps)
    self._stamps += 1
"""
    assert len(_stores(ast.parse(code))) == 9
