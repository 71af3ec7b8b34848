"""``hybridfp train --tp K`` under ``torchrun``: each block's linears split over K ranks.

The ranks form a (``dp``, ``tp``) ``DeviceMesh``: rank ``d*K + t``, each tensor-parallel group
K contiguous ranks. Every rank builds the whole model from the run's seed (the single-process
run's initial weights), then each block is parallelized with ``parallelize_module`` and
hybridfp's styles: attention's ``qkv`` (LayerNormLinear) and the MLP's ``fc`` column-parallel,
both ``proj`` row-parallel; the embedding, final norm and lm head stay whole on every rank.
An MoE layer (``--preset test-moe``, ``moe-small``) is replicated over the tensor-parallel
group: its input (the row-parallel attention output, all-reduced) is whole on every rank, and
each rank routes every token and runs every expert on the full hidden size, as one process
does, so the layer's output and gradients are one process's on the rank's rows (no expert
sharding: nothing to regroup, no collective; the experts' compute is repeated K times).

A column-parallel weight is split into K contiguous blocks of rows, but ``qkv``'s rows are
``[q | k | v]`` (and a SwiGLU ``fc``'s ``[gate | up]``): before sharding their rows are
reordered so that rank ``t``'s block holds its own heads' q, k and v (its hidden features'
gate and up), ``[q_t | k_t | v_t]``; the attention then runs ``n_head / K`` heads per rank.
A checkpoint of a ``--tp`` run stores these weights (and their AdamW moments) in one process's
row order, ``[q | k | v]`` (gathered whole to be written, regrouped and sharded when read):
it reads as any sharded run's, so it resumes at the same ``--tp`` bitwise, at another ``--tp``
or under ``--fsdp`` alone (and a ``--fsdp`` checkpoint under ``--tp``). Still refused: resuming
a sharded checkpoint in one process or a single-process checkpoint under torchrun (two file
formats; ``loop.plan_resume``), and across ``--ep`` sizes (``dist_checkpoint``).

``--quantized-weights``: a weight held quantized has its FP32 master regrouped, then the styles
shard the master (the parameter, stepped by AdamW inside ``MasterWeightOptimizer``, saved as a
high-precision ``--tp`` weight is) and each rank holds its shard's quantized copies, re-encoded
after every step; the losses are ``--tp``'s without it, bitwise. With ``--fsdp`` FSDP2 shards
each master shard over dp and each rank keeps its piece's codes (``integration.fsdp_primary``).

Delayed scaling: a rank records the amax of its shard of a weight (and of a column-parallel
output gradient) and of its rows; at the end of each forward, inside the autocast region, the
model all-reduces (MAX) its stateful quantizers' pending amaxes over every rank, so the region's
end updates every rank's scales from one process's amaxes (the tensor-parallel layers refuse
``autocast(amax_reduction_group=...)``: they reduce their split operands over the
tensor-parallel group only). A checkpoint is written after the same reduction of the last
backward's gradient amaxes, so a resumed run starts from the global ones.

The data: every rank of a tensor-parallel group reads the same rows; the global batch is split
over the ``dp`` ranks only, and the replicated weights' gradients (and the sharded weights'
local shards) are averaged over the ``dp`` group. With ``--fsdp`` each block, then the root,
is ``fully_shard``ed over the ``dp`` dimension (FSDP2's 2-D composition; its reduce-scatter
averages over dp), each rank's tensor-parallel shards all-gathered quantized over dp
(``hybridfp.enable_quantized_all_gather``: the codes and scales are the tensor-parallel layer's
own; delayed scaling is refused for a weight gathered quantized outside the tensor-parallel
layers, such as an MoE layer's experts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def check_tensor_parallel(tp: int, world: int, n_head: int, n_experts: int, fsdp: bool, ep: int) -> None:
    """Refuse a ``--tp`` the model or the launch cannot split.

    Parameters
    ----------
    tp:
        ``--tp``: the tensor-parallel group size.
    world:
        The number of ranks.
    n_head, n_experts:
        The preset's attention heads and experts per MoE layer (an MoE layer is replicated over
        the tensor-parallel group, any number of experts).
    fsdp, ep:
        ``--fsdp`` (composes: FSDP2 over the ``dp`` dimension) and ``--ep``.

    Raises
    ------
    ValueError
        ``tp`` below 1, not dividing the ranks or the heads; with ``--ep``.

    Example
    -------
    >>> from hybridfp.train.tensor_parallel import check_tensor_parallel
    >>> check_tensor_parallel(2, world=4, n_head=2, n_experts=0, fsdp=False, ep=1)
    >>> check_tensor_parallel(2, world=4, n_head=3, n_experts=0, fsdp=False, ep=1)
    Traceback (most recent call last):
    ValueError: --tp 2 does not divide the preset's 3 attention heads; each rank runs n_head / tp of them.
    """
    if tp < 1:
        raise ValueError(f"--tp must be at least 1 (the tensor-parallel group size); got {tp}.")
    if tp == 1:
        return
    if ep > 1:
        raise ValueError("--tp with --ep: a tensor-parallel MoE layer is not supported; use one of them.")
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the {world} ranks; each tensor-parallel group is "
                         "tp contiguous ranks.")
    if n_head % tp:
        raise ValueError(f"--tp {tp} does not divide the preset's {n_head} attention heads; each rank "
                         "runs n_head / tp of them.")


def group_rows(w: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """Reorder the rows of ``w`` (``parts`` stacked blocks, e.g. ``[q | k | v]``) so that its
    ``tp`` contiguous row blocks each hold their share of every part: ``[q_0 | k_0 | v_0 | q_1
    | ...]``.

    Example
    -------
    >>> import torch
    >>> from hybridfp.train.tensor_parallel import group_rows
    >>> group_rows(torch.arange(6.0).view(6, 1), parts=3, tp=2).flatten().tolist()
    [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    """
    return w.reshape(parts, tp, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def ungroup_rows(w: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """The inverse of :func:`group_rows`: ``[q_0 | k_0 | v_0 | q_1 | ...]`` back to ``[q | k | v]``.

    Parameters
    ----------
    w:
        The regrouped weight (rows first).
    parts:
        Stacked parts (3 for q, k, v).
    tp:
        Tensor-parallel ranks it was grouped for.

    Returns
    -------
    torch.Tensor
        A new tensor of ``w``'s shape, rows in the single-process order.

    Raises
    ------
    RuntimeError
        ``w``'s rows are not a multiple of ``parts * tp``.

    Example
    -------
    >>> import torch
    >>> from hybridfp.train.tensor_parallel import group_rows, ungroup_rows
    >>> w = torch.arange(12.0).view(12, 1)
    >>> torch.equal(ungroup_rows(group_rows(w, 3, 2), 3, 2), w)
    True
    """
    return w.reshape(tp, parts, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def grouped_weights(model: nn.Module) -> dict[str, int]:
    """State-dict name -> number of stacked parts, for the weights :func:`parallelize_blocks`
    regroups per rank: each block's ``attn.qkv.weight`` (3: q, k, v) and a SwiGLU MLP's
    ``mlp.fc.weight`` (2: gate, up); an MoE block's MLP is not split.

    Parameters
    ----------
    model:
        A ``hybridfp.train`` GPT (it has ``blocks``).

    Returns
    -------
    dict
        State-dict name -> parts.

    Raises
    ------
    AttributeError
        ``model`` has no ``blocks``.
    """
    from .model import MLP

    out = {}
    for i, block in enumerate(model.blocks):
        out[f"blocks.{i}.attn.qkv.weight"] = 3
        if isinstance(block.mlp, MLP) and block.mlp.kind == "swiglu":
            out[f"blocks.{i}.mlp.fc.weight"] = 2
    return out


def _tp_size(t: Any) -> int:
    names = t.device_mesh.mesh_dim_names or ()
    return t.device_mesh.size(names.index("tp")) if "tp" in names else t.device_mesh.size()


def _each_grouped(msd: dict, osd: dict, parts_of: dict[str, int]):
    """(container, key, parts) of every regrouped tensor: the weight in ``msd`` and its
    optimizer state of the same shape (AdamW's moments) in ``osd``."""
    for name, parts in parts_of.items():
        if name not in msd:
            continue
        yield msd, name, parts
        per = osd.get("state", {}).get(name)
        if per is None:
            continue
        # get_state_dict hands out the optimizer's own per-parameter dicts: replace entries in a copy,
        # or saving would swap the live moments for whole tensors in another row order
        per = osd["state"][name] = dict(per)
        for key, v in list(per.items()):
            if isinstance(v, torch.Tensor) and v.shape == msd[name].shape:
                yield per, key, parts


def to_one_process_layout(msd: dict, osd: dict, parts_of: dict[str, int]) -> None:
    """Before saving: each regrouped weight (and its optimizer state) as the single-process
    run holds it, ``[q | k | v]`` (gathered whole, then written once), in place; the
    checkpoint then reads as any other run's and reshards on load.

    Parameters
    ----------
    msd, osd:
        The model and optimizer state dicts (DTensor entries), changed in place.
    parts_of:
        From :func:`grouped_weights`.

    Returns
    -------
    None
    """
    for holder, key, parts in list(_each_grouped(msd, osd, parts_of)):
        t = holder[key]
        holder[key] = ungroup_rows(t.full_tensor(), parts, _tp_size(t))


def expect_one_process_layout(msd: dict, osd: dict, parts_of: dict[str, int]) -> list[tuple]:
    """Before loading: each regrouped entry replaced (in place) by an empty tensor of the
    whole weight, which the load fills in the single-process layout; returns what
    :func:`from_one_process_layout` needs to shard it back.

    Parameters
    ----------
    msd, osd:
        The model and optimizer state dicts (DTensor entries), changed in place.
    parts_of:
        From :func:`grouped_weights`.

    Returns
    -------
    list of tuple
        (holder, key, parts, mesh, placements) per replaced entry.
    """
    undo = []
    for holder, key, parts in list(_each_grouped(msd, osd, parts_of)):
        t = holder[key]
        undo.append((holder, key, parts, t.device_mesh, t.placements))
        holder[key] = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
    return undo


def from_one_process_layout(undo: list[tuple]) -> None:
    """After loading: each whole weight regrouped per rank and sharded as the run holds it.

    Parameters
    ----------
    undo:
        From :func:`expect_one_process_layout`, its holders now filled by the load.

    Returns
    -------
    None
    """
    from torch.distributed.tensor import distribute_tensor

    for holder, key, parts, mesh, placements in undo:
        names = mesh.mesh_dim_names or ()
        tp = mesh.size(names.index("tp")) if "tp" in names else mesh.size()
        holder[key] = distribute_tensor(group_rows(holder[key], parts, tp), mesh, placements, src_data_rank=None)


def parallelize_blocks(model: nn.Module, mesh: Any) -> None:
    """Split each block of a ``hybridfp.train`` GPT over the 1-D tensor-parallel ``mesh``
    (see the module docstring): rows regrouped, then ``parallelize_module``. A weight held
    quantized (``--quantized-weights``) becomes its FP32 master's DTensor, each rank holding the
    quantized copies of its shard (``integration/tensor_parallel_primary.py``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from ..integration.tensor_parallel import ColwiseParallel, RowwiseParallel
    from ..integration.tensor_parallel_primary import master_value, set_master_value
    from ..tensors import QuantizedTensor
    from .model import MLP

    tp = mesh.size()
    parts_of = grouped_weights(model)
    for i, block in enumerate(model.blocks):
        plan: dict[str, Any] = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
        if isinstance(block.mlp, MLP):  # an MoE layer stays whole on every rank (module docstring)
            plan.update({"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
        with torch.no_grad():
            for name in ("attn.qkv", "mlp.fc"):
                parts = parts_of.get(f"blocks.{i}.{name}.weight")
                if parts:
                    w = block.get_submodule(name).weight
                    if isinstance(w, QuantizedTensor):  # --quantized-weights: its FP32 master regrouped
                        set_master_value(w, group_rows(master_value(w), parts, tp))
                    else:
                        w.copy_(group_rows(w, parts, tp))
        parallelize_module(block, mesh, plan)
    # delayed scaling: every rank's scales from the whole tensors' amaxes (module docstring)
    model.register_forward_hook(_reduce_amaxes_after_forward)


def stateful_quantizers(model: nn.Module) -> list[Any]:
    """The quantizers of ``model``'s hybridfp modules that keep state (delayed scaling), in
    module order (the same on every rank); empty before the first quantized forward.

    Parameters
    ----------
    model:
        Any module holding hybridfp modules.

    Returns
    -------
    list
        The quantizers; empty when the recipe keeps no state.
    """
    from ..nn import QuantizedModule

    return [q for m in model.modules() if isinstance(m, QuantizedModule) for q in m.stateful_quantizers()]


def reduce_pending_amaxes_all(model: nn.Module) -> None:
    """All-reduce (MAX) over every rank the amaxes ``model``'s stateful quantizers recorded
    since their last update (a collective; nothing when the recipe keeps no state). A tensor
    -parallel rank sees a shard of a weight and of a column-parallel output gradient, a
    data-parallel rank its rows: the maximum over all ranks is the amax of the whole tensor,
    one process's. Reducing early changes nothing later: a MAX reduction of maxima.

    Parameters
    ----------
    model:
        The module whose stateful quantizers to reduce; every rank calls this.

    Returns
    -------
    None

    Raises
    ------
    RuntimeError
        The default process group is not initialized while a quantizer keeps state.
    """
    from ..quantizers.base import reduce_pending_amaxes

    qs = stateful_quantizers(model)
    if qs:
        reduce_pending_amaxes(qs, dist.group.WORLD)


def _reduce_amaxes_after_forward(model: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of a tensor-parallel GPT: inside the autocast region, before its end
    updates the scales (``hybridfp.autocast``'s own ``amax_reduction_group`` is refused by the
    tensor-parallel layers, which reduce their split operands over the tensor-parallel group
    only)."""
    from ..recipes import current_autocast

    if current_autocast() is not None:
        reduce_pending_amaxes_all(model)


def local_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient's tensor on this rank (a DTensor's local shard)."""
    return g.to_local() if hasattr(g, "to_local") else g


def grad_norm_tp(params: list[nn.Parameter], mesh: Any) -> torch.Tensor:
    """The global gradient norm of a tensor-parallel model on the (``dp``, ``tp``) ``mesh``:
    each gradient's squared norm summed over the mesh dimensions it is sharded along (``tp``
    for a tensor-parallel shard, ``dp`` too under FSDP2, both: every rank), a replicated one's
    counted once (the same on every rank)."""
    sums: dict[tuple[str, ...], torch.Tensor] = {}
    for p in params:
        g = p.grad
        dims: tuple[str, ...] = ()
        if hasattr(g, "placements"):
            names = g.device_mesh.mesh_dim_names or ()
            dims = tuple(sorted(n for n, pl in zip(names, g.placements) if pl.is_shard()))
        sq = local_grad(g).float().pow(2).sum()
        sums[dims] = sums[dims] + sq if dims in sums else sq
    total = torch.zeros((), dtype=torch.float32, device=params[0].grad.device)
    for dims, sq in sums.items():
        if dims:
            dist.all_reduce(sq, group=mesh.get_group(dims[0]) if len(dims) == 1 else dist.group.WORLD)
        total = total + sq
    return total.sqrt()


__all__ = ["check_tensor_parallel", "expect_one_process_layout", "from_one_process_layout", "grad_norm_tp",
           "group_rows", "grouped_weights", "local_grad", "parallelize_blocks", "reduce_pending_amaxes_all",
           "stateful_quantizers", "to_one_process_layout", "ungroup_rows"]
