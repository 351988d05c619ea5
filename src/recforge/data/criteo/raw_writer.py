"""Rows -> raw Criteo text lines (``label \\t I1..I13 \\t C1..C26 \\n``), vectorised: the inverse of
:mod:`recforge.data.criteo.raw`'s parser for the values Criteo files hold.

A dense value is written in decimal (a leading ``-`` when negative), a categorical value as 8
lower-case hex digits (as Criteo writes its 32-bit hashes), a missing value as an empty field.

Every field gets a fixed-width slot in a ``[rows, width]`` byte matrix, filled column by column
with numpy (no Python code per row or value), unused bytes left 0; dropping the zeros in row-major
order leaves the lines back to back. 0 never occurs in a line, so nothing real is dropped.
"""
from __future__ import annotations

import numpy as np

from recforge.data.criteo.prepared import N_DENSE, N_SPARSE

__all__ = ["DENSE_DIGITS", "MAX_DENSE", "format_tsv_lines"]

DENSE_DIGITS = 9  # magnitudes below 10**9 fit int32 through the digit arithmetic
MAX_DENSE = 10**DENSE_DIGITS - 1
HEX_DIGITS = 8
_TAB, _NL, _MINUS, _ZERO = ord("\t"), ord("\n"), ord("-"), ord("0")
_DENSE_SLOT = DENSE_DIGITS + 2  # sign, digits, tab
_SPARSE_SLOT = HEX_DIGITS + 1  # digits, tab
_U64 = np.uint64
_ONES = 0x0101010101010101


def format_tsv_lines(
    labels: np.ndarray, dense: np.ndarray, dense_missing: np.ndarray, sparse: np.ndarray
) -> np.ndarray:
    """The lines of ``n`` rows as one uint8 array, each ending in ``\\n``.

    ``labels`` [n] 0/1; ``dense`` [n, 13] integers with ``|x| <=`` :data:`MAX_DENSE`;
    ``dense_missing`` [n, 13] bool (an empty field, whatever ``dense`` holds there); ``sparse``
    [n, 26] integers in ``[0, 2**32)``, -1 for an empty field.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if dense.shape != (n, N_DENSE) or dense_missing.shape != (n, N_DENSE) or sparse.shape != (n, N_SPARSE):
        raise ValueError(f"expected dense and dense_missing [{n}, {N_DENSE}] and sparse [{n}, {N_SPARSE}], got "
                         f"{dense.shape}, {dense_missing.shape} and {sparse.shape}")
    if n and (np.abs(dense).max() > MAX_DENSE or sparse.min() < -1 or sparse.max() >= 2**32):
        raise ValueError(f"dense values must lie within +-{MAX_DENSE:,} and sparse ones in [-1, 2**32)")
    if n and not np.isin(labels, (0, 1)).all():
        raise ValueError("labels must be 0 or 1")

    width = 2 + N_DENSE * _DENSE_SLOT + N_SPARSE * _SPARSE_SLOT
    lines = np.zeros((n, width), dtype=np.uint8)
    lines[:, 0] = _ZERO + labels.astype(np.uint8)
    lines[:, 1] = _TAB
    # Views of the row matrix (reshaping a slice of whole slots keeps it a view).
    dense_slot = lines[:, 2:2 + N_DENSE * _DENSE_SLOT].reshape(n, N_DENSE, _DENSE_SLOT, copy=False)
    sparse_slot = lines[:, 2 + N_DENSE * _DENSE_SLOT:].reshape(n, N_SPARSE, _SPARSE_SLOT, copy=False)

    # Dense slot: sign, DENSE_DIGITS digits right-aligned (leading zeros left 0), tab. A digit
    # shows while the rest of the number is nonzero, and the units digit always.
    present = ~np.asarray(dense_missing, dtype=bool)
    rest = np.abs(dense).astype(np.int32)
    for k in range(DENSE_DIGITS):
        shown = present if k == 0 else present & (rest > 0)
        dense_slot[:, :, _DENSE_SLOT - 2 - k] = np.where(shown, (rest % 10).astype(np.uint8) + np.uint8(_ZERO), 0)
        rest //= 10
    dense_slot[:, :, 0] = np.where((dense < 0) & present, np.uint8(_MINUS), np.uint8(0))
    dense_slot[:, :, -1] = _TAB

    # Categorical slot: 8 hex digits (0 bytes when missing), tab; the last one ends the line.
    sparse_slot[:, :, :HEX_DIGITS] = _hex_words(sparse).view(np.uint8).reshape(n, N_SPARSE, HEX_DIGITS)
    sparse_slot[:, :, -1] = _TAB
    sparse_slot[:, -1, -1] = _NL
    return lines[lines != 0]


def _hex_words(sparse: np.ndarray) -> np.ndarray:
    """[n, 26] values (-1 = missing) -> [n, 26] uint64 whose 8 little-endian bytes are the value's
    8 lower-case hex digits, most significant first (0 for a missing value), by byte-parallel
    arithmetic: the nibbles are spread one per byte, then offset to their ASCII digit."""
    x = np.where(sparse >= 0, sparse, 0).astype(np.uint64)
    x = ((x & _U64(0xFFFF0000)) << _U64(16)) | (x & _U64(0xFFFF))
    x = ((x & _U64(0x0000FF000000FF00)) << _U64(8)) | (x & _U64(0x000000FF000000FF))
    x = ((x & _U64(0x00F000F000F000F0)) << _U64(4)) | (x & _U64(0x000F000F000F000F))
    x = x.byteswap()  # byte 0 holds the most significant nibble
    letters = ((x + _U64(0x0606060606060606)) >> _U64(4)) & _U64(_ONES)  # 1 where the nibble is >= 10
    x = x + _U64(_ZERO * _ONES) + letters * _U64(ord("a") - _ZERO - 10)
    x[sparse < 0] = 0
    return np.ascontiguousarray(x)  # C order, so that each word's bytes can be viewed
