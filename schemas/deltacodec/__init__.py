"""The weight-delta codec: lossless, chunked, verified deltas and keyframes between policy
versions (rules and guarantees in ``codec``). Import the API from here:
``from rlstream.schemas import deltacodec``.

Modules, from the bottom up: ``bits`` (tensors as bit patterns, their hashes), ``pieces`` (the
piece layout, streams, the sparse and dense encodings), ``exponent`` with its coders
``rangecoder`` and ``rans`` (the base-conditioned encodings), ``manifest`` (manifest rules and
the codec's errors), ``wire`` (the weights wire format: chunks, manifest tables, Avro records),
``bound`` (entropy bounds), ``codec`` (encode, decode, apply in place), ``file`` (a version in
one file); ``kernels`` holds the compiled numba kernels, imported on first use only.
"""

from .codec import (
    BITS_ONLY_DTYPES,
    DEFAULT_MAX_CHUNK_BYTES,
    DTYPE_WIDTHS,
    FORMAT,
    BaseMismatch,
    ChunkCorrupt,
    DeltaError,
    Encoded,
    EntropyBound,
    HashMismatch,
    ManifestInvalid,
    MissingChunk,
    TensorBits,
    apply_in_place,
    bits_hash,
    compile_kernels,
    conditioned_bound,
    decode,
    encode_delta,
    encode_keyframe,
    entropy_bound,
    from_torch,
    same_state,
    state_hash,
    to_torch,
    validate_manifest,
    verify_chunk,
)

__all__ = [
    "BITS_ONLY_DTYPES",
    "DEFAULT_MAX_CHUNK_BYTES",
    "DTYPE_WIDTHS",
    "FORMAT",
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
    "same_state",
    "state_hash",
    "to_torch",
    "validate_manifest",
    "verify_chunk",
]
