"""TensorBoard event files without the ``tensorboard`` package: scalars only.

An events file is a sequence of TFRecords (``uint64 length``, ``masked crc32c(length)``,
``data``, ``masked crc32c(data)``, little-endian), each holding a serialized ``tensorflow.Event``
protobuf. We read and write just what scalar logging uses:

    Event   {1: wall_time double, 2: step int64, 3: file_version string, 5: summary Summary}
    Summary {1: repeated Value}
    Value   {1: tag string, 2: simple_value float, 8: tensor TensorProto}
    TensorProto {1: dtype, 4: tensor_content bytes, 5: float_val, 6: double_val, 7: int_val, 10: int64_val}

Everything else (images, histograms, hparams, plugin metadata) is skipped.
:class:`SummaryWriter` is a drop-in for the ``add_scalar`` part of
``torch.utils.tensorboard.SummaryWriter`` (it flushes every scalar, so readers see them at once).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from det_lab.errors import UserError

try:
    import google_crc32c as _gcrc

    def crc32c(data: bytes) -> int:
        return _gcrc.value(data)
except ImportError:  # pure Python, fine for the few hundred bytes a scalar record has
    _TABLE = []
    for _i in range(256):
        _c = _i
        for _ in range(8):
            _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
        _TABLE.append(_c)

    def crc32c(data: bytes) -> int:
        crc = 0xFFFFFFFF
        for b in data:
            crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
        return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class TfEventsError(UserError, ValueError):
    """A corrupt record in an events file."""


@dataclass(frozen=True)
class Scalar:
    """One scalar point: ``tag`` at ``step``."""

    step: int
    tag: str
    value: float
    wall_time: float = 0.0


# --- protobuf wire format ------------------------------------------------------------------------

def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise TfEventsError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) for each field of a message; value is int or bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, i = _varint(buf, i)
        elif wt == 1:
            val, i = buf[i:i + 8], i + 8
        elif wt == 2:
            n, i = _varint(buf, i)
            val, i = buf[i:i + n], i + n
        elif wt == 5:
            val, i = buf[i:i + 4], i + 4
        else:
            raise TfEventsError(f"unsupported wire type {wt}")
        yield num, wt, val


def _enc_varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 as two's complement, as protobuf does
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _enc_field(num: int, wt: int, payload: bytes | int) -> bytes:
    key = _enc_varint((num << 3) | wt)
    if wt == 0:
        return key + _enc_varint(int(payload))
    if wt == 2:
        return key + _enc_varint(len(payload)) + payload  # type: ignore[arg-type]
    return key + payload  # type: ignore[operator]


_DTYPES = {1: ("<f", 4), 2: ("<d", 8), 3: ("<i", 4), 9: ("<q", 8)}  # DT_FLOAT, DT_DOUBLE, DT_INT32, DT_INT64


def _tensor_scalar(buf: bytes) -> float | None:
    dtype, content, vals = 0, b"", []
    for num, wt, val in _fields(buf):
        if num == 1:
            dtype = val
        elif num == 4:
            content = val
        elif num in (5, 6):
            size, fmt = (4, "<f") if num == 5 else (8, "<d")
            if wt == 2:  # packed
                vals += [struct.unpack_from(fmt, val, k)[0] for k in range(0, len(val), size)]
            else:
                vals.append(struct.unpack(fmt, val)[0])
        elif num in (7, 10):
            if wt == 2:
                j = 0
                while j < len(val):
                    v, j = _varint(val, j)
                    vals.append(v - (1 << 64) if v >= 1 << 63 else v)
            else:
                vals.append(val - (1 << 64) if val >= 1 << 63 else val)
    if content and dtype in _DTYPES:
        fmt, size = _DTYPES[dtype]
        if len(content) == size:
            return float(struct.unpack(fmt, content)[0])
    return float(vals[0]) if len(vals) == 1 else None


def parse_event(data: bytes) -> list[Scalar]:
    """The scalars in one serialized ``Event`` (none for file-version or non-scalar events)."""
    wall, step, summary = 0.0, 0, None
    for num, _, val in _fields(data):
        if num == 1:
            wall = struct.unpack("<d", val)[0]
        elif num == 2:
            step = val - (1 << 64) if val >= 1 << 63 else val
        elif num == 5:
            summary = val
    if summary is None:
        return []
    out = []
    for num, _, value in _fields(summary):
        if num != 1:
            continue
        tag, scalar = "", None
        for vnum, _, v in _fields(value):
            if vnum == 1:
                tag = v.decode("utf-8", "replace")
            elif vnum == 2:
                scalar = float(struct.unpack("<f", v)[0])
            elif vnum == 8:
                scalar = _tensor_scalar(v)
        if tag and scalar is not None:
            out.append(Scalar(int(step), tag, scalar, wall))
    return out


def encode_scalar_event(tag: str, value: float, step: int, wall_time: float | None = None,
                        tensor: bool = False) -> bytes:
    """A serialized ``Event`` holding one scalar: ``simple_value``, or a DT_FLOAT tensor as TF2 writes."""
    if tensor:
        proto = _enc_field(1, 0, 1) + _enc_field(2, 2, b"") + _enc_field(4, 2, struct.pack("<f", value))
        payload = _enc_field(8, 2, proto)
    else:
        payload = _enc_field(2, 5, struct.pack("<f", value))
    summary = _enc_field(1, 2, _enc_field(1, 2, tag.encode()) + payload)
    wall = time.time() if wall_time is None else wall_time
    return _enc_field(1, 1, struct.pack("<d", wall)) + _enc_field(2, 0, step) + _enc_field(5, 2, summary)


# --- TFRecord framing ----------------------------------------------------------------------------

def frame(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


def read_records(f: BinaryIO, offset: int = 0) -> tuple[list[bytes], int]:
    """Complete records from ``offset`` on, and the offset after the last one.

    A record still being written (short read) ends the batch; call again later from the
    returned offset. A CRC mismatch raises :class:`TfEventsError`.
    """
    f.seek(offset)
    out = []
    while True:
        header = f.read(12)
        if len(header) < 12:
            return out, offset
        (length,) = struct.unpack("<Q", header[:8])
        if struct.unpack("<I", header[8:])[0] != masked_crc(header[:8]):
            raise TfEventsError(f"bad length checksum at byte {offset}")
        body = f.read(length + 4)
        if len(body) < length + 4:
            return out, offset
        data = body[:length]
        if struct.unpack("<I", body[length:])[0] != masked_crc(data):
            raise TfEventsError(f"bad data checksum at byte {offset}")
        out.append(data)
        offset += 12 + length + 4


def read_scalars(path: Path) -> list[Scalar]:
    """All scalars in one events file."""
    with open(path, "rb") as f:
        records, _ = read_records(f)
    return [s for r in records for s in parse_event(r)]


class EventsTail:
    """Incremental reader of one events file that may still be growing."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.broken: str | None = None

    def poll(self) -> list[Scalar]:
        if self.broken:
            return []
        try:
            with open(self.path, "rb") as f:
                records, self.offset = read_records(f, self.offset)
        except FileNotFoundError:
            return []
        except TfEventsError as exc:
            self.broken = f"{self.path}: {exc}"
            return []
        return [s for r in records for s in parse_event(r)]


