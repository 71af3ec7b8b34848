"""How a quantized weight shard travels through FSDP2's all-gather: one byte buffer per rank.

FSDP2 shards a weight along dim 0 and all-gathers its ranks' pieces by concatenating them
along dim 0. A quantized shard is several payload tensors (codes, block scales, per-tensor
scale) per copy, and a columnwise copy is stored transposed, so its rows run along dim 1.
This module turns the payload of the copies a gather needs into one flat ``uint8`` buffer
per rank (each row-indexed payload tensor with its row axis moved first, so the ranks' pieces
follow each other) and, after the all-gather, cuts the ``[world, nbytes]`` result back into
the whole weight's payload tensors, bitwise the ones quantizing the whole weight makes.

Per-tensor entries (a scale, a global amax: not indexed by rows) are not gathered: every rank
computes them alike (the amax reduced over the shard group) and the local ones are used.

FSDP2 shards ``total`` rows as ``torch.chunk`` does: ``c = ceil(total / world)`` rows per rank,
the last ranks fewer (or none). Each rank encodes the rows from its shard's first block
boundary to the next rank's (:func:`block_bounds`); a block that straddles shards is encoded
where it starts, from the high-precision rows of the following shards' first rows
(:attr:`GatherLayout.halo`; where a block is longer than a shard, a rank may encode none).

A layout records each set of copies' bytes per rank (:attr:`GatherLayout.set_bytes`) and the
largest (:attr:`GatherLayout.nbytes`): the forward (rowwise) and backward (columnwise) copies
of one format are the same size; a hybrid of two formats sends each copy's own size where the
caller can resize the all-gather's output (``fsdp.py``), else the larger one, padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor
from ..tensors.hybrid import HybridStorage
from ..tensors.storage import QuantizedStorage


@dataclass(frozen=True)
class Piece:
    """One row-indexed payload tensor of a shard as it sits in the gathered buffer."""

    direction: str
    name: str
    dtype: torch.dtype
    #: the row axis of the stored tensor and how many rows one index along it covers
    axis: int
    divisor: int
    #: the shard's tensor with its row axis moved first
    moved_shape: tuple[int, ...]
    #: byte offset and size in each rank's buffer
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GatherLayout:
    """Where each gathered payload tensor sits in a rank's buffer, per set of copies sent."""

    #: the copies each gather may send -> their pieces (offsets from 0)
    pieces: dict
    #: bytes per rank of the largest set (what every gather sends where one size must do)
    nbytes: int
    #: bytes per rank of each set alone
    set_bytes: dict
    #: rows each rank encodes (whole blocks: a shard's rows rounded to block boundaries)
    rank_rows: tuple[int, ...]
    #: the format's row granularity (rows per block of any copy)
    granularity: int
    #: the whole weight quantized with every copy, on the meta device (shapes, dtypes, options)
    whole: QuantizedTensor
    #: FSDP2's shard rows per rank (``torch.chunk``: the last ranks may hold fewer, or none)
    shard_rows: tuple[int, ...] = ()
    #: the most rows a rank's encoded range takes from the start of a later rank's shard (0:
    #: every rank encodes exactly its own shard)
    halo: int = 0

    @property
    def aligned(self) -> bool:
        """Whether every rank encodes as many rows (a piece's bytes are the same on every rank)."""
        return len(set(self.rank_rows)) == 1

    @property
    def even(self) -> bool:
        """Whether FSDP2 gives every rank as many rows (``total`` divisible by the world size)."""
        return len(set(self.shard_rows)) <= 1


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _pieces(storage: QuantizedStorage, directions: tuple[str, ...]) -> tuple[list[Piece], int]:
    pieces, offset = [], 0
    for d in directions:
        part = storage.part(d)
        for name, t in sorted(part.payloads[d].items()):
            spec = part._row_index[d][name]
            if spec is None:
                continue  # per-tensor: equal on every rank, not gathered
            axis, div = spec
            moved = tuple(t.movedim(axis, 0).shape)
            nbytes = math.prod(moved) * _element_bytes(t.dtype)
            pieces.append(Piece(d, name, t.dtype, axis, div, moved, offset, nbytes))
            offset += nbytes
    return pieces, offset


def granularity(storage: QuantizedStorage) -> int:
    """Rows per block of every copy ``storage`` holds (a shard must hold whole blocks)."""
    g = 1
    for d in storage.directions():
        part = storage.part(d)
        for spec in part._row_index[d].values():
            if spec is not None:
                g = math.lcm(g, spec[1])
    return g


