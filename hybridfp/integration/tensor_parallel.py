"""Tensor and sequence parallelism for hybridfp's modules: parallel styles for
``torch.distributed.tensor.parallel.parallelize_module``.

torch's ``ColwiseParallel`` / ``RowwiseParallel`` take only ``nn.Linear`` / ``nn.Embedding``
and run the GEMM on DTensors; hybridfp's modules quantize their operands themselves, so their
styles shard the parameters as DTensors (what ``state_dict``, ``torch.distributed.checkpoint``
and optimizers see, as with torch's styles) and hand the module a plan
(``module._tensor_parallel``) by which it runs its GEMMs on the local shards with the
collectives (``tensor_parallel_linear.py``): the same arguments as torch's and torchao's
float8 styles, one name each.

Sequence parallelism (``input_layouts=Shard(seq_dim)`` on the column-parallel layer,
``output_layouts=Shard(seq_dim)`` on the row-parallel one): the norm runs on the rank's own
rows, its output is quantized there (amax reduced over the group) and all-gathered as the
quantized rowwise copy for fprop, the columnwise copy again in backward for wgrad; the
row-parallel output is reduce-scattered along the rows (its gradient quantized on each rank's
rows and all-gathered quantized: the rowwise copy for dgrad, the columnwise copy for wgrad). The sequence dimension must be the first dimension of size > 1 (``[S, B, H]`` with
``Shard(0)``, or ``[1, S, H]`` with ``Shard(1)``), so each rank's rows are one contiguous
block of the flattened rows.

Quantized primary weights (``quantized_model_init``): a style shards the weight's FP32 master
and each rank keeps the quantized copies of its shard (``tensor_parallel_primary.py``).

Limitations (documented in README's tensor-parallel section and ROADMAP.md; each raises
``NotImplementedError`` naming the layer and what to do instead): ``backward_override``,
``save_original_input``, ``autocast(amax_reduction_group=...)`` (the layers reduce their split
operands over the tensor-parallel group themselves), a sequence dim after a batch dim > 1, and
input / output layouts other than ``Replicate()`` and ``Shard(sequence_dim)`` (a column-parallel
output: ``Shard(-1)``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from ..nn import LayerNormLinear, LayerNormMLP, Linear
from ..nn.layernorm_linear import normalize
from ..nn.layernorm_mlp import _GATED, activate
from ..nn.weight_cache import check_is_first_microbatch
from ..recipes import current_autocast
from .tensor_parallel_comm import (CopyToParallel, GatherRows, ReduceFromParallel, ReduceScatterRows,
                                   all_gather_count)
from .tensor_parallel_linear import (COLUMN, ROW, ParallelGemm, ParallelLinearFunction, WeightShard,
                                     check_split, flat_rows, is_quantized, local_weight, set_amax_groups)
from .tensor_parallel_primary import is_tensor_parallel_primary, primary_shard, shard_primary


def _seq_dim(layout: Any, what: str) -> Optional[int]:
    """None for ``Replicate()``, the sequence dim for ``Shard(d)``; else a clear error."""
    if layout is None or isinstance(layout, Replicate):
        return None
    if isinstance(layout, Shard):
        return layout.dim
    raise NotImplementedError(f"{what}={layout!r} is not supported; use Replicate() or Shard(sequence_dim).")


class _Plan:
    """A module's tensor-parallel plan: how each GEMM set is split and the I/O layouts. The
    module's forward calls :meth:`forward` (``hybridfp.nn``'s modules look it up)."""

    def __init__(self, mesh: DeviceMesh, kinds: tuple[str, ...], seq_dim: Optional[int],
                 use_local_output: bool, who: str, gated: bool = False) -> None:
        self.mesh, self.group = mesh, mesh.get_group()
        self.gated = gated  # GEMM set 0's output is [gate_r | up_r] on each rank
        self.world = mesh.size()
        self.kinds, self.seq_dim, self.use_local_output = kinds, seq_dim, use_local_output
        self.sp = seq_dim is not None
        self.specs = tuple(ParallelGemm(k, self.group, self.world, self.sp, f"{who} ({k}-parallel)") for k in kinds)
        self.who = who

    # ------------------------------------------------------------------ input / output
    def _local(self, x: torch.Tensor, sharded_last: bool) -> torch.Tensor:
        if isinstance(x, DTensor):
            want = Shard(x.dim() - 1) if sharded_last else (Shard(self.seq_dim) if self.sp else Replicate())
            got = x.placements[0]
            if isinstance(got, Shard) and got.dim < 0:
                got = Shard(got.dim + x.dim())
            if got != want:
                raise ValueError(f"{self.who}: the input DTensor is placed {x.placements}; this layer takes "
                                 f"{want!r} (its input_layouts). Redistribute it first.")
            x = x.to_local()
        return x

    def _check_rows(self, x: torch.Tensor, spec: ParallelGemm) -> None:
        """Sequence parallel: each rank's rows must be one contiguous block of the flattened
        rows (the dims before the sequence dim of size 1); a reduce-scatter needs the sequence
        to split evenly, and a gather needs every rank to hold as many rows as the others."""
        d = self.seq_dim % x.dim()
        if d == x.dim() - 1 or any(s != 1 for s in x.shape[:d]):
            raise NotImplementedError(
                f"{spec.who}: sequence parallelism along dim {self.seq_dim} of an input of shape "
                f"{tuple(x.shape)}: the dims before the sequence dim must have size 1, so each rank's "
                "rows are one contiguous block ([S, B, H] with Shard(0), or [1, S, H] with Shard(1)).")
        if spec.kind == ROW and x.shape[d] % self.world:
            raise ValueError(f"{spec.who}: the sequence length {x.shape[d]} does not split evenly over "
                             f"{self.world} tensor-parallel ranks; pad it to a multiple of {self.world}.")
        if spec.kind == COLUMN:
            # the gathers take equal parts from every rank (else a collective fails on one rank
            # and leaves the others waiting): every rank compares all the counts, so all raise
            # alike, before any other collective of this layer
            rows = math.prod(x.shape[:-1])
            counts = all_gather_count(rows, self.group, x.device)
            if any(c != rows for c in counts):
                raise ValueError(
                    f"{spec.who}: sequence parallelism gathers every rank's rows of the input, so each "
                    f"rank must hold the same number of rows; the {self.world} tensor-parallel ranks hold "
                    f"{counts} rows (this rank's input has shape {tuple(x.shape)}, the sequence along dim "
                    f"{d}). Pad the sequence to a multiple of {self.world} before splitting it.")

    def _output(self, y: torch.Tensor, sharded_last: bool) -> torch.Tensor:
        if self.use_local_output:
            return y
        layout = Shard(y.dim() - 1) if sharded_last else (Shard(self.seq_dim) if self.sp else Replicate())
        return DTensor.from_local(y, self.mesh, [layout], run_check=False)

    def _out_shape(self, x: torch.Tensor, rows_factor: float, n: int) -> tuple[int, ...]:
        shape = list(x.shape[:-1])
        if self.sp and rows_factor != 1:
            d = self.seq_dim % x.dim()
            shape[d] = int(shape[d] * rows_factor)
        return (*shape, n)

    # ------------------------------------------------------------------ one GEMM set
    def gemm(self, module: Any, index: int, x: torch.Tensor, weight: nn.Parameter,
             bias: Optional[nn.Parameter], state: Any, is_first_microbatch: Optional[bool]) -> torch.Tensor:
        """GEMM set ``index`` on the local input ``x`` [..., K_local]; the local output."""
        spec = self.specs[index]
        # first, before any autograd view of the local tensor exists: an in-place write of the
        # DTensor since the last call moves the local tensor's version counter here (the weight
        # cache keys on it), and autograd refuses a view whose base was so written after it
        local = None if is_tensor_parallel_primary(weight) else local_weight(weight)
        w_local = weight.to_local()
        b_local = bias.to_local() if bias is not None else None
        k_local = w_local.shape[1]
        if x.shape[-1] != k_local:
            raise ValueError(f"{spec.who}: the input has shape {tuple(x.shape)}; its last dimension must be "
                             f"{k_local} (this rank's in_features).")
        if self.sp:
            self._check_rows(x, spec)
        x2 = flat_rows(x)
        factor = self.world if (spec.kind == COLUMN and self.sp) else (1 / self.world if self.sp else 1)
        if state is None:  # a quantized primary weight too: on its FP32 master shard
            y2 = self._high_precision(module, spec, x2, w_local, b_local)
        else:
            x2 = module.torch_autocast_input(x2)
            lc = module.linear_context(state, index, is_first_microbatch)
            self._check(state, lc, spec, x2, w_local, halves=self.gated and index == 0)
            set_amax_groups(lc, spec)
            # a quantized primary weight: the GEMMs read its quantized shard, the gradient goes to
            # its FP32 master shard (w_local)
            held = primary_shard(weight, lc.weight_q)
            source = held if held is not None else local
            y2 = ParallelLinearFunction.apply(x2, w_local, b_local, lc, spec, WeightShard(source))
        return y2.reshape(self._out_shape(x, factor, y2.shape[-1]))

    def _high_precision(self, module: Any, spec: ParallelGemm, x2: torch.Tensor, w: torch.Tensor,
                        b: Optional[torch.Tensor]) -> torch.Tensor:
        module._refuse_silent_recompute()
        w = w.to(x2.dtype)
        b = None if b is None else b.to(x2.dtype)
        if spec.kind == COLUMN:
            xf = GatherRows.apply(x2, self.group) if self.sp else CopyToParallel.apply(x2, self.group)
            return F.linear(xf, w, b)
        part = F.linear(x2, w)
        if not self.sp:  # y and its gradient are whole on every rank: so is the bias gradient
            y = ReduceFromParallel.apply(part, self.group)
            return y if b is None else y + b
        # each rank adds the replicated bias to its own rows only: its gradient on a rank is that
        # rank's rows' sum, summed over the group in backward (as the quantized path does)
        y = ReduceScatterRows.apply(part, self.group)
        return y if b is None else y + CopyToParallel.apply(b, self.group)

    def _check(self, state: Any, lc: Any, spec: ParallelGemm, x2: torch.Tensor, w: torch.Tensor,
               halves: bool = False) -> None:
        if state.amax_reduction_group is not None:
            raise NotImplementedError(
                f"{spec.who}: hybridfp.autocast(amax_reduction_group=...) with tensor parallelism: the "
                "tensor-parallel layers reduce their split operands' amaxes over the tensor-parallel group "
                "themselves. Leave amax_reduction_group unset.")
        if lc.backward_override is not None:
            raise NotImplementedError(f"{spec.who}: backward_override={lc.backward_override!r} is not "
                                      "supported with tensor parallelism; use a recipe without it.")
        if lc.save_original_input:
            raise NotImplementedError(f"{spec.who}: save_original_input=True is not supported with tensor "
                                      "parallelism; build the module with save_original_input=False.")
        splits = spec.split_slots()
        rows = x2.shape[0]
        # dy's rows on this rank: a column-parallel layer's whole, a row-parallel one's own share
        dy_rows = rows if not spec.sequence_parallel else (rows * spec.world if spec.kind == COLUMN
                                                           else rows // spec.world)
        shapes = {"input": (rows, x2.shape[1]), "weight": tuple(w.shape), "grad_output": (dy_rows, w.shape[0])}
        for slot, q in (("input", lc.input_q), ("weight", lc.weight_q), ("grad_output", lc.grad_q)):
            check_split(q, slot, splits[slot], *shapes[slot], spec, halves=halves and slot != "input")

    def _norm(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        w = module.layer_norm_weight.to_local()
        b = module.layer_norm_bias.to_local() if module.layer_norm_bias is not None else None
        if self.sp:  # each rank normalizes its own rows: the parameters' gradients are partial sums
            w = CopyToParallel.apply(w, self.group)
            b = CopyToParallel.apply(b, self.group) if b is not None else None
        return normalize(x, module.normalization, w, b, module.eps)

    # ------------------------------------------------------------------ the modules' forwards
    def forward(self, module: Any, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """The module's forward on this rank's part of the input (see the module docstring)."""
        check_is_first_microbatch(is_first_microbatch, module._who())
        state = current_autocast()
        if isinstance(module, LayerNormMLP):
            x = self._local(x, sharded_last=False)
            h = module.torch_autocast_input(self._norm(module, x)) if state is not None else self._norm(module, x)
            y1 = self.gemm(module, 0, h, module.fc1_weight, module.fc1_bias, state, is_first_microbatch)
            a = activate(module.activation, y1)
            if state is not None:
                a = module.torch_autocast_input(a)
            y = self.gemm(module, 1, a, module.fc2_weight, module.fc2_bias, state, is_first_microbatch)
            return self._output(y, sharded_last=False)
        column = self.kinds[0] == COLUMN
        x = self._local(x, sharded_last=not column)
        if isinstance(module, LayerNormLinear):
            x = self._norm(module, x)
        y = self.gemm(module, 0, x, module.weight, module.bias, state, is_first_microbatch)
        return self._output(y, sharded_last=column)


def _mesh_1d(mesh: DeviceMesh, who: str) -> DeviceMesh:
    if mesh.ndim != 1:
        raise ValueError(f"{who}: tensor parallelism takes a 1-D DeviceMesh (the tensor-parallel group); "
                         f"got {mesh.ndim} dims. Pass mesh['tp'] for one dimension of a larger mesh.")
    return mesh


def _shard(module: nn.Module, name: str, mesh: DeviceMesh, placement: Any, src_data_rank: Optional[int]) -> None:
    p = getattr(module, name)
    if p is None:
        return
    if is_quantized(p):  # quantized_model_init: the FP32 master sharded, each rank's shard quantized
        who = f"{_who(module)}.{name}"
        module.register_parameter(name, shard_primary(p, mesh, placement, src_data_rank, who))
        return
    if isinstance(p, DTensor):
        raise ValueError(f"{type(module).__name__}.{name} is already a DTensor: the module was "
                         "parallelized before.")
    dt = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _install(module: nn.Module, plan: _Plan) -> nn.Module:
    if module._quantizers:  # type: ignore[attr-defined]
        module._wcache.clear()  # type: ignore[attr-defined]  # cached copies of the whole weight
    module._tensor_parallel = plan  # type: ignore[attr-defined]
    return module


def _cls(module: nn.Module) -> str:
    """The module's class with its module path (torch.nn.Linear vs hybridfp's Linear)."""
    return f"{type(module).__module__}.{type(module).__name__}"


def _who(module: nn.Module) -> str:
    return f"{type(module).__name__} {getattr(module, 'name', '') or ''}".strip()


class ColwiseParallel(ParallelStyle):
    """Column-parallel ``hybridfp.Linear`` / ``LayerNormLinear``: the weight (and bias) sharded
    along out_features (``Shard(0)``), each rank computing its output features with the
    module's quantizers; torch's ``ColwiseParallel`` arguments.

    The weight and its gradient (dy) are split along N, so their per-tensor amaxes are reduced
    over the group; x is whole on every rank (no reduction), or, with
    ``input_layouts=Shard(seq_dim)`` (sequence parallelism), split along the rows: then the norm
    of a ``LayerNormLinear`` runs on the rank's rows, the amax is reduced and the quantized
    rowwise copy is all-gathered for fprop (the columnwise copy in backward, for wgrad). The
    input gradient is all-reduced (sequence parallel: reduce-scattered).

    Parameters
    ----------
    input_layouts:
        ``Replicate()`` (default) or ``Shard(seq_dim)`` (sequence parallel).
    output_layouts:
        ``Shard(-1)`` (default): each rank's output features.
    use_local_output:
        Return the local tensor (default), else a DTensor placed as ``output_layouts``.

    Raises
    ------
    TypeError
        From ``parallelize_module``: a module other than Linear / LayerNormLinear.
    NotImplementedError
        Another layout.

    Example
    -------
    >>> import torch, torch.distributed as dist, hybridfp as hf
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor.parallel import parallelize_module
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> mlp = torch.nn.Sequential(hf.Linear(32, 64), torch.nn.GELU(), hf.Linear(64, 32))
    >>> _ = parallelize_module(mlp, mesh, {"0": hf.ColwiseParallel(), "2": hf.RowwiseParallel()})
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = mlp(torch.randn(32, 32))
    >>> y.shape, type(mlp[0].weight).__name__
    (torch.Size([32, 32]), 'DTensor')
    >>> dist.destroy_process_group()
    """

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None, use_local_output: bool = True) -> None:
        super().__init__()
        self.seq_dim = _seq_dim(input_layouts, "ColwiseParallel input_layouts")
        if output_layouts is not None and not (isinstance(output_layouts, Shard) and output_layouts.dim in (-1,)):
            raise NotImplementedError(f"ColwiseParallel output_layouts={output_layouts!r}: only Shard(-1) (each "
                                      "rank's output features) is supported.")
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, (Linear, LayerNormLinear)):
            hint = " (use hybridfp.LayerNormMLPParallel)" if isinstance(module, LayerNormMLP) else ""
            raise TypeError(f"hybridfp.ColwiseParallel takes hybridfp.Linear or LayerNormLinear; got "
                            f"{_cls(module)}{hint}. For torch.nn.Linear use torch's ColwiseParallel.")
        mesh = _mesh_1d(device_mesh, _who(module))
        _shard(module, "weight", mesh, Shard(0), self.src_data_rank)
        _shard(module, "bias", mesh, Shard(0), self.src_data_rank)
        if isinstance(module, LayerNormLinear):
            _shard(module, "layer_norm_weight", mesh, Replicate(), self.src_data_rank)
            _shard(module, "layer_norm_bias", mesh, Replicate(), self.src_data_rank)
        return _install(module, _Plan(mesh, (COLUMN,), self.seq_dim, self.use_local_output, _who(module)))


class RowwiseParallel(ParallelStyle):
    """Row-parallel ``hybridfp.Linear``: the weight sharded along in_features (``Shard(1)``),
    the bias replicated; each rank multiplies its input features, the FP32 partial outputs are
    all-reduced (with ``output_layouts=Shard(seq_dim)``: reduce-scattered along the rows,
    sequence parallelism) and the bias added once; torch's ``RowwiseParallel`` arguments.

    x and W are split along K, so their per-tensor amaxes are reduced over the group; dy is whole
    on every rank (sequence parallel: each rank quantizes its rows with the amax reduced over the
    group, and the copies are all-gathered quantized).

    Parameters
    ----------
    input_layouts:
        ``Shard(-1)`` (default): each rank's input features (a column-parallel layer's output).
    output_layouts:
        ``Replicate()`` (default) or ``Shard(seq_dim)`` (sequence parallel).
    use_local_output:
        Return the local tensor (default), else a DTensor placed as ``output_layouts``.

    Raises
    ------
    TypeError
        From ``parallelize_module``: a module other than ``hybridfp.Linear`` (a norm needs whole rows).
    NotImplementedError
        Another layout.

    Example
    -------
    >>> import hybridfp as hf
    >>> from torch.distributed.tensor import Shard
    >>> plan = {"fc1": hf.ColwiseParallel(input_layouts=Shard(0)),
    ...         "fc2": hf.RowwiseParallel(output_layouts=Shard(0))}    # sequence parallel
    >>> plan["fc2"].seq_dim
    0
    """

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None, use_local_output: bool = True) -> None:
        super().__init__()
        if input_layouts is not None and not (isinstance(input_layouts, Shard) and input_layouts.dim == -1):
            raise NotImplementedError(f"RowwiseParallel input_layouts={input_layouts!r}: only Shard(-1) (each "
                                      "rank's input features) is supported.")
        self.seq_dim = _seq_dim(output_layouts, "RowwiseParallel output_layouts")
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Linear):  # a subclass too (torchtitan's converted Linear)
            raise TypeError(f"hybridfp.RowwiseParallel takes hybridfp.Linear; got {_cls(module)} (a "
                            "norm before a row-parallel GEMM would see only part of each row). For "
                            "torch.nn.Linear use torch's RowwiseParallel.")
        mesh = _mesh_1d(device_mesh, _who(module))
        _shard(module, "weight", mesh, Shard(1), self.src_data_rank)
        _shard(module, "bias", mesh, Replicate(), self.src_data_rank)
        return _install(module, _Plan(mesh, (ROW,), self.seq_dim, self.use_local_output, _who(module)))


class LayerNormMLPParallel(ParallelStyle):
    """A tensor-parallel ``hybridfp.LayerNormMLP``: fc1 column-parallel, fc2 row-parallel in one
    module (TransformerEngine's ``LayerNormMLP`` with ``tp_group``): the norm's parameters
    replicated, ``fc1_weight`` / ``fc1_bias`` ``Shard(0)``, ``fc2_weight`` ``Shard(1)``,
    ``fc2_bias`` replicated. fc1 and fc2 split their operands as :class:`ColwiseParallel` and
    :class:`RowwiseParallel` do.

    A gated activation (swiglu, geglu, ...): fc1's output is [gate | up] (``2 * ffn`` rows of
    ``fc1_weight``), and each rank holds the gate rows and the up rows of its own ffn slice,
    ``[gate_r; up_r]``, so the activation runs on the rank's own fc1 output. ``fc1_weight`` /
    ``fc1_bias`` are then placed ``_StridedShard(0, split_factor=2)`` (torch's placement for
    "split in 2 along dim 0, then each part sharded"): the DTensor says which rows each rank
    holds, so ``full_tensor()`` and ``state_dict`` give back the unsharded ``[gate; up]``
    weight. ``torch.distributed.checkpoint`` (torch 2.13) refuses to save it ("overlapping
    chunks": it writes one contiguous chunk per rank): save ``full_tensor()`` instead, as
    ``hybridfp train --tp`` does for its regrouped weights. ffn_hidden_size must split evenly over the ranks, and
    each half of a rank's fc1 rows must hold whole quantization blocks.

    Parameters
    ----------
    sequence_parallel:
        The input and output are split along ``seq_dim`` across the group: the norm runs on the
        rank's rows, fc1's input is all-gathered quantized, fc2's output reduce-scattered.
    seq_dim:
        The sequence dimension (0: ``[S, B, H]``, TransformerEngine's and Megatron's layout).
    use_local_output:
        Return the local tensor (default), else a DTensor (``Shard(seq_dim)`` or ``Replicate()``).

    Raises
    ------
    TypeError
        From ``parallelize_module``: a module other than ``LayerNormMLP``.
    ValueError
        A gated activation whose ffn_hidden_size does not split evenly over the ranks.

    Example
    -------
    >>> import hybridfp as hf
    >>> hf.LayerNormMLPParallel(sequence_parallel=True).seq_dim
    0
    """

    def __init__(self, *, sequence_parallel: bool = False, seq_dim: int = 0, use_local_output: bool = True) -> None:
        super().__init__()
        self.sequence_parallel, self.seq_dim, self.use_local_output = sequence_parallel, seq_dim, use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LayerNormMLP):
            raise TypeError(f"hybridfp.LayerNormMLPParallel takes hybridfp.LayerNormMLP; got {_cls(module)}.")
        mesh = _mesh_1d(device_mesh, _who(module))
        gated = module.activation in _GATED
        fc1: Any = Shard(0)
        if gated:
            ffn = module.fc2_weight.shape[1]
            if ffn % mesh.size():
                raise ValueError(
                    f"{_who(module)}: activation={module.activation!r} is gated, so each rank holds the gate "
                    f"and the up rows of its own ffn slice; ffn_hidden_size={ffn} does not split evenly over "
                    f"{mesh.size()} tensor-parallel ranks. Choose a multiple of {mesh.size()}.")
            # [gate; up] split in two, then each half sharded: rank r holds [gate_r; up_r]
            fc1 = _StridedShard(0, split_factor=2)
        for name, placement in (("layer_norm_weight", Replicate()), ("layer_norm_bias", Replicate()),
                                ("fc1_weight", fc1), ("fc1_bias", fc1),
                                ("fc2_weight", Shard(1)), ("fc2_bias", Replicate())):
            _shard(module, name, mesh, placement, self.src_data_rank)
        seq = self.seq_dim if self.sequence_parallel else None
        return _install(module, _Plan(mesh, (COLUMN, ROW), seq, self.use_local_output, _who(module), gated))
