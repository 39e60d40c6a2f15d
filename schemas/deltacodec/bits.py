"""Tensors as bit patterns: the value type of the weight-delta codec, and its hashes.

The codec never interprets weights as numbers: a tensor is its dtype tag, its shape and the
flat array of its elements' bit patterns, viewed as little-endian unsigned integers of the
element's width. Two tensors are equal exactly when tag, shape and bit patterns are equal, so
NaN payloads, -0.0, infinities and denormals survive every round trip bit for bit.

Rules stated here (the manifest format depends on them):

- tensor hash = H (hex) of the little-endian bit-pattern bytes, in C order;
- state hash = H (hex) of the compact JSON text (``separators=(",", ":")``) of the list
  ``[[name, dtype, [shape...], tensor_hash], ...]`` sorted by name;
- H is the manifest's hash algorithm (``HASH_ALGORITHMS``): ``blake3`` (256 bits,
  cryptographic), written now (``DEFAULT_HASH``), or ``xxh3_128`` (not cryptographic), which
  manifests written before it used (``LEGACY_HASH``: a manifest that names no algorithm) and
  which is still read, for old logs. Only a cryptographic hash can vouch for bytes under a
  signature: a reader of a live signed run refuses the others (``CRYPTOGRAPHIC``). BLAKE3 was
  chosen by measurement (``rlstream bench deltas``: ``hash_gb_per_s`` beside
  ``crypto_hash_gb_per_s``): on the bench machine it streams at ~0.7 of xxh3's rate, where
  BLAKE2b ran at ~0.1 and SHA-256 (OpenSSL) at ~0.05.

``bfloat16`` and the float8 types have no numpy dtype: they arrive as unsigned bit patterns
with the dtype tag saying what they are. Torch conversion lives here too, with torch
imported lazily inside the helpers so that importing the codec never loads torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import blake3
import numpy as np
import xxhash

if TYPE_CHECKING:
    import torch

#: Element width in bytes of every dtype tag the codec accepts.
DTYPE_WIDTHS: Final[dict[str, int]] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "float32": 4,
    "uint64": 8,
    "int64": 8,
    "float64": 8,
}

#: Tags numpy cannot represent natively: their arrays are the raw bit patterns.
BITS_ONLY_DTYPES: Final = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})

#: The unsigned little-endian integer dtype used for the bit patterns of each width.
UINT_BY_WIDTH: Final[dict[int, np.dtype[Any]]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


#: Hash algorithms a manifest may name, by name: a streaming hasher's constructor.
HASH_ALGORITHMS: Final[dict[str, Callable[[], Any]]] = {
    "blake3": blake3.blake3,
    "xxh3_128": xxhash.xxh3_128,
}
#: The algorithms whose digests may vouch for bytes under a signature.
CRYPTOGRAPHIC: Final = frozenset({"blake3"})
#: What the codec writes now.
DEFAULT_HASH: Final = "blake3"
#: What a manifest that names no algorithm used (every manifest written before BLAKE3).
LEGACY_HASH: Final = "xxh3_128"


def hasher(algorithm: str = DEFAULT_HASH) -> Any:
    """A streaming hasher of ``algorithm`` (``update(bytes)``, ``hexdigest()``); ``ValueError``
    for an algorithm the codec does not know."""
    make = HASH_ALGORITHMS.get(algorithm)
    if make is None:
        raise ValueError(f"unknown hash algorithm {algorithm!r}")
    return make()


def digest(data: bytes | memoryview, algorithm: str = DEFAULT_HASH) -> str:
    """Hex digest of ``data`` under ``algorithm``."""
    h = hasher(algorithm)
    h.update(data)
    return str(h.hexdigest())


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@dataclass(frozen=True, eq=False)
class TensorBits:
    """One tensor as bit patterns: ``dtype`` tag, ``shape`` and flat ``bits``.

    ``bits`` is a 1-D, C-contiguous, read-only array of little-endian unsigned integers of the
    tag's width (``DTYPE_WIDTHS``) with ``prod(shape)`` elements. Construction makes a read-only
    *view*; it does not copy. The tensor hash is computed once and cached, so the caller must
    not mutate the buffer behind ``bits`` afterwards (the codec itself never writes into it).
    Hashes are cached per algorithm (``hash_of``; ``hash`` is ``DEFAULT_HASH``'s). Compare two
    tensors with ``same_bits``.
    """

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray
    _hash: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        width = DTYPE_WIDTHS.get(self.dtype)
        if width is None:
            raise ValueError(f"unsupported dtype tag {self.dtype!r}")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        bits = self.bits
        if bits.dtype != UINT_BY_WIDTH[width] or bits.ndim != 1:
            raise ValueError(f"bits must be a 1-D {UINT_BY_WIDTH[width]} array for {self.dtype}")
        if bits.size != _numel(shape):
            raise ValueError(f"bits has {bits.size} elements, shape {shape} needs {_numel(shape)}")
        if not bits.flags.c_contiguous:
            bits = np.ascontiguousarray(bits)
        view = bits.view()
        view.flags.writeable = False
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "bits", view)

    @classmethod
    def from_numpy(cls, array: np.ndarray, dtype: str | None = None) -> TensorBits:
        """Wrap a numpy array (zero-copy when it is C-contiguous and little-endian).

        ``dtype`` overrides the tag, which is how ``bfloat16``/float8 bit patterns (held in
        uint16/uint8 arrays) get their tag; the array's width must match the tag's width.
        """
        tag = dtype or array.dtype.name
        width = DTYPE_WIDTHS.get(tag)
        if width is None:
            raise ValueError(f"unsupported dtype {tag!r}")
        if array.dtype.itemsize != width:
            raise ValueError(f"{tag} needs {width}-byte elements, got {array.dtype}")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        flat = np.ascontiguousarray(array).reshape(-1)
        return cls(tag, tuple(array.shape), flat.view(UINT_BY_WIDTH[width]))

    @property
    def width(self) -> int:
        """Bytes per element."""
        return DTYPE_WIDTHS[self.dtype]

    @property
    def numel(self) -> int:
        return int(self.bits.size)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    @property
    def hash(self) -> str:
        """``DEFAULT_HASH`` hex of the bit-pattern bytes, computed once."""
        return self.hash_of(DEFAULT_HASH)

    def hash_of(self, algorithm: str) -> str:
        """``algorithm`` hex of the bit-pattern bytes, computed once."""
        if algorithm not in self._hash:
            self._hash[algorithm] = bits_hash(self.bits, algorithm)
        return self._hash[algorithm]

    @property
    def hash_known(self) -> bool:
        """Whether the ``DEFAULT_HASH`` hash is already cached."""
        return DEFAULT_HASH in self._hash

    def knows(self, algorithm: str) -> bool:
        """Whether the ``algorithm`` hash is already cached (used to skip re-hashing a verified
        base)."""
        return algorithm in self._hash

    def remember_hash(self, digest: str, algorithm: str = DEFAULT_HASH) -> None:
        """Cache a hash computed elsewhere (for instance while streaming over the bits)."""
        self._hash.setdefault(algorithm, digest)

    def forget_hash(self) -> None:
        """Drop the cached hashes (the codec calls it when it recycles this tensor's memory)."""
        self._hash.clear()

    def to_numpy(self) -> np.ndarray:
        """A read-only array of the natural numpy dtype and shape (bit patterns for the tags
        numpy lacks: ``bfloat16`` comes back as uint16)."""
        if self.dtype in BITS_ONLY_DTYPES:
            return self.bits.reshape(self.shape)
        return self.bits.view(np.dtype(self.dtype)).reshape(self.shape)

    def same_bits(self, other: TensorBits) -> bool:
        """Bit-exact equality of tag, shape and every element's bit pattern."""
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and bool(np.array_equal(self.bits, other.bits))
        )


def as_bytes(array: np.ndarray) -> memoryview:
    """Zero-copy byte view of a C-contiguous array (for hashing and zstd)."""
    return array.data.cast("B")


def bits_hash(bits: np.ndarray, algorithm: str = DEFAULT_HASH) -> str:
    """Tensor hash rule: ``algorithm`` hex of the contiguous little-endian bit-pattern bytes."""
    return digest(as_bytes(np.ascontiguousarray(bits)), algorithm)


def state_hash(state: Mapping[str, TensorBits], algorithm: str = DEFAULT_HASH) -> str:
    """State hash rule: ``algorithm`` hex of compact JSON ``[[name, dtype, shape, hash], ...]``
    sorted by name (each tensor's hash of the same algorithm). It pins every tensor's
    identity, layout and bits in one digest."""
    return rows_hash(
        [[name, t.dtype, list(t.shape), t.hash_of(algorithm)] for name, t in state.items()],
        algorithm,
    )


def rows_hash(rows: list[list[Any]], algorithm: str = DEFAULT_HASH) -> str:
    """The state hash of its rows ``[name, dtype, shape, tensor hash]`` (any order)."""
    return digest(json.dumps(sorted(rows), separators=(",", ":")).encode(), algorithm)


def same_state(a: Mapping[str, TensorBits], b: Mapping[str, TensorBits]) -> bool:
    """Bit-exact equality of two states (same names, tags, shapes and bits)."""
    return a.keys() == b.keys() and all(a[k].same_bits(b[k]) for k in a)


def from_torch(state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorBits]:
    """Bit patterns of a torch state dict (tensors are moved to CPU; zero-copy when they
    already are contiguous CPU tensors, so snapshot with ``clone()`` any tensor that will be
    changed in place afterwards, such as weights an optimizer steps: the result would change
    under its cached hash). Raises TypeError on a non-tensor entry."""
    import torch

    out: dict[str, TensorBits] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        tag = str(tensor.dtype).removeprefix("torch.")
        width = DTYPE_WIDTHS.get(tag)
        if width is None:
            raise ValueError(f"{name!r}: unsupported torch dtype {tensor.dtype}")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        # torch lacks unsigned views for every width: go through the signed int of that width.
        signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
        bits = flat.view(signed).numpy().view(UINT_BY_WIDTH[width])
        out[name] = TensorBits(tag, tuple(tensor.shape), bits)
    return out


def to_torch(state: Mapping[str, TensorBits]) -> dict[str, torch.Tensor]:
    """Torch tensors (CPU, freshly allocated, writable) with exactly the given bit patterns."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        signed = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[t.width]
        raw = torch.from_numpy(t.bits.view(signed).copy())
        out[name] = raw.view(getattr(torch, t.dtype)).reshape(t.shape)
    return out