# --- writing -------------------------------------------------------------------------------------

_uid = 0


def events_filename(suffix: str = "") -> str:
    """``events.out.tfevents.<time>.<host>.<pid>.<n>``, as torch's and TensorFlow's writers name them."""
    global _uid
    _uid += 1
    return f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{_uid}{suffix}"


class SummaryWriter:
    """Scalar-only stand-in for ``torch.utils.tensorboard.SummaryWriter``; other ``add_*`` calls are ignored."""

    def __init__(self, log_dir: str | None = None, comment: str = "", purge_step: int | None = None,
                 max_queue: int = 10, flush_secs: int = 120, filename_suffix: str = "", **_: Any) -> None:
        self.log_dir = str(log_dir or Path("runs") / f"{time.strftime('%b%d_%H-%M-%S')}_{socket.gethostname()}{comment}")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(self.log_dir) / events_filename(filename_suffix)
        self._f: BinaryIO | None = open(self.path, "ab")
        file_version = _enc_field(1, 1, struct.pack("<d", time.time())) + _enc_field(3, 2, b"brain.Event:2")
        self._write(file_version)

    def _write(self, event: bytes) -> None:
        if self._f is None:
            raise ValueError(f"{self.path}: writer is closed")
        self._f.write(frame(event))
        self._f.flush()

    def add_scalar(self, tag: str, scalar_value: Any, global_step: int | None = None,
                   walltime: float | None = None, new_style: bool = False, double_precision: bool = False) -> None:
        value = float(scalar_value.item() if hasattr(scalar_value, "item") else scalar_value)
        self._write(encode_scalar_event(tag, value, int(global_step or 0), walltime, tensor=new_style))

    def get_logdir(self) -> str:
        return self.log_dir

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __getattr__(self, name: str):
        if name.startswith("add_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
