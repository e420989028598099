"""A small protobuf wire-format decoder and a reader of the profiler's XSpace (`*.xplane.pb`).

Used by `benchmarks.gpu_profile` to read `jax.profiler.trace` output without tensorboard,
xprof or generated protobuf classes. `parse_xspace` gives the planes as plain dicts, with
event and stat names resolved through the plane's metadata maps.

Field numbers relied on (tsl/profiler/protobuf/xplane.proto, proto3, package tensorflow.profiler):

    XSpace          planes=1 (errors=2, warnings=3, hostnames=4 are skipped)
    XPlane          id=1 name=2 lines=3 event_metadata=4 stat_metadata=5 stats=6
                    (4 and 5 are map<int64, ...>: each entry is a message key=1 value=2)
    XLine           id=1 name=2 timestamp_ns=3 events=4 duration_ps=9 display_id=10 display_name=11
    XEvent          metadata_id=1 offset_ps=2 duration_ps=3 stats=4 num_occurrences=5
    XEventMetadata  id=1 name=2 metadata=3 display_name=4 stats=5 child_id=6
    XStatMetadata   id=1 name=2 description=3
    XStat           metadata_id=1 double_value=2 uint64_value=3 int64_value=4 str_value=5
                    bytes_value=6 ref_value=7 (a stat metadata id whose name is the value)

How they were verified: read against the text of xplane.proto (the copy XLA vendors at
xla/tsl/profiler/protobuf/xplane.proto), and tested in tests/test_gpu_profile_smoke.py,
which decodes (a) an XSpace hand-encoded from the protobuf encoding spec, independently
of this decoder, and (b) a real CPU trace from `jax.profiler.trace`, checking every
plane's line names, event names and durations against `jax.profiler.ProfileData`.
"""

from __future__ import annotations

import struct
from typing import Any

# -- Protobuf wire format --------------------------------------------------------------------

VARINT, I64, LEN, I32 = 0, 1, 2, 5


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at `pos` (unsigned, up to 64 bits)."""
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def fields(data: bytes) -> list[tuple[int, int, Any]]:
    """[(field number, wire type, value)] of one message: ints for varint/32/64-bit, bytes for LEN.

    Groups (wire types 3 and 4) are not used by xplane.proto and stop the decode with an error.
    """
    out, pos, end = [], 0, len(data)
    while pos < end:
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, pos = read_varint(data, pos)
        elif wire == I64:
            value, pos = struct.unpack_from("<Q", data, pos)[0], pos + 8
        elif wire == LEN:
            size, pos = read_varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
            if pos > end:
                raise ValueError("length-delimited field runs past the message")
        elif wire == I32:
            value, pos = struct.unpack_from("<I", data, pos)[0], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire} (field {number})")
        out.append((number, wire, value))
    return out


def signed(value: int) -> int:
    """An int64 field's value from its varint (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(value: bytes) -> str:
    return bytes(value).decode("utf-8", "replace")


# -- XSpace (tsl/profiler/protobuf/xplane.proto) -------------------------------------------------
# (Field numbers: the module docstring.)


def _stat(data: bytes) -> tuple[int, Any]:
    """(stat metadata id, raw value) of one XStat; a ref value is returned as ("ref", id)."""
    key, value = 0, None
    for number, wire, v in fields(data):
        if number == 1:
            key = signed(v)
        elif number == 2 and wire == I64:
            value = struct.unpack("<d", struct.pack("<Q", v))[0]
        elif number == 3:
            value = v
        elif number == 4:
            value = signed(v)
        elif number == 5:
            value = _text(v)
        elif number == 6:
            value = bytes(v)
        elif number == 7:
            value = ("ref", v)
    return key, value


def _map_entry(data: bytes) -> tuple[int, bytes]:
    key, value = 0, b""
    for number, _, v in fields(data):
        if number == 1:
            key = signed(v)
        elif number == 2:
            value = v
    return key, value


