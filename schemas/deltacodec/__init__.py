"""The weight-delta codec: lossless, chunked, verified deltas and keyframes between policy
versions (rules and guarantees in ``codec``). Import the API from here:
``from rlstream.schemas import deltacodec``.

Modules, from the bottom up (each imports only those before it; ``tests/unit/test_layers.py``
checks that no import circle forms):

- ``bits``: tensors as bit patterns, their hashes (the algorithms a manifest may name);
- ``pieces``: the piece layout, streams, and the element-wise encodings (sparse, dense);
- ``rangecoder``, ``rans``: the coders of the base-conditioned encodings, whose numba kernels
  are in ``kernels`` (imported on first use only);
- ``exponent``: the base-conditioned encodings written now (``exponent2``, ``exponent3``);
- ``direct``: the fast-apply encoding (changes in element order, the differences conditioned
  on the base, a checksum of the changes), applied at a cost that follows the change;
- ``legacy``: decoders of encodings no longer written, for old logs;
- ``encodings``: which encoding a piece gets, and the decoder of each;
- ``manifest``: manifest rules and the codec's errors;
- ``wire``: the weights wire format (chunk layout, manifest tables, Avro records); it lives
  here because the codec writes and reads chunks through it and it builds on the pieces and
  the manifest rules: one owner for the bytes a version is made of;
- ``bound``: entropy bounds of a change;
- ``memory``: the memory the codec may write (recycled buffers, writable views) and the
  threads it spreads tensors over;
- ``codec``: encode, decode, apply in place (the rules and guarantees);
- ``file``: a version in one file; ``warm``: compiling the kernels ahead of time.
"""

from .bits import (
    BITS_ONLY_DTYPES,
    CRYPTOGRAPHIC,
    DEFAULT_HASH,
    DTYPE_WIDTHS,
    LEGACY_HASH,
    TensorBits,
    bits_hash,
    from_torch,
    same_state,
    state_hash,
    to_torch,
)
from .bound import EntropyBound, conditioned_bound, entropy_bound
from .codec import (
    DEFAULT_MAX_CHUNK_BYTES,
    Encoded,
    apply_in_place,
    decode,
    encode_delta,
    encode_keyframe,
)
from .manifest import (
    FORMAT,
    BaseMismatch,
    ChunkCorrupt,
    DeltaError,
    HashMismatch,
    ManifestInvalid,
    MissingChunk,
    hash_algorithm,
    validate_manifest,
    verify_chunk,
)
from .memory import DEFAULT_WORKERS
from .warm import compile_kernels

__all__ = [
    "BITS_ONLY_DTYPES",
    "CRYPTOGRAPHIC",
    "DEFAULT_HASH",
    "DEFAULT_MAX_CHUNK_BYTES",
    "DEFAULT_WORKERS",
    "DTYPE_WIDTHS",
    "FORMAT",
    "LEGACY_HASH",
    "BaseMismatch",
    "ChunkCorrupt",
    "DeltaError",
    "Encoded",
    "EntropyBound",
    "HashMismatch",
    "ManifestInvalid",
    "MissingChunk",
    "TensorBits",
    "apply_in_place",
    "bits_hash",
    "compile_kernels",
    "conditioned_bound",
    "decode",
    "encode_delta",
    "encode_keyframe",
    "entropy_bound",
    "from_torch",
    "hash_algorithm",
    "same_state",
    "state_hash",
    "to_torch",
    "validate_manifest",
    "verify_chunk",
]
