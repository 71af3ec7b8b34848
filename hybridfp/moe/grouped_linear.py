"""``GroupedLinear``: the experts of an MoE layer, one weight per expert, one call.

``forward(x, m_splits)``: rows of ``x`` are grouped by expert (``m_splits[i]`` rows for
expert i, zero allowed); expert i computes ``x_i W_iᵀ + b_i``. Each expert has its own
quantizers per slot (role module_type "grouped_linear"), so per-tensor scales and blocks never
straddle two experts. The GEMMs per expert are those of ``Linear`` (see linear_function); each
of the three runs for all experts in one ``hybridfp.moe.grouped_gemm`` call (one grouped
kernel where the operand formats allow it, else per expert). The experts' inputs and output
gradients (and their joined weights) are quantized together by ``quantize_grouped``, bitwise
what each expert's own quantizer makes: a row-local rowwise copy (Identity, MXFP8 1x32, FP8
block 1x128, row-scaled NVFP4) is encoded once and handed out as row-slice views; per-tensor
scales from the tensor's own amax (FP8 current scaling, NVFP4 1D rows) come from one segmented
amax and one cast pass for all experts (FP8 columnwise copies: each expert's own transpose,
a view of one buffer); columnwise block copies are encoded once and copied out per expert. Delayed scaling and stochastic rounding stay per
expert (each expert's amax history; each quantization's seed).

The autograd function is ``grouped_linear_function.py``; the experts' weight layouts (joined
into one buffer, or one Parameter) and their quantized cache are ``grouped_weights.py``.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..quantizers import HybridQuantizer, Quantizer
from ..recipes import current_autocast
from ..nn.base import SLOTS, QuantizedModule
from ..nn.linear_function import LinearContext
from ..nn.weight_cache import check_is_first_microbatch
from .grouped_linear_function import GroupedLinearFunction, WeightReuse, any_random
from .grouped_weights import GroupedWeights
from .primary_group import PrimaryGroup


def _offsets_to_splits(offsets: Any, rows: int, who: str) -> list[int]:
    """Cumulative row ends (``torch._grouped_mm``'s ``offs``) as rows per expert, checked."""
    if not torch.is_tensor(offsets) or offsets.dim() != 1 or offsets.dtype.is_floating_point \
            or offsets.dtype.is_complex or offsets.dtype == torch.bool:
        raise TypeError(f"{who}: offsets must be a one-dimensional integer tensor of cumulative row "
                        f"ends (e.g. torch.tensor([4, 4, 9], dtype=torch.int32)); got "
                        f"{type(offsets).__name__}{'' if not torch.is_tensor(offsets) else f' {offsets.dtype} {tuple(offsets.shape)}'}.")
    ends = [int(e) for e in offsets.tolist()]  # one host read, as for an m_splits tensor
    splits = [b - a for a, b in zip([0] + ends[:-1], ends)]
    if any(m < 0 for m in splits):
        raise ValueError(f"{who}: offsets {ends} decrease; they are cumulative row ends, each at least "
                         "the one before.")
    if ends and ends[-1] != rows:
        raise ValueError(f"{who}: offsets end at {ends[-1]} but the input has {rows} rows; the last "
                         "offset is the number of rows.")
    return splits


def _split_counts(m_splits: Any, who: str) -> list[int]:
    """``m_splits`` as Python ints, refusing anything that is not integer counts (a float
    would be truncated and a string read digit by digit: rows silently routed elsewhere)."""
    def given() -> str:  # the value for an error message, formatted only when one is raised
        text = repr(m_splits)
        return text if len(text) <= 80 else text[:77] + "..."

    if torch.is_tensor(m_splits):
        if m_splits.dtype.is_floating_point or m_splits.dtype.is_complex or m_splits.dtype == torch.bool:
            raise TypeError(f"{who}: m_splits is a {m_splits.dtype} tensor; pass integer row counts "
                            "(an int64 tensor or a list of ints).")
        if m_splits.dim() != 1:
            raise ValueError(f"{who}: m_splits must be a one-dimensional tensor of row counts; got "
                             f"shape {tuple(m_splits.shape)}.")
        return [int(m) for m in m_splits.tolist()]
    if isinstance(m_splits, np.ndarray):  # numpy counts: the same checks as a tensor's
        if m_splits.dtype.kind not in "iu" or m_splits.ndim != 1:
            raise TypeError(f"{who}: m_splits is a numpy array of dtype {m_splits.dtype} and shape "
                            f"{m_splits.shape}; pass one-dimensional integer row counts.")
        return [int(m) for m in m_splits.tolist()]
    if isinstance(m_splits, (str, bytes)) or not isinstance(m_splits, Sequence):
        raise TypeError(f"{who}: m_splits={given()} is not a sequence of ints; pass the number of rows "
                        "of each expert, e.g. [4, 0, 9] (or an int64 tensor).")
    splits = []
    for m in m_splits:
        if isinstance(m, bool):
            raise TypeError(f"{who}: m_splits={given()} holds {m!r}; pass int row counts.")
        try:
            splits.append(operator.index(m))
        except TypeError:
            raise TypeError(f"{who}: m_splits={given()} holds {m!r} ({type(m).__name__}); pass int row "
                            "counts.") from None
    return splits


class GroupedLinear(GroupedWeights, QuantizedModule):
    """``num_gemms`` experts of shape [out_features, in_features] (parameters ``weight{i}``
    and ``bias{i}``, TransformerEngine's names).

    ``pack_weights`` (default True): the expert weights live in one [num_gemms, out, in]
    buffer, each ``weight{i}`` a slice of it (its own Parameter, gradient, version counter
    and state_dict entry), so the grouped weight quantization reads them in place instead of
    stacking them every step (``quantize_weights_grouped``; ``python -m bench.bench_moe``'s
    "[unpacked weights]" rows time the difference). The packing survives ``.to()`` / ``.cuda()``
    (re-packed after the move); parameters replaced from outside (FSDP2, ``load_state_dict(
    assign=True)``) are used as they are. ``safetensors.torch.save_file`` refuses tensors that
    share storage: save ``{k: v.clone()}`` there, or build with ``pack_weights=False``.

    ``single_parameter`` (default False): one Parameter ``weight`` [num_gemms, out, in] (and
    ``bias`` [num_gemms, out]) instead of ``weight{i}`` / ``bias{i}``, as torch-native MoE
    code (``torch._grouped_mm`` layers) holds its experts. Autograd then accumulates one
    gradient instead of one per expert (two AccumulateGrad calls a layer instead of 2 x
    num_gemms: less host work, timed by ``python -m bench.bench_moe``'s "[one weight
    Parameter]" rows), and an optimizer steps one tensor. The experts' values, quantization
    and results are bitwise those of the per-expert Parameters with the same seed; an in-place
    change re-quantizes every expert (one version counter). ``load_state_dict`` takes either
    layout's keys.

    Under ``hybridfp.quantized_model_init`` each ``weight{i}`` is a ``QuantizedTensor``
    Parameter (both copies, the expert's own quantizer; ``single_parameter=True`` refuses it),
    read as held: no weight quantization in forward or backward. Where the format's grouped
    encoding is joined copies (FP8 current scaling, MXFP8, ...), the Parameters' copies are
    views of one joined encoding (``moe/primary_group.py``): the grouped GEMMs read it as it is
    and ``quantize_master_weights`` re-encodes all experts in one grouped call. Other formats
    (delayed scaling, FP8 block, stochastic rounding) keep one storage per expert: CUDA's
    grouped BF16 and ``torch._scaled_grouped_mm`` paths then stack the experts' copies into
    one [E, ...] operand in each fprop and dgrad.

    Parameters
    ----------
    num_gemms:
        The number of experts, >= 1.
    in_features, out_features:
        Each expert's weight is [out_features, in_features].
    bias:
        Whether each expert has a learnable bias.
    params_dtype, device, save_original_input, name:
        As :class:`~hybridfp.Linear`'s.
    pack_weights:
        Keep the per-expert weights in one buffer (above).
    single_parameter:
        One [num_gemms, out, in] Parameter ``weight`` (above).

    Raises
    ------
    ValueError
        ``num_gemms`` < 1. From ``forward``: see :meth:`forward`.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> experts = hf.GroupedLinear(3, 64, 32, name="moe.fc1")
    >>> x = torch.randn(10, 64, requires_grad=True)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = experts(x, [4, 0, 6])        # rows 0-3: expert 0, rows 4-9: expert 2
    >>> y.sum().backward()
    >>> y.shape, experts.weight0.grad.shape
    (torch.Size([10, 32]), torch.Size([32, 64]))
    """

    module_type = "grouped_linear"
    #: The experts' per-tensor scales come from one segmented amax over all of them
    #: (moe/quantize_scaled.py), not from a recorded whole-tensor amax; a per-expert amax
    #: recorded by the kernel that wrote the input (``hybridfp.swiglu(h, splits=...)``) replaces it.
    reads_recorded_amax = False
    reads_recorded_group_amax = True
    #: The recipe's ``backward_override`` has Linear's meaning, per expert
    #: (``grouped_linear_function.py``).
    supports_backward_override = True

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None,
                 save_original_input: bool = False, name: Optional[str] = None,
                 pack_weights: bool = True, single_parameter: bool = False) -> None:
        super().__init__(name, num_quantizer_sets=num_gemms)
        if num_gemms < 1:
            raise ValueError(f"GroupedLinear needs num_gemms >= 1; got {num_gemms}.")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.save_original_input = bias, save_original_input
        self.single_parameter = single_parameter
        kw = {"dtype": params_dtype or torch.float32, "device": device}
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        if single_parameter:
            self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, **kw))
            self.bias = nn.Parameter(torch.empty(num_gemms, out_features, **kw)) if bias else None
        for i in range(num_gemms):  # per expert, in the same order either way: the same init
            w = self.weight[i] if single_parameter else nn.Parameter(torch.empty(out_features, in_features, **kw))
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            b = (self.bias[i] if single_parameter else nn.Parameter(torch.empty(out_features, **kw))) if bias else None
            if b is not None:
                with torch.no_grad():
                    b.uniform_(-bound, bound)
            if not single_parameter:
                self.register_parameter(f"weight{i}", w)
                if b is not None:
                    self.register_parameter(f"bias{i}", b)
        # single_parameter: the experts' weights as detached views of ``weight`` (sharing its
        # version counter) and what they were made from; kept so that the weight cache's keys
        # (which hold each weight's identity) stay the same from one forward to the next
        self._views: list[list[torch.Tensor]] = [[], []]
        self._views_key: Optional[tuple] = None
        self.pack_weights = pack_weights
        # the experts' LinearContexts of the last forward and what they were built from: they
        # hold nothing per call, so a forward with the same quantizers reuses them
        self._lcs: list[LinearContext] = []
        self._lcs_key: Optional[tuple] = None
        self._lcs_random = False  # whether _lcs's input / weight quantizers draw random numbers
        # quantize_grouped's plans for this module's quantizers (``plans=``), emptied with them
        self._plans: dict = {}
        # pack_weights: the [E, N, K] buffer the experts' weights were moved into (``_pack``)
        self._packed: Optional[torch.Tensor] = None
        # quantized primary weights joined into one encoding (``primary_group``)
        self._primary: Optional[PrimaryGroup] = None
        self._join_wanted = False  # quantized primary weights to hold joined (until un-joined)
        self._pack()

    def _check_splits(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                      arg: str = "m_splits") -> list[int]:
        """``m_splits`` as a list of ints, checked against the experts and the input's rows.

        Parameters
        ----------
        x:
            The [tokens, in_features] input.
        m_splits:
            Rows per expert: a sequence of non-negative Python ints (``operator.index``-able,
            not bool), or a 1-D integer tensor (read once with ``tolist()``: a CUDA tensor
            costs the one host sync it always did).
        arg:
            The argument the caller passed, for the messages: "m_splits", or "offsets" when the
            counts were derived from ``offsets`` (one cumulative row end per expert).

        Returns
        -------
        list[int]
            The row counts.

        Raises
        ------
        TypeError
            Not a sequence / tensor of integers (floats, strings, None, bools).
        ValueError
            Wrong number of entries, a negative entry, or a sum other than ``x``'s rows.
        """
        who = f"GroupedLinear {self.name or ''}".rstrip()
        splits = _split_counts(m_splits, who)
        if len(splits) != self.num_gemms:
            raise ValueError(f"{who}: {arg} has {len(splits)} entries; it needs one per expert "
                             f"({self.num_gemms}).")
        if any([m < 0 for m in splits]):  # a list: one Python frame, not one per expert
            raise ValueError(f"{who}: m_splits {splits} has negative entries.")
        if sum(splits) != x.shape[0]:
            raise ValueError(f"{who}: m_splits sum to {sum(splits)} but the input has {x.shape[0]} "
                             "rows; pass the number of rows routed to each expert (input flattened "
                             "to [tokens, in_features]).")
        return splits

    def _validate_quantizers(self, built: dict[str, list[Quantizer]]) -> None:
        """All experts of a slot must be all-hybrid or all-plain, with one columnwise_source."""
        for slot in SLOTS:
            qs = built[slot]
            hybrid = {isinstance(q, HybridQuantizer) for q in qs}
            if len(hybrid) > 1:
                raise ValueError(f"role {qs[0].role}: the factory returned HybridQuantizers for some "
                                 "experts and plain quantizers for others; return the same kind for "
                                 "every expert of a GroupedLinear.")
            sources = {q.columnwise_source for q in qs if isinstance(q, HybridQuantizer)}
            if len(sources) > 1:
                raise ValueError(f"role {qs[0].role}: experts use different columnwise_source values "
                                 f"({sorted(sources)}); use one for every expert.")

    def forward(self, x: torch.Tensor, m_splits: Optional[Sequence[int] | torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None, *,
                offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [sum(m_splits), in_features] -> [sum(m_splits), out_features]; expert i computes
        ``x_i W_iᵀ + b_i`` on its ``m_splits[i]`` consecutive rows.

        Under ``torch.compile`` the call is one graph break (the model around it compiles):
        the experts' quantized copies and GEMMs take their per-expert row counts on the host,
        so the layer runs eagerly between two graphs, bitwise as in eager.

        Parameters
        ----------
        x:
            The [tokens, in_features] input, rows grouped by expert.
        m_splits:
            Rows per expert: a sequence of non-negative ints (zero allowed), or a 1-D integer
            tensor (read once with ``tolist()``). Give it or ``offsets``.
        is_first_microbatch:
            As :meth:`Linear.forward`'s (TransformerEngine's weight reuse across autocast
            regions, for every expert at once; see ``hybridfp.nn.weight_cache``).
        offsets:
            Instead of ``m_splits``: the experts' cumulative row ends as a 1-D integer tensor on
            any device (``torch._grouped_mm``'s ``offs``: expert i owns rows
            ``offsets[i-1]:offsets[i]``, the last entry is the number of rows).

        Returns
        -------
        torch.Tensor
            [tokens, out_features].

        Raises
        ------
        ValueError
            ``x`` is not [tokens, in_features]; ``m_splits`` has the wrong length, a negative
            entry, or a sum other than ``x``'s rows; both or neither of ``m_splits`` and
            ``offsets`` given; ``offsets`` decreasing or not ending at ``x``'s rows; the recipe returns hybrid quantizers for
            some experts of a slot and plain ones for others (or mixed ``columnwise_source``).
        TypeError
            ``m_splits`` is not integer counts; ``is_first_microbatch`` not None / True /
            False.
        RuntimeError
            As :meth:`Linear.forward`.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> experts = hf.GroupedLinear(2, 16, 8)
        >>> experts(torch.randn(5, 16), torch.tensor([2, 3])).shape
        torch.Size([5, 8])
        """
        if torch.compiler.is_compiling():  # one break: the eager layer between two graphs
            # torch.compiler.disable made here, not at import: it imports Dynamo, which imports
            # Triton, and Triton reads TRITON_INTERPRET once, when it is imported
            untraced = torch.compiler.disable(GroupedLinear._forward, recursive=True)
            return untraced(self, x, m_splits, is_first_microbatch, offsets)
        return self._forward(x, m_splits, is_first_microbatch, offsets)

    def _forward(self, x: torch.Tensor, m_splits: Optional[Sequence[int] | torch.Tensor],
                 is_first_microbatch: Optional[bool], offsets: Optional[torch.Tensor]) -> torch.Tensor:
        """:meth:`forward`'s body."""
        check_is_first_microbatch(is_first_microbatch, self._who())
        if m_splits is None and offsets is None:
            raise TypeError(f"{self._who()}: m_splits=None is not a sequence of ints; pass the number of "
                            "rows of each expert, e.g. [4, 0, 9], or offsets= (cumulative row ends, as "
                            "torch._grouped_mm's offs).")
        if m_splits is not None and offsets is not None:
            raise TypeError(f"{self._who()}: pass exactly one of m_splits (rows per expert) and offsets "
                            "(cumulative row ends, as torch._grouped_mm's offs), not both.")
        if offsets is not None:
            m_splits = _offsets_to_splits(offsets, x.shape[0], self._who())
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear {self.name}: input must be [tokens, {self.in_features}]; "
                             f"got {tuple(x.shape)}.")
        splits = self._check_splits(x, m_splits, "m_splits" if offsets is None else "offsets")
        state = current_autocast()
        if state is None:
            if self.single_parameter:  # autograd views, so that the gradients reach the Parameters
                ws = self.weight.unbind(0)
                bs = self.bias.unbind(0) if self.use_bias else [None] * self.num_gemms
            else:
                ws, bs = self.weights(), self.biases() or [None] * self.num_gemms
            outs = [self.high_precision_linear(xi, w, b) for xi, w, b in zip(torch.split(x, splits), ws, bs)]
            return torch.cat(outs)
        qs = self.quantizers(state)
        x = self.torch_autocast_input(x)
        grad_enabled = torch.is_grad_enabled()
        last = self._lcs_key  # (the quantizers dict itself, held: its id cannot be reused, flags)
        override = getattr(state.recipe, "backward_override", None)
        if last is None or last[0] is not qs or last[1:] != (self.save_original_input, grad_enabled, override):
            self._lcs = [LinearContext(qs["input"][i], qs["weight"][i], qs["grad_output"][i], self, i,
                                       self.save_original_input, grad_enabled, backward_override=override)
                         for i in range(self.num_gemms)]
            self._lcs_random = any_random(self._lcs)
            if last is None or last[0] is not qs:
                self._plans = {}  # new quantizers: the old plans' keys name the old ones
            self._lcs_key = (qs, self.save_original_input, grad_enabled, override)
        reuse = WeightReuse(state.token, is_first_microbatch)
        if self.single_parameter:
            params = (self.weight, self.bias) if self.use_bias else (self.weight,)
            return GroupedLinearFunction.apply(x, splits, self._lcs, self.use_bias, self._expert_views()[0], reuse,
                                               *params)
        return GroupedLinearFunction.apply(x, splits, self._lcs, self.use_bias, None, reuse, *self.weights(),
                                           *self.biases())

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}"
                + (", single_parameter=True" if self.single_parameter else ""))