def parse_plane(data: bytes) -> dict[str, Any]:
    """One XPlane as {"id", "name", "lines": [...], "stats": {...}} with names and stats resolved.

    Each line: {"id", "name", "timestamp_ns", "events": [{"name", "start_ps", "duration_ps", "stats"}]},
    `start_ps` relative to the plane's earliest line timestamp (so lines of a plane share one clock).
    """
    name, plane_id, raw_lines, raw_stats = "", 0, [], []
    event_meta: dict[int, dict[str, Any]] = {}
    stat_names: dict[int, str] = {}
    for number, _, v in fields(data):
        if number == 1:
            plane_id = signed(v)
        elif number == 2:
            name = _text(v)
        elif number == 3:
            raw_lines.append(v)
        elif number == 4:
            key, value = _map_entry(v)
            meta = {"name": "", "display_name": "", "stats": []}
            for n, _, mv in fields(value):
                if n == 2:
                    meta["name"] = _text(mv)
                elif n == 4:
                    meta["display_name"] = _text(mv)
                elif n == 5:
                    meta["stats"].append(_stat(mv))
            event_meta[key] = meta
        elif number == 5:
            key, value = _map_entry(v)
            stat_names[key] = next((_text(sv) for n, _, sv in fields(value) if n == 2), "")
        elif number == 6:
            raw_stats.append(v)

    def resolve(stats: list[tuple[int, Any]]) -> dict[str, Any]:
        out = {}
        for key, value in stats:
            if isinstance(value, tuple):  # A ref: the value is another stat metadata's name.
                value = stat_names.get(value[1], "")
            out[stat_names.get(key, str(key))] = value
        return out

    lines = []
    for raw in raw_lines:
        line = {"id": 0, "name": "", "display_name": "", "timestamp_ns": 0, "events": []}
        for number, _, v in fields(raw):
            if number == 1:
                line["id"] = signed(v)
            elif number == 2:
                line["name"] = _text(v)
            elif number == 11:
                line["display_name"] = _text(v)
            elif number == 3:
                line["timestamp_ns"] = signed(v)
            elif number == 4:
                event = {"metadata_id": 0, "offset_ps": 0, "duration_ps": 0, "stats": []}
                for n, _, ev in fields(v):
                    if n == 1:
                        event["metadata_id"] = signed(ev)
                    elif n == 2:
                        event["offset_ps"] = signed(ev)
                    elif n == 3:
                        event["duration_ps"] = signed(ev)
                    elif n == 4:
                        event["stats"].append(_stat(ev))
                    elif n == 5:
                        event["num_occurrences"] = signed(ev)
                line["events"].append(event)
        lines.append(line)
    base_ns = min((line["timestamp_ns"] for line in lines if line["events"]), default=0)
    for line in lines:
        shift = (line["timestamp_ns"] - base_ns) * 1000
        events = []
        for e in line["events"]:
            meta = event_meta.get(e["metadata_id"], {"name": "", "display_name": "", "stats": []})
            stats = resolve(meta["stats"])
            stats.update(resolve(e["stats"]))
            events.append({
                "name": meta["name"] or meta["display_name"],
                "display_name": meta["display_name"],
                "start_ps": shift + e["offset_ps"],
                "duration_ps": e["duration_ps"],
                "stats": stats,
            })
        line["events"] = events
    return {"id": plane_id, "name": name, "lines": lines, "base_ns": base_ns,
            "stats": resolve([_stat(s) for s in raw_stats])}


def parse_xspace(data: bytes, keep=None) -> list[dict[str, Any]]:
    """The XPlanes of a serialized XSpace; `keep(name) -> bool` picks planes before decoding them."""
    planes, data = [], memoryview(data)
    for number, _, v in fields(data):
        if number != 1:
            continue
        if keep is not None:
            name = next((_text(pv) for n, _, pv in fields_head(v) if n == 2), "")
            if not keep(name):
                continue
        planes.append(parse_plane(v))
    return planes


def fields_head(data: bytes, limit: int = 4) -> list[tuple[int, int, Any]]:
    """The first `limit` fields of a message (a plane's id and name come first), without decoding the rest."""
    out, pos = [], 0
    while pos < len(data) and len(out) < limit:
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, pos = read_varint(data, pos)
        elif wire == I64:
            value, pos = None, pos + 8
        elif wire == LEN:
            size, pos = read_varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
        elif wire == I32:
            value, pos = None, pos + 4
        else:
            break
        out.append((number, wire, value))
    return out