def shard_rows(total: int, world: int) -> tuple[int, ...]:
    """FSDP2's rows per rank for ``total`` rows (``torch.chunk``: ``ceil(total / world)`` each,
    the last ranks fewer or none).

    Parameters
    ----------
    total:
        Rows of the whole weight (at least 0).
    world:
        Ranks sharing it (at least 1).

    Returns
    -------
    tuple of int
        Rows per rank, ``world`` entries summing to ``total``.

    Raises
    ------
    ZeroDivisionError
        ``world`` is 0.

    Example
    -------
    >>> from hybridfp.integration.fsdp_layout import shard_rows
    >>> shard_rows(10, 4)
    (3, 3, 3, 1)
    """
    c = -(-total // world)
    return tuple(max(0, min(c, total - r * c)) for r in range(world))


def block_bounds(total: int, world: int, g: int) -> list[int]:
    """Row boundaries of the ranks' encoded ranges: rank r encodes rows [b[r], b[r+1]), its
    shard's start rounded up to a block boundary (the last ends at ``total``). A shard shorter
    than a block may hold no boundary: that rank's range is empty."""
    c = -(-total // world)
    return [0] + [min(total, -(-r * c // g) * g) for r in range(1, world)] + [total]


def halo_rows(total: int, world: int, g: int) -> int:
    """The most rows any rank's encoded range takes from the start of one later rank's shard.

    Parameters
    ----------
    total:
        Rows of the whole weight.
    world:
        Ranks sharing it (at least 1).
    g:
        Rows per scaling block (the encoded ranges start on multiples of it).

    Returns
    -------
    int
        The halo in rows; 0 when every shard starts on a block boundary.

    Raises
    ------
    ZeroDivisionError
        ``world`` or ``g`` is 0.

    Example
    -------
    >>> from hybridfp.integration.fsdp_layout import halo_rows
    >>> halo_rows(256, 2, 128), halo_rows(200, 2, 128)
    (0, 28)
    """
    c, bounds, rows = -(-total // world), block_bounds(total, world, g), shard_rows(total, world)
    return max([min(rows[j], bounds[r + 1] - j * c) for r in range(world) for j in range(r + 1, world)
                if bounds[r] < bounds[r + 1]] + [0])


def gather_layout(quantize_meta: Callable[[int], QuantizedTensor], total: int, world: int,
                  sets: tuple[tuple[str, ...], ...]) -> GatherLayout:
    """The layout of a weight of ``total`` rows sharded over ``world`` ranks, for gathers
    sending each of ``sets``.

    Parameters
    ----------
    quantize_meta:
        ``rows -> `` a meta-device quantization of that many rows with every copy of ``sets``.
    total, world:
        The whole weight's rows and the number of ranks (FSDP2's shards: :func:`shard_rows`).
    sets:
        The sets of copies gathers send, e.g. ``((ROWWISE,), (COLUMNWISE,))``.

    Returns
    -------
    GatherLayout
        Pieces per set (offsets sized for the largest rank's rows) and the per-rank size.
    """
    whole = quantize_meta(total)
    g = granularity(whole.qstorage)
    bounds = block_bounds(total, world, g)
    rank_rows = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    probe = quantize_meta(max(rank_rows))
    pieces = {s: _pieces(probe.qstorage, s)[0] for s in sets}
    set_bytes = {s: _pieces(probe.qstorage, s)[1] for s in sets}
    return GatherLayout(pieces, max(set_bytes.values()), set_bytes, rank_rows, g, whole,
                        shard_rows(total, world), halo_rows(total, world, g))


def pack(shard: QuantizedTensor, layout: GatherLayout, sent: tuple[str, ...],
         nbytes: Optional[int] = None) -> torch.Tensor:
    """The shard's copies ``sent`` as one ``uint8`` buffer of ``nbytes`` bytes (default
    ``layout.nbytes``; at least ``layout.set_bytes[sent]``).

    Parameters
    ----------
    shard:
        The rank's quantized shard holding (at least) the copies ``sent``.
    layout:
        From :func:`gather_layout`.
    sent:
        One of the layout's sets of copies.
    nbytes:
        The buffer's size.

    Returns
    -------
    torch.Tensor
        ``[nbytes]`` uint8 on the shard's device (padding bytes are zero).
    """
    storage = shard.qstorage
    out = torch.zeros(layout.nbytes if nbytes is None else nbytes, dtype=torch.uint8, device=storage.device)
    for p in layout.pieces[sent]:
        t = storage.part(p.direction).payloads[p.direction][p.name]
        moved = t.movedim(p.axis, 0).contiguous()
        if tuple(moved.shape[1:]) != p.moved_shape[1:] or moved.shape[0] > p.moved_shape[0]:
            raise ValueError(f"{storage.describe()}: {p.direction} '{p.name}' has shape {tuple(moved.shape)} "
                             f"(row axis first); the gather layout has room for {p.moved_shape}.")
        flat = moved.reshape(-1).view(torch.uint8)
        out[p.offset:p.offset + flat.numel()].copy_(flat)  # a rank with fewer rows leaves padding
    return out


def unpack(gathered: torch.Tensor, world: int, layout: GatherLayout, sent: tuple[str, ...],
           nbytes: Optional[int] = None) -> dict[tuple[str, str], torch.Tensor]:
    """The whole weight's row-indexed payload tensors from the all-gathered buffers.

    Parameters
    ----------
    gathered:
        ``[world * layout.nbytes]`` uint8: the ranks' buffers in rank order.
    world:
        The number of ranks.
    layout, sent, nbytes:
        As given to :func:`pack`.

    Returns
    -------
    dict
        ``(direction, name)`` -> the whole tensor in its stored layout (new memory, never a
        view of ``gathered``).
    """
    rows = gathered.view(world, layout.nbytes if nbytes is None else nbytes)
    out = {}
    for p in layout.pieces[sent]:
        if layout.aligned:  # every rank's piece is full: one strided copy
            # always new memory: the caller may free the gathered buffer right away
            chunk = rows[:, p.offset:p.offset + p.nbytes].clone(memory_format=torch.contiguous_format).view(p.dtype)
            whole = chunk.reshape(world * p.moved_shape[0], *p.moved_shape[1:])
        else:  # each rank's encoded rows, cut from its padded piece
            per_row = math.prod(p.moved_shape[1:]) * _element_bytes(p.dtype)
            parts = [rows[r, p.offset:p.offset + -(-n // p.divisor) * per_row] for r, n in enumerate(layout.rank_rows)]
            whole = torch.cat(parts).view(p.dtype).reshape(-1, *p.moved_shape[1:])
        out[(p.direction, p.name)] = whole.movedim(0, p.axis).contiguous()
    return out


def assemble(shard: QuantizedTensor, rows: int, tensors: dict[tuple[str, str], torch.Tensor],
             dtype: Optional[torch.dtype] = None, quantizer: Any = None) -> QuantizedTensor:
    """A quantized tensor of ``rows`` rows from the whole row-indexed payload tensors and the
    shard's per-tensor entries (shared, equal on every rank), holding the copies ``tensors``
    names, with nominal dtype ``dtype`` (default: the shard's).

    Parameters
    ----------
    shard:
        The rank's quantized shard (format, options and per-tensor entries).
    rows:
        The whole weight's dim-0 size.
    tensors:
        From :func:`unpack`.
    dtype:
        The nominal dtype of the result.
    quantizer:
        The quantizer the result names (default: the shard's).

    Returns
    -------
    QuantizedTensor
        The whole weight.
    """
    storage = shard.qstorage
    shape = torch.Size((rows, *storage.shape[1:]))
    directions = tuple(d for d in (ROWWISE, COLUMNWISE) if any(k[0] == d for k in tensors))
    payloads = {}
    for d in directions:
        part = storage.part(d)
        payloads[d] = {name: tensors.get((d, name), t) for name, t in part.payloads[d].items()}
    if isinstance(storage, HybridStorage):  # one part per copy, each a single-format storage
        parts = {d: (storage.part(d)._new(shape, {ROWWISE: None, COLUMNWISE: None, d: payloads[d]}, dtype)
                     if d in payloads else None) for d in (ROWWISE, COLUMNWISE)}
        whole = HybridStorage(shape, dtype or storage.dtype, parts[ROWWISE], parts[COLUMNWISE], label=storage.label)
    else:
        whole = storage._new(shape, {ROWWISE: payloads.get(ROWWISE), COLUMNWISE: payloads.get(COLUMNWISE)}, dtype)
    return QuantizedTensor(whole, quantizer if quantizer is not None else shard.quantizer)
