"""Streaming statistics: sums that one GEMM's operands add to and then are dropped.

Energies are summed in FP64, so the SQNR over several batches is 10 log10(sum |ref|^2 /
sum |ref - approx|^2), the same quantity ``hybridfp.report.sqnr_db`` gives for one tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Elements per block for the outlier statistics (NVFP4's block, the finest of the formats).
BLOCK = 16


def db(signal: float, noise: float) -> float:
    """10 log10(signal / noise); inf when the noise is zero, -inf when the signal is.

    Parameters
    ----------
    signal, noise:
        Energies (sums of squares), at least 0.

    Returns
    -------
    float
        The ratio in dB.

    Raises
    ------
    ValueError
        A negative energy (``math.log10``'s domain).

    Example
    -------
    >>> from hybridfp.analyze.stats import db
    >>> db(100.0, 1.0)
    20.0
    """
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / noise)


def blocks_along(x: torch.Tensor, axis: int) -> torch.Tensor:
    """``x`` (2D) cut into blocks of ``BLOCK`` along ``axis`` (the GEMM's reduction axis),
    zero-padded.

    Parameters
    ----------
    x:
        A 2D tensor.
    axis:
        0: blocks run down columns; 1: along rows.

    Returns
    -------
    torch.Tensor
        [n_blocks, BLOCK].

    Raises
    ------
    IndexError
        ``x`` has fewer than 2 dimensions.

    Example
    -------
    >>> import torch
    >>> from hybridfp.analyze.stats import blocks_along
    >>> blocks_along(torch.ones(4, 20), 1).shape
    torch.Size([8, 16])
    """
    t = x.transpose(0, 1) if axis == 0 else x
    pad = (-t.shape[1]) % BLOCK
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(-1, BLOCK)


@dataclass
class ErrorSums:
    """Error energies of one (layer, GEMM, format): the output and both operands."""

    out_signal: float = 0.0
    out_noise: float = 0.0
    a_signal: float = 0.0
    a_noise: float = 0.0
    b_signal: float = 0.0
    b_noise: float = 0.0
    nbytes: int = 0
    numel: int = 0
    blocks: int = 0
    flushed: int = 0

    def add(self, ref: torch.Tensor, out: torch.Tensor, operands: tuple, decoded: tuple,
            nbytes: int, axes: tuple[int, int]) -> None:
        """Add one GEMM: its reference and approximate outputs, operands, decodes, bytes."""
        self.out_signal += ref.double().pow(2).sum().item()
        self.out_noise += (ref.double() - out.double()).pow(2).sum().item()
        (a, b), (da, dbq) = operands, decoded
        self.a_signal += a.double().pow(2).sum().item()
        self.a_noise += (a.double() - da.double()).pow(2).sum().item()
        self.b_signal += b.double().pow(2).sum().item()
        self.b_noise += (b.double() - dbq.double()).pow(2).sum().item()
        self.nbytes += nbytes
        self.numel += a.numel() + b.numel()
        for src, dec, axis in ((a, da, axes[0]), (b, dbq, axes[1])):
            sb, flat = blocks_along(src, axis), blocks_along(dec, axis)
            live = sb.abs().amax(1) > 0
            self.blocks += int(live.sum())
            self.flushed += int((live & (flat.abs().amax(1) == 0)).sum())

    @property
    def output_db(self) -> float:
        """SQNR of the GEMM output against high precision (dB)."""
        return db(self.out_signal, self.out_noise)

    @property
    def a_db(self) -> float:
        """SQNR of operand A (dB)."""
        return db(self.a_signal, self.a_noise)

    @property
    def b_db(self) -> float:
        """SQNR of operand B (dB)."""
        return db(self.b_signal, self.b_noise)

    @property
    def bytes_per_element(self) -> float:
        """Bytes the GEMM reads per operand element (payload + scales)."""
        return self.nbytes / max(self.numel, 1)

    @property
    def flushed_fraction(self) -> float:
        """Fraction of nonzero 16-element blocks decoded as all zeros."""
        return self.flushed / max(self.blocks, 1)


@dataclass
class OperandStats:
    """Outlier statistics of one operand of one layer (streaming moments and block amaxes)."""

    n: int = 0
    s1: float = 0.0
    s2: float = 0.0
    s3: float = 0.0
    s4: float = 0.0
    absmax: float = 0.0
    log_blocks: int = 0
    log_sum: float = 0.0
    log_max: float = -math.inf

    def add(self, x: torch.Tensor, axis: int) -> None:
        """Add the tensor ``x`` (2D), blocked along its reduction ``axis``."""
        d = x.double()
        self.n += d.numel()
        self.s1 += d.sum().item()
        self.s2 += d.pow(2).sum().item()
        self.s3 += d.pow(3).sum().item()
        self.s4 += d.pow(4).sum().item()
        self.absmax = max(self.absmax, d.abs().max().item() if d.numel() else 0.0)
        amax = blocks_along(x, axis).abs().amax(1).double()
        amax = amax[amax > 0]
        if amax.numel():
            logs = amax.log2()
            self.log_blocks += logs.numel()
            self.log_sum += logs.sum().item()
            self.log_max = max(self.log_max, logs.max().item())

    @property
    def kurtosis(self) -> float:
        """Excess kurtosis (0 for a Gaussian, inf-like for heavy tails)."""
        if self.n == 0:
            return math.nan
        m = self.s1 / self.n
        var = self.s2 / self.n - m * m
        if var <= 0:
            return math.nan
        m4 = self.s4 / self.n - 4 * m * self.s3 / self.n + 6 * m * m * self.s2 / self.n - 3 * m ** 4
        return m4 / var ** 2 - 3.0

    @property
    def block_spread(self) -> float:
        """Octaves between the largest 16-element block amax and the mean block (log2)."""
        if self.log_blocks == 0:
            return math.nan
        return self.log_max - self.log_sum / self.log_blocks
