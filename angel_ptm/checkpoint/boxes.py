"""Flat element ranges of a tensor as DCP chunks (boxes).

A page holds a contiguous run of a tensor's elements in row-major order: elements [start, stop) of the flattened
tensor. DCP describes a piece of a tensor as a box (offsets and sizes per dimension), so a run is written as the
few boxes that tile it: a partial first row, whole rows, a partial last row, recursively per dimension. Every box
is itself contiguous in row-major order, so its elements are one slice of the run:

    flat_boxes((4, 6), 3, 23) == [((0, 3), (1, 3)), ((1, 0), (2, 6)), ((3, 0), (1, 5))]
"""

from __future__ import annotations

import math

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes, in element order, that tile elements [start, stop) of a row-major tensor of `shape`."""
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"elements [{start}, {stop}) are not within a tensor of shape {tuple(shape)}")
    if start == stop:
        return []
    if not shape:  # a 0-d tensor: one element, one empty box
        return [((), ())]
    row = math.prod(shape[1:])  # elements per index of the first dimension
    inner = tuple(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:  # within one row: that row's boxes, prefixed by its index
        if start % row == 0 and stop - start == row:
            return [((first,) + (0,) * len(inner), (1,) + inner)]
        return [((first,) + off, (1,) + size) for off, size in flat_boxes(inner, start - first * row, stop - first * row)]
    boxes: list[Box] = []
    whole_from = first
    if start % row:  # the partial first row
        boxes += flat_boxes(shape, start, (first + 1) * row)
        whole_from = first + 1
    whole_to = stop // row  # rows [whole_from, whole_to) are whole
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * len(inner), (whole_to - whole_from,) + inner))
    if stop % row:  # the partial last row
        boxes += flat_boxes(shape, whole_to * row, stop)
    return boxes


def box_start(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """The flat index of a box's first element."""
    index = 0
    for dim, offset in zip(shape, offsets):
        index = index * dim + offset
    return index
