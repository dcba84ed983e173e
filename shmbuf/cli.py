"""The ``shmbuf`` command: list, inspect and garbage-collect shared-memory segments.

Subcommands: ``ls``, ``gc``, ``inspect``, ``top`` (``shmbuf.top``), plus any registered under the ``shmbuf.commands``
entry-point group (each a ``register(subparsers)`` function, e.g. ``demo`` from ``workers``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Collection, Sequence
from importlib import metadata
from typing import Any

import numpy as np

from . import layout, top
from .checks import timeout_seconds
from .errors import ShmbufError
from .reclaim import remove_dead
from .scan import SegmentInfo, open_regular, scan
from .segment import Segment, fmt_bytes
from .shmdir import SHM_DIR, normalize_name
from .spec import Spec

PLUGIN_GROUP = "shmbuf.commands"
GC_MIN_AGE_S = 10.0  # an uninitialised segment younger than this may be being created right now


# --------------------------------------------------------------------------------------------
# Reading segments without attaching
# --------------------------------------------------------------------------------------------
def _state(info: SegmentInfo) -> str:
    """``alive``, ``leaked`` (what ``gc`` removes), ``creating`` (uninitialised, young) or
    ``unreadable`` (malformed or not ours: never removed)."""
    if info.error is not None:
        return "unreadable"
    if info.alive:
        return "alive"
    if info.header is None and info.age < GC_MIN_AGE_S:
        return "creating"
    return "leaked"


def _buffer_geometry(info: SegmentInfo) -> tuple[int, int, float | None] | None:
    """(capacity, lanes, fill) of a replay buffer, reading its committed words with pread;
    None where the layout cannot be understood (it is only shown, never acted on)."""
    if info.header is None or info.header.kind != layout.KIND_BUFFER:
        return None
    doc = info.header.doc
    try:
        spec = Spec.from_json(doc["spec"])
        capacity, lanes = int(doc["capacity"]), int(doc["lanes"])
        offsets = layout.buffer_layout(
            [(f.name, f.shape, f.dtype) for f in spec.values()], capacity, lanes,
            len(layout.encode_layout(doc)),
        )
    except Exception:  # noqa: BLE001 - any malformed layout: show no geometry
        return None
    fd = open_regular(os.path.join(SHM_DIR, info.name))
    if fd is None:
        return capacity, lanes, None
    try:
        raw = os.pread(fd, lanes * layout.LANE_LINES * layout.LINE, offsets.lane_offset)
    except OSError:
        return capacity, lanes, None
    finally:
        os.close(fd)
    if len(raw) != lanes * layout.LANE_LINES * layout.LINE:
        return capacity, lanes, None
    words = np.frombuffer(raw, "<i8").reshape(lanes, layout.LANE_LINES, layout.WORDS_PER_LINE)
    held = np.minimum(words[:, layout.LANE_COMMITTED, 0], capacity).sum()
    return capacity, lanes, float(held) / (capacity * lanes)


def _describe(info: SegmentInfo) -> dict[str, Any]:
    geometry = _buffer_geometry(info)
    capacity, lanes, fill = geometry if geometry is not None else (None, None, None)
    weights = top.read_weights(info)  # a weight store's published version; None for the rest
    header = info.header
    return {
        "name": info.name,
        "kind": info.kind_name,
        "owner_pid": header.owner_pid if header is not None else None,
        "state": _state(info),
        "alive": info.alive,
        "size": info.size,
        "capacity": capacity,
        "lanes": lanes,
        "fill": fill,
        "version": weights.version if weights is not None else None,
        "created": header.created if header is not None else None,
        "age_s": round(info.age, 3),
        "error": info.error,
    }


def _table(rows: list[list[str]], right: Collection[int] = ()) -> str:
    columns = range(len(rows[0]))
    widths = [max(len(r[i]) for r in rows) for i in columns]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, c, w in zip(columns, r, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _dash(value: Any, fmt: Callable[[Any], str] = str) -> str:
    return "-" if value is None else fmt(value)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    """``shmbuf ls [--json]``: every shmbuf segment of this user, alive or leaked."""
    segments = [_describe(info) for info in scan()]
    if args.json:
        print(json.dumps(segments, indent=1))
        return 0
    if not segments:
        print(f"no shmbuf segments in {SHM_DIR}")
        return 0
    rows = [["NAME", "KIND", "OWNER", "STATE", "SIZE", "CAPACITY", "LANES", "FILL"]]
    for s in segments:
        rows.append([
            s["name"], s["kind"], _dash(s["owner_pid"]), s["state"], fmt_bytes(s["size"]),
            _dash(s["capacity"]), _dash(s["lanes"]), _dash(s["fill"], lambda f: f"{f:.1%}"),
        ])
    if any(s["version"] is not None for s in segments):  # weight stores: their version too
        rows[0].append("VERSION")
        for row, s in zip(rows[1:], segments):
            row.append(_dash(s["version"]))
    print(_table(rows, right={2, 4, 5, 6, 7, 8}))
    leaked = sum(s["state"] == "leaked" for s in segments)
    if leaked:
        print(f"\n{leaked} leaked segment(s): `shmbuf gc` removes them")
    unreadable = [s for s in segments if s["state"] == "unreadable"]
    if unreadable:
        print(f"\n{len(unreadable)} unreadable file(s), which `shmbuf gc` never removes:")
        for s in unreadable:
            print(f"  {s['name']}: {s['error']}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """``shmbuf gc [--dry-run] [NAME ...]``: unlink leaked segments, never a live one.

    Leaked: the owner lease is free (its creator died without unlinking). A segment without a
    header yet is left alone for ``GC_MIN_AGE_S``: its creator may be initialising it right now.
    Only files that validate as shmbuf segments are removed: an unreadable one (malformed, or
    merely named ``shmbuf-*``) is kept and reported.
    """
    wanted = {normalize_name(n) for n in args.names}
    found: set[str] = set()
    removed = freed = unreadable = 0
    for info in scan():
        if wanted and info.name not in wanted:
            continue
        found.add(info.name)
        state = _state(info)
        if state != "leaked":
            if wanted:
                print(f"kept {info.name}: {state}" + (f" ({info.error})" if info.error else ""))
            unreadable += state == "unreadable"
            continue
        owner = f"owner pid {info.header.owner_pid}" if info.header else "never initialised"
        what = f"{info.name} ({info.kind_name}, {owner}, {fmt_bytes(info.size)})"
        if args.dry_run:
            print(f"would remove {what}")
        elif remove_dead(info.name):  # claimed first: never one a successor just adopted
            print(f"removed {what}")
        else:
            continue
        removed += 1
        freed += info.size
    for name in sorted(wanted - found):
        print(f"shmbuf gc: no shmbuf segment named {name!r}", file=sys.stderr)
    verb = "would free" if args.dry_run else "freed"
    if removed:
        print(f"{removed} leaked segment(s), {verb} {fmt_bytes(freed)}")
    else:
        print("no leaked segments")
    if unreadable and not wanted:
        print(f"kept {unreadable} unreadable file(s): `shmbuf ls` says why")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """``shmbuf inspect [--json] NAME``: header, and for a buffer its spec and per-lane stats."""
    from .buffer import ReplayBuffer

    seg = Segment.attach(args.name, timeout=args.timeout)
    try:
        header = seg.header
        info: dict[str, Any] = {
            "name": seg.name,
            "kind": layout.kind_name(header.kind),
            "format_version": header.version,
            "owner_pid": header.owner_pid,
            "owner_alive": seg.owner_alive(),
            "owner_uid": header.owner_uid,
            "created": header.created,
            "size": header.total_size,
        }
        kind = header.kind
    finally:
        seg.close()
    if kind == layout.KIND_BUFFER:
        with ReplayBuffer.attach(args.name, timeout=args.timeout) as buf:
            info["spec"] = buf.spec.to_json()
            info["stats"] = buf.stats()
    else:
        info["layout"] = header.doc
    if kind == layout.KIND_WEIGHTS:
        from .weights import WeightStore

        with WeightStore.attach(args.name, timeout=args.timeout) as store:
            info["version"] = store.version
    if args.json:
        print(json.dumps(info, indent=1, default=_json_default))
    else:
        print(_format_inspect(info))
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _format_inspect(info: dict[str, Any]) -> str:
    age = time.time() - info["created"]
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["created"]))
    out = [
        f"name:     {info['name']}",
        f"kind:     {info['kind']} (format {info['format_version']})",
        f"owner:    pid {info['owner_pid']}, uid {info['owner_uid']}, "
        f"{'alive' if info['owner_alive'] else 'dead (leaked: `shmbuf gc` removes it)'}",
        f"created:  {created} ({age:.0f} s ago)",
        f"size:     {fmt_bytes(info['size'])}",
    ]
    if "version" in info:  # a weight store
        out.append(f"version:  {info['version']} (published)")
    if "stats" not in info:
        out.append("layout:")
        out.extend("  " + line for line in json.dumps(info["layout"], indent=2).splitlines())
        return "\n".join(out)
    stats = info["stats"]
    capacity, lanes = stats["capacity"], stats["lanes"]
    out += [
        f"capacity: {capacity} per lane x {lanes} lane(s); holds {stats['size']} "
        f"({stats['size'] / (capacity * lanes):.1%}), {stats['committed']} ever written, "
        f"{stats['inserts_per_s']:.1f} inserts/s since creation",
        "spec:",
    ]
    rows = [["FIELD", "SHAPE", "DTYPE"]]
    rows += [[f["name"], str(tuple(f["shape"])), str(np.dtype(f["dtype"]))] for f in info["spec"]]
    out.extend("  " + line for line in _table(rows).splitlines())
    out.append("lanes:")
    rows = [["LANE", "COMMITTED", "SIZE", "WRITER", "PID", "EPOCH", "EPISODE", "LAST WRITE"]]
    for lane in stats["per_lane"]:
        rows.append([
            str(lane["lane"]), str(lane["committed"]), str(lane["size"]),
            "alive" if lane["writer_alive"] else "-", _dash(lane["writer_pid"] or None),
            str(lane["epoch"]), str(lane["episode"]),
            _dash(lane["last_write_age_s"], lambda a: f"{a:.1f} s ago"),
        ])
    out.extend("  " + line for line in _table(rows, right={0, 1, 2, 4, 5, 6}).splitlines())
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Parser and plugins
# --------------------------------------------------------------------------------------------
def _entry_points() -> Sequence[Any]:
    return list(metadata.entry_points(group=PLUGIN_GROUP))


def _register_plugins(subparsers: Any) -> dict[str, str]:
    """Let each plugin add its subcommand; return {command: why it failed} for broken ones."""
    failed = {}
    for ep in _entry_points():
        try:
            ep.load()(subparsers)
        except Exception as e:  # a broken plugin must never break the built-in commands
            if ep.name not in subparsers.choices:
                failed[ep.name] = f"{type(e).__name__}: {e}"
    return failed


def _timeout_arg(text: str) -> float:
    """``--timeout`` through the library's one timeout check (NaN, inf, negatives refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--timeout must be a number of seconds, got {text!r}"
        ) from None
    try:
        return timeout_seconds("--timeout", value)
    except ValueError as e:  # name the text as typed, not the float it became
        raise argparse.ArgumentTypeError(str(e).replace(repr(value), repr(text))) from None


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The argument parser with built-in and plugin subcommands, and the plugins that failed."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="shmbuf", description="Inspect and clean up shmbuf shared-memory segments."
    )
    parser.add_argument("--version", action="version", version=f"shmbuf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("ls", help="list shmbuf segments (alive or leaked)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("gc", help="remove leaked segments (whose owner process died)")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these segments")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("inspect", help="header, spec and per-lane stats of one segment")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=_timeout_arg, default=1.0,
                   help="seconds to wait for a segment that is being created (default 1)")
    p.set_defaults(func=cmd_inspect)

    top.register(sub, _timeout_arg)

    failed = _register_plugins(sub)
    return parser, failed


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 error, 2 usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, failed = build_parser()
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in failed:
        print(f"shmbuf: command {command!r} is unavailable: {failed[command]}", file=sys.stderr)
        return 1
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else 2
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except BrokenPipeError:  # e.g. `shmbuf ls | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ShmbufError, OSError, ValueError) as e:
        print(f"shmbuf {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
