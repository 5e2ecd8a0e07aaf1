"""The ternary encodings of a bucket and their wire formats: signed indices (int32, +(i+1) or -(i+1)) or a 2-bit
bitmap, the shared decision between the two, and the bytes each takes (steps 5-7 of the package's algorithm)."""

import math

import torch

from tandem.worker.train.compression.threshold import Threshold

SPARSE_LIMIT_DIVISOR = 16
"""An encoding of more than numel / 16 entries (4 bytes each) travels as a 2-bit bitmap instead."""
BITMAP_ELEMENTS_PER_BYTE = 4
COUNT_BYTES = 4
INDEX_BYTES = 4
_SIGN_OF_CODE = torch.tensor([0, 1, 0, -1], dtype=torch.int8)
"""Bitmap code -> sign: 0 is zero, 1 is +tau, 3 (the low two bits of int8 -1) is -tau."""
_CODE_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def ternary_signs(values: torch.Tensor, threshold: Threshold) -> torch.Tensor:
    """int8 signs of the entries with |value| >= threshold, 0 elsewhere."""
    return torch.where(values.abs() >= threshold, values.sign(), 0).to(torch.int8)


def signs_to_indices(signs: torch.Tensor) -> torch.Tensor:
    """Signed 1-based int32 indices: +(i+1) for a +1 at i, -(i+1) for a -1 at i (0 is left free for padding)."""
    positions = signs.nonzero().squeeze(1)
    return ((positions + 1) * signs[positions]).to(torch.int32)


def indices_to_sign_sums(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Sum of the signs that `indices` (any number of ranks' lists, zero padding ignored) put on each entry."""
    sums = torch.zeros(numel, dtype=torch.int32, device=indices.device)
    # A padding 0 lands on entry 0 with sign 0, which adds nothing.
    return sums.index_add_(0, (indices.abs() - 1).clamp_(min=0), indices.sign())


def pack_ternary(signs: torch.Tensor) -> torch.Tensor:
    """A 2-bit-per-element bitmap (uint8, ceil(n / 4) bytes) of int8 signs."""
    codes = (signs & 3).to(torch.uint8)
    codes = torch.nn.functional.pad(codes, (0, -len(codes) % BITMAP_ELEMENTS_PER_BYTE))
    shifted = codes.view(-1, BITMAP_ELEMENTS_PER_BYTE) << _CODE_SHIFTS.to(codes.device)
    return shifted.sum(dim=1, dtype=torch.uint8)


def unpack_ternary(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """int8 signs (shape [..., numel]) from bitmaps made by pack_ternary (shape [..., ceil(numel / 4)])."""
    codes = (bitmap.unsqueeze(-1) >> _CODE_SHIFTS.to(bitmap.device)) & 3
    codes = codes.flatten(-2)[..., :numel]
    return _SIGN_OF_CODE.to(bitmap.device)[codes.long()]


def uses_bitmap(counts: list[int], numel: int) -> bool:
    """The shared decision: the bucket goes as a bitmap when the longest encoding passes 1/16 of it."""
    return max(counts) * SPARSE_LIMIT_DIVISOR > numel


def payload_bytes(counts: list[int], numel: int) -> int:
    """What one rank sends for a bucket after its count: nothing when no rank encoded anything, else the bitmap
    or its index list padded to the longest."""
    longest = max(counts)
    if longest <= 0:
        return 0
    if uses_bitmap(counts, numel):
        return math.ceil(numel / BITMAP_ELEMENTS_PER_BYTE)
    return INDEX_BYTES * longest
