"""Entropy bounds of a weight delta, computed from the data (not from any coder's model).

Both are in bits for the whole change, with the raw bits beside them, so ``ratio`` is the
best compression ratio a coder of that family could reach (metadata not counted):

- ``entropy_bound``: order 0, per tensor (a Bernoulli changed mask and i.i.d. differences);
- ``conditioned_bound``: the same per bucket of the base's exponent field, which the
  receiver holds (what the ``exponent`` piece encoding conditions on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .bits import TensorBits
from .exponent import EXPONENT_FIELDS
from .pieces import zigzag


@dataclass(frozen=True)
class EntropyBound:
    """Order-0 entropy bound of a change (see ``entropy_bound``)."""

    raw_bits: int
    bound_bits: float
    changed: int
    numel: int

    @property
    def ratio(self) -> float:
        """Best compression ratio (raw / encoded) an order-0 coder could reach."""
        return self.raw_bits / self.bound_bits if self.bound_bits else math.inf


def _entropy(counts: np.ndarray) -> float:
    """Shannon entropy in bits per symbol of the empirical distribution ``counts``."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def entropy_bound(old: Mapping[str, TensorBits], new: Mapping[str, TensorBits]) -> EntropyBound:
    """Order-0 entropy bound of the change ``old -> new``.

    Per tensor of ``new`` with N elements of which k changed (bit patterns differ), p = k/N:
    bits = N * H(p) + k * H_v, where H(p) is the binary entropy of the changed mask as an
    i.i.d. Bernoulli(p) sequence and H_v the empirical entropy (bits per symbol) of the
    tensor's value symbols, the zigzag-mapped wrapped integer differences ``new - old`` of
    the bit patterns of the changed elements. A tensor without a matching base counts its
    raw bits. The bound is the sum over tensors; ratio bound = raw bits / bound bits. Any
    coder that treats positions and values as independent symbols drawn from these
    per-tensor distributions needs at least this many bits (metadata not counted).
    """
    return _bound(old, new, conditioned=False)


def conditioned_bound(old: Mapping[str, TensorBits], new: Mapping[str, TensorBits]) -> EntropyBound:
    """The entropy bound of the change ``old -> new`` given what the receiver holds: the
    base's exponent field (the float dtypes of ``EXPONENT_FIELDS``; other dtypes have one
    bucket, as in ``entropy_bound``).

    Per tensor and per bucket b (elements whose base has exponent field b) with N_b elements
    of which k_b changed: bits = N_b * H(k_b / N_b) + k_b * H_v(b), H_v(b) the empirical
    entropy of the zigzag differences of bucket b's changed elements; summed over buckets and
    tensors (a tensor without a matching base counts its raw bits). It is computed from the
    data, not from any coder's model: it is the empirical entropy of the changed mask and of
    the differences conditioned on the base exponent, so a coder that sees each element's
    bucket but treats elements inside a bucket as independent needs at least this many bits.
    """
    return _bound(old, new, conditioned=True)


def _bound(
    old: Mapping[str, TensorBits], new: Mapping[str, TensorBits], conditioned: bool
) -> EntropyBound:
    raw = bound = 0.0
    changed = numel = 0
    for name, t in new.items():
        b = old.get(name)
        raw += t.nbytes * 8
        numel += t.numel
        if b is None or (b.dtype, b.shape) != (t.dtype, t.shape):
            bound += t.nbytes * 8
            changed += t.numel
            continue
        field = EXPONENT_FIELDS.get(t.dtype) if conditioned else None
        idx = np.flatnonzero(b.bits != t.bits)
        changed += int(idx.size)
        z = zigzag(t.bits[idx] - b.bits[idx])
        if field is None:
            bound += _bucket_bits(t.numel, z)
            continue
        shift, mask = field
        keys = (b.bits >> shift) & mask
        sizes = np.bincount(keys, minlength=mask + 1)
        ck = keys[idx]
        order = np.argsort(ck, kind="stable")
        cuts = np.searchsorted(ck[order], np.arange(mask + 2))
        for k in np.flatnonzero(sizes).tolist():
            bound += _bucket_bits(int(sizes[k]), z[order[cuts[k] : cuts[k + 1]]])
    return EntropyBound(int(raw), bound, changed, numel)


def _bucket_bits(n: int, z: np.ndarray) -> float:
    """n * H(k / n) + k * H(values), k = z.size: one bucket's share of a bound."""
    k = int(z.size)
    if not k:
        return 0.0
    _, counts = np.unique(z, return_counts=True)
    return n * _entropy(np.array([k, n - k])) + k * _entropy(counts)
