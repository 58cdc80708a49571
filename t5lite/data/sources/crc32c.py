"""CRC32C (Castagnoli) and TFRecord's masked CRC, without TensorFlow.

A compiled implementation is used when one is installed (`google-crc32c`, or the `crc32c`
package); otherwise a vectorized numpy one that checks many buffers at once. CRCs are
linear over GF(2), so numpy cuts every buffer into fixed-size chunks, computes all chunk
CRCs in one pass over the chunk columns, and joins each buffer's chunks with a precomputed
"shift by N zero bytes" table (zlib's crc32_combine idea), pairwise in a tree.

Example: crc32c(b"123456789") == 0xE3069283; masked_crc32c(b"") == 0xA282EAD8.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

_POLY = 0x82F63B78  # Castagnoli polynomial, bit-reflected.
_MASK_DELTA = 0xA282EAD8  # TFRecord's mask constant.
_CHUNK = 64  # numpy chunk size in bytes: the padding waste vs. the number of Horner steps.
_U32 = 0xFFFFFFFF

try:  # The compiled backends are optional: both are tiny wheels on PyPI.
  import google_crc32c as _google_crc32c
except ImportError:
  _google_crc32c = None
try:
  import crc32c as _crc32c_pkg
except ImportError:
  _crc32c_pkg = None

BACKEND = ("google_crc32c" if _google_crc32c is not None
           else "crc32c" if _crc32c_pkg is not None else "numpy")


def _make_table() -> np.ndarray:
  """The 256-entry byte table of the reflected Castagnoli CRC."""
  table = np.arange(256, dtype=np.uint32)
  for _ in range(8):
    table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
  return table


_TABLE = _make_table()
_PY_TABLE = [int(v) for v in _TABLE]


def _python_crc32c(data: bytes) -> int:
  """Byte-at-a-time CRC32C; used for the few buffers shorter than 4 bytes."""
  crc = _U32
  for byte in data:
    crc = _PY_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ _U32


@functools.cache
def _shift_tables(num_bytes: int) -> np.ndarray:
  """(4, 256) tables: register value -> register after `num_bytes` zero bytes (init 0).

  The map is linear, so it is the XOR of one lookup per register byte. `num_bytes` is
  _CHUNK times a power of two; longer shifts are two half shifts composed.
  """
  reg = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None])
  reg = reg.ravel()
  if num_bytes > _CHUNK:
    half = _shift_tables(num_bytes // 2)
    return _shift(half, _shift(half, reg)).reshape(4, 256)
  for _ in range(num_bytes):
    reg = _TABLE[reg & 0xFF] ^ (reg >> 8)
  return reg.reshape(4, 256)


def _shift(tables: np.ndarray, reg: np.ndarray) -> np.ndarray:
  """Applies a `_shift_tables` map to an array of registers."""
  return (tables[0][reg & 0xFF] ^ tables[1][(reg >> 8) & 0xFF]
          ^ tables[2][(reg >> 16) & 0xFF] ^ tables[3][reg >> 24])


def _raw_rows(rows: np.ndarray) -> np.ndarray:
  """CRC registers (init 0, no final xor) of each row of a (N, m) uint8 array."""
  reg = np.zeros(rows.shape[0], dtype=np.uint32)
  for j in range(rows.shape[1]):
    reg = _TABLE[(reg ^ rows[:, j]) & 0xFF] ^ (reg >> 8)
  return reg


def _numpy_bucket(buffers: Sequence[bytes], num_chunks: int) -> np.ndarray:
  """CRC32C of buffers (each >= 4 bytes, at most num_chunks * _CHUNK long)."""
  width = num_chunks * _CHUNK
  rows = np.zeros((len(buffers), width), dtype=np.uint8)
  for i, buf in enumerate(buffers):
    # Leading zero bytes leave a zero register unchanged, so right-aligning is free.
    rows[i, width - len(buf):] = np.frombuffer(buf, dtype=np.uint8)
    # Starting from 0xFFFFFFFF equals starting from 0 with the first 4 bytes inverted.
    rows[i, width - len(buf):width - len(buf) + 4] ^= 0xFF
  chunk_crcs = _raw_rows(rows.reshape(-1, _CHUNK)).reshape(len(buffers), num_chunks)
  # Tree reduction: join neighbouring blocks; the left one moves past the right one's bytes.
  width = _CHUNK
  while chunk_crcs.shape[1] > 1:
    chunk_crcs = _shift(_shift_tables(width), chunk_crcs[:, 0::2]) ^ chunk_crcs[:, 1::2]
    width *= 2
  reg = chunk_crcs[:, 0]
  return reg ^ np.uint32(_U32)


def _numpy_crc32c_many(buffers: Sequence[bytes]) -> np.ndarray:
  """Vectorized CRC32C of many buffers, grouped by power-of-two chunk counts."""
  out = np.zeros(len(buffers), dtype=np.uint32)
  buckets: dict[int, list[int]] = {}
  for i, buf in enumerate(buffers):
    if len(buf) < 4:
      out[i] = _python_crc32c(bytes(buf))
    else:
      chunks = -(-len(buf) // _CHUNK)
      buckets.setdefault(1 << (chunks - 1).bit_length(), []).append(i)
  for num_chunks, idx in buckets.items():
    out[idx] = _numpy_bucket([buffers[i] for i in idx], num_chunks)
  return out


def crc32c_many(buffers: Sequence[bytes]) -> np.ndarray:
  """CRC32C of each buffer, as a uint32 array."""
  if _google_crc32c is not None:
    return np.array([_google_crc32c.value(bytes(b)) for b in buffers], dtype=np.uint32)
  if _crc32c_pkg is not None:
    return np.array([_crc32c_pkg.crc32c(bytes(b)) for b in buffers], dtype=np.uint32)
  return _numpy_crc32c_many(buffers)


def crc32c(data: bytes) -> int:
  """CRC32C of one buffer."""
  return int(crc32c_many([data])[0])


def mask(crc: np.ndarray | int) -> np.ndarray | int:
  """TFRecord's masking: rotate right by 15 bits, add a constant (mod 2**32)."""
  crc64 = np.asarray(crc, dtype=np.uint64)
  masked = (((crc64 >> 15) | (crc64 << 17)) + _MASK_DELTA) & _U32
  return masked.astype(np.uint32) if masked.ndim else int(masked)


def masked_crc32c(data: bytes) -> int:
  """The masked CRC32C that TFRecord stores after a record's length and data."""
  return mask(crc32c(data))


def masked_crc32c_many(buffers: Sequence[bytes]) -> np.ndarray:
  """Masked CRC32C of each buffer, as a uint32 array."""
  return mask(crc32c_many(buffers))
