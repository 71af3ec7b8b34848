"""``hybridfp train --fsdp [--ep K]`` under ``torchrun``: one run spread over processes.

Every rank builds the whole model from the run's seed (the single-process run's initial
weights), then:

- ``--fsdp``: ``hybridfp.enable_quantized_all_gather`` (``copies="both"`` for blocks under
  ``--recompute`` and for the root's own hybridfp weights, which FSDP2 keeps gathered from
  forward to backward), ``fully_shard`` on each block, then on the root;
- ``--ep K``: each MoE layer keeps experts ``e*L .. e*L+L-1`` of its ``n_experts`` (``L =
  n_experts / K``, ``e`` the rank's place in its expert-parallel group of K contiguous ranks)
  and runs them through :class:`hybridfp.ExpertParallel`; with ``--quantized-weights`` it keeps
  their quantized parameters themselves (FP32 masters seeded from their kept initial values, as
  in one process), which ``--fsdp`` then shards as quantized primary weights over the replicas.

The data: ``batch_size`` is global; rank ``r`` of ``W`` trains rows ``r*B/W .. (r+1)*B/W - 1``
of the single-process run's batch, so the ranks together see its tokens. The objective is the
mean of the ranks' losses (equal row counts: the global mean): FSDP2 averages the shared
weights' gradients over the ranks; an expert's gradient already sums the losses of the K ranks
whose rows it read, so it is summed over its replicas and divided by W. The MoE load-balancing
loss counts the routed rows over every rank (as one process counts the whole batch).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

#: torchrun's variables that say where a process is.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Parallel:
    """How one run is spread over the processes of a ``torchrun`` launch.

    Parameters
    ----------
    rank, world:
        This process's rank and the number of processes.
    device:
        This rank's device (``cuda:<LOCAL_RANK>`` for a CUDA run).
    fsdp:
        The model is sharded with FSDP2 over every rank.
    ep:
        Expert-parallel group size (1: every rank holds every expert).
    ep_mesh:
        The 2-D ``DeviceMesh`` (``dp``, ``ep``) when ``ep > 1``: rank ``d*ep + e``.
    tp:
        Tensor-parallel group size (1: none); see ``tensor_parallel.py``.
    tp_mesh:
        The 2-D ``DeviceMesh`` (``dp``, ``tp``) when ``tp > 1``: rank ``d*tp + t``.

    Example
    -------
    >>> from hybridfp.train.distributed import Parallel
    >>> par = Parallel(rank=1, world=4, device="cpu", fsdp=True)
    >>> par.rows(16), par.is_main                  # rank 1's rows of a global batch of 16
    (slice(4, 8, None), False)
    """

    rank: int
    world: int
    device: str
    fsdp: bool
    ep: int = 1
    ep_mesh: Optional[Any] = None
    tp: int = 1
    tp_mesh: Optional[Any] = None

    @property
    def dp(self) -> int:
        """The data-parallel ranks: each reads its own rows (a tensor-parallel group shares them)."""
        return self.world // self.tp

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes metrics, logs, plots and the summary."""
        return self.rank == 0

    @property
    def group(self) -> dist.ProcessGroup:
        """The group the data (and a delayed-scaling amax) is spread over: every rank, or under
        ``--tp`` the ranks at this rank's place in their tensor-parallel groups."""
        return self.tp_mesh.get_group("dp") if self.tp_mesh is not None else dist.group.WORLD

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        """The expert-parallel group of K contiguous ranks (None without ``--ep``)."""
        return self.ep_mesh.get_group("ep") if self.ep_mesh is not None else None

    @property
    def expert_replica_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding the same experts (one per expert-parallel group)."""
        return self.ep_mesh.get_group("dp") if self.ep_mesh is not None else None

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of ``batch_size`` rows."""
        per, d = batch_size // self.dp, self.rank // self.tp
        return slice(d * per, (d + 1) * per)


def check_parallel_args(fsdp: bool, ep: int, quantized_weights: bool, jobs: int, tp: int = 1) -> None:
    """Refuse option combinations a sharded run does not support.

    Raises
    ------
    ValueError
        ``--tp`` or ``--ep`` below 1, ``--jobs`` above 1 with ``--fsdp`` / ``--ep`` / ``--tp``.
    """
    if tp < 1:
        raise ValueError(f"--tp must be at least 1 (the tensor-parallel group size); got {tp}.")
    if tp > 1 and jobs > 1:
        raise ValueError("--jobs with --tp: a sharded run trains its recipes one after the other over "
                         "all its ranks; drop --jobs.")
    if ep < 1:
        raise ValueError(f"--ep must be at least 1 (the expert-parallel group size); got {ep}.")
    if (fsdp or ep > 1) and jobs > 1:
        raise ValueError("--jobs with --fsdp / --ep: a sharded run trains its recipes one after the "
                         "other over all its ranks; drop --jobs.")


def init_parallel(device: str, fsdp: bool, ep: int, n_experts: int, tp: int = 1, n_head: int = 1) -> Parallel:
    """Join the process group ``torchrun`` set up (gloo on the CPU, NCCL on CUDA).

    Parameters
    ----------
    device:
        The run's ``--device`` (``cpu`` or ``cuda``; a CUDA rank takes GPU ``LOCAL_RANK``).
    fsdp, ep, tp:
        ``--fsdp``, ``--ep`` and ``--tp``.
    n_experts, n_head:
        The preset's experts per MoE layer (0: dense) and attention heads.

    Returns
    -------
    Parallel

    Raises
    ------
    ValueError
        Not started by ``torchrun`` (its variables missing); ``--ep`` on a dense preset, not
        dividing the world size or the experts; ``--tp`` as
        :func:`~hybridfp.train.tensor_parallel.check_tensor_parallel` refuses it.
    """
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(f"--fsdp / --ep / --tp run one process per rank: start it with torchrun (e.g. "
                         f"torchrun --nproc-per-node 2 -m hybridfp.train --fsdp ...); "
                         f"{', '.join(missing)} not set.")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    from .tensor_parallel import check_tensor_parallel
    check_tensor_parallel(tp, world, n_head, n_experts, fsdp, ep)
    if ep > 1:
        if not n_experts:
            raise ValueError(f"--ep {ep}: the preset is dense (no experts); use an MoE preset "
                             "(tiny-moe, moe-small) or drop --ep.")
        if world % ep:
            raise ValueError(f"--ep {ep} does not divide the {world} ranks; each expert-parallel "
                             "group is ep contiguous ranks.")
        if n_experts % ep:
            raise ValueError(f"--ep {ep} does not divide the preset's {n_experts} experts; each rank "
                             "holds n_experts / ep of them.")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    mesh = None
    if ep > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    tp_mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        tp_mesh = init_device_mesh("cuda" if cuda else "cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return Parallel(rank=rank, world=world, device=device, fsdp=fsdp, ep=ep, ep_mesh=mesh, tp=tp, tp_mesh=tp_mesh)


def check_batch(batch_size: int, par: Parallel) -> None:
    """The global batch splits into equal parts, one per rank.

    Raises
    ------
    ValueError
        ``batch_size`` is not a multiple of the world size.

    Example
    -------
    >>> from hybridfp.train.distributed import Parallel, check_batch
    >>> check_batch(16, Parallel(rank=0, world=4, device="cpu", fsdp=True))   # 4 rows per rank
    >>> check_batch(6, Parallel(rank=0, world=4, device="cpu", fsdp=True))
    Traceback (most recent call last):
    ValueError: --batch-size 6 is the global batch: it must be a multiple of the 4 ranks (each reads batch_size / world rows).
    """
    if batch_size % par.dp:
        who = f"{par.world} ranks" if par.tp == 1 else f"{par.dp} data-parallel ranks (world / tp)"
        raise ValueError(f"--batch-size {batch_size} is the global batch: it must be a multiple of the "
                         f"{who} (each reads batch_size / {'world' if par.tp == 1 else 'dp'} rows).")


def _quantized_gather_modules(model: nn.Module, recipe: Any) -> list[nn.Module]:
    """The hybridfp modules of ``model`` whose weight ``recipe`` quantizes (not Identity): their
    all-gather sends codes; an unquantized weight travels as FSDP2's plain all-gather sends it."""
    from ..nn import QuantizedModule
    from ..quantizers import IdentityQuantizer
    from ..recipes import AutocastState

    state = AutocastState(recipe)
    return [m for m in model.modules() if isinstance(m, QuantizedModule) and m.quantized_weight_slots
            and any(not isinstance(q, IdentityQuantizer) for q in m.quantizers(state)["weight"])]


def _refuse_stateful_weights(model: nn.Module, recipe: Any) -> None:
    """``--tp --fsdp``: refuse a recipe whose quantizer keeps an amax history (delayed scaling)
    for a weight gathered quantized that is not tensor-parallel (an MoE layer's experts, a
    quantized lm head): its gather needs ``autocast(amax_reduction_group=...)``, which the
    tensor-parallel layers refuse. A tensor-parallel weight's pending amax is reduced over every
    rank by the model's forward hook, as under ``--tp`` alone."""
    from ..recipes import AutocastState

    state = AutocastState(recipe)
    for m in _quantized_gather_modules(model, recipe):
        if getattr(m, "_tensor_parallel", None) is None and any(q.has_state() for q in m.quantizers(state)["weight"]):
            raise ValueError(
                f"--tp --fsdp with a delayed-scaling recipe: {type(m).__name__} {getattr(m, 'name', '')} is not "
                "tensor-parallel (an MoE layer's experts, a quantized lm head); FSDP2 all-gathers its weight "
                "quantized, and a scale from an amax history then needs the region's amax_reduction_group, "
                "which the tensor-parallel layers refuse. Use a current-scaling or block recipe (fp8, mxfp8, "
                "nvfp4, ...), or drop --fsdp or --tp.")


def shard_model(model: nn.Module, par: Parallel, recipe: Any) -> None:
    """Spread ``model`` (a ``hybridfp.train`` GPT, the whole model on every rank) over the ranks:
    experts over the expert-parallel group (``--ep``), weights sharded by FSDP2 (``--fsdp``).

    Parameters
    ----------
    model:
        The GPT, built from the run's seed on every rank.
    par:
        The run's :class:`Parallel`.
    recipe:
        The run's recipe: the weights it quantizes are all-gathered quantized.
    """
    from ..integration.fsdp import enable_quantized_all_gather
    from .moe import MoE

    if par.tp > 1:
        from .tensor_parallel import parallelize_blocks
        parallelize_blocks(model, par.tp_mesh["tp"])
        if par.fsdp:
            _refuse_stateful_weights(model, recipe)
    moes = [b.mlp for b in model.blocks if isinstance(b.mlp, MoE)]
    for moe in moes:
        moe.stats_group = par.group  # the load-balancing loss counts every rank's rows
        if par.ep > 1:
            moe.use_expert_parallel(par.ep_mesh)
    if not par.fsdp:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    blocks = {id(m) for b in model.blocks for m in b.modules()}
    from ..integration.tensor_parallel_primary import is_tensor_parallel_primary
    from ..tensors import QuantizedTensor
    # --quantized-weights: every weight held quantized becomes a sharded quantized primary weight
    # (under --tp, a tensor-parallel one: its tp shard's FP32 master sharded over dp, each
    # (dp, tp) rank keeping its piece's codes, encoded with the whole weight's amax)
    held = [m for m in model.modules()
            if any(isinstance(getattr(m, a, None), QuantizedTensor) or is_tensor_parallel_primary(getattr(m, a, None))
                   for a, _ in getattr(m, "quantized_weight_slots", ()))]
    gathered = _quantized_gather_modules(model, recipe)
    for m in gathered + [m for m in held if all(m is not g for g in gathered)]:
        # Both copies in one gather where the module reads the forward's copy after backward's
        # gather (a block recomputed in backward) or is gathered once for both passes (the
        # root's own weights: the lm head, FSDP2 keeps them from forward to backward).
        both = (model.recompute and id(m) in blocks) or id(m) not in blocks
        enable_quantized_all_gather(m, copies="both" if both else "per_direction")
    if par.tp > 1:  # 2-D: FSDP2 over the dp ranks of the tensor-parallel DTensors
        # each rank's tensor-parallel shard is gathered quantized over dp, as --fsdp gathers a
        # whole weight; its scale is the tensor-parallel layer's
        for block in model.blocks:
            fully_shard(block, mesh=par.tp_mesh["dp"])
        fully_shard(model, mesh=par.tp_mesh["dp"])
        return
    mesh = init_device_mesh(torch.device(par.device).type, (par.world,))
    for moe in moes:
        if moe.expert_parallel is not None:  # sharded over the ranks holding the same experts
            fully_shard(moe.expert_parallel.experts, mesh=par.ep_mesh["dp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def weight_amax_precompute(model: nn.Module, par: Optional[Parallel], recipe: Any) -> int:
    """The weights gathered quantized whose format has a per-tensor scale (FP8 current scaling,
    NVFP4): after each optimizer step the loop calls ``hybridfp.precompute_weight_amax`` when
    this is nonzero, so their gathers all-reduce no amax (one collective per step for all).

    Parameters
    ----------
    model:
        The model after :func:`shard_model`.
    par:
        The run's :class:`Parallel` (None: a single process).
    recipe:
        The run's recipe.

    Returns
    -------
    int
        The number of such weights (0 without ``--fsdp``).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.train.distributed import weight_amax_precompute
    >>> weight_amax_precompute(torch.nn.Linear(4, 4), None, hf.Float8CurrentScaling())  # one process
    0
    """
    if par is None or not par.fsdp:
        return 0
    from ..integration.fsdp import QuantizedGatherWeight
    from ..integration.fsdp_amax import reads_weight_amax
    from ..integration.fsdp_primary import QuantizedPrimaryWeight
    from ..recipes import AutocastState

    state, n = AutocastState(recipe), 0
    for m in _quantized_gather_modules(model, recipe):
        for attr, index in m.quantized_weight_slots:
            w = getattr(m, attr)
            local = getattr(w, "_local_tensor", w)
            # a quantized primary weight's amax is reduced when it is encoded (once a step)
            if (isinstance(local, QuantizedGatherWeight) and not isinstance(local, QuantizedPrimaryWeight)
                    and reads_weight_amax(m.quantizers(state)["weight"][index])):
                n += 1
    return n


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts spread by ``--ep`` (empty without it)."""
    from .moe import MoE

    return [p for m in model.modules() if isinstance(m, MoE) and m.expert_parallel is not None
            for p in m.expert_parallel.parameters()]


def sync_gradients(model: nn.Module, par: Parallel) -> None:
    """Finish the gradients of a step: the replicated weights' averaged over every rank, each
    expert's summed over its replicas and divided by every rank (see the module docstring).

    Under ``--fsdp`` FSDP2's reduce-scatters have averaged them over their meshes: the experts'
    over their ``world / ep`` replicas, so they are divided by ``ep`` here (FSDP2's own
    ``set_gradient_divide_factor`` reduces with PREMUL_SUM, which gloo lacks). Without it (``--ep``
    alone) they are all-reduced here."""
    if par.world == 1:
        return
    if par.fsdp:
        for p in expert_parameters(model):
            if p.grad is not None:
                p.grad.div_(par.ep)
        return
    if par.tp > 1 and not par.fsdp:  # the tp ranks share their rows: average over the dp ranks
        from .tensor_parallel import local_grad
        for p in model.parameters():
            if p.grad is not None and par.dp > 1:
                g = local_grad(p.grad)
                dist.all_reduce(g, group=par.group)
                g.div_(par.dp)
        return
    experts = {id(p) for p in expert_parameters(model)}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in experts:
            dist.all_reduce(p.grad, group=par.group)
        elif par.expert_replica_group is not None and par.world > par.ep:
            dist.all_reduce(p.grad, group=par.expert_replica_group)
        p.grad.div_(par.world)


@contextmanager
def masters_in_place(model: nn.Module, opt: Any) -> Iterator[Any]:
    """For a sharded checkpoint of a run whose quantized weights have separate FP32 masters
    (``--ep`` with ``--quantized-weights``): inside, each such weight's slot in ``model`` holds
    its master (the ``MasterWeightOptimizer``'s parameter), so ``get_state_dict`` /
    ``set_state_dict`` see the FP32 values the optimizer steps under the weight's own name.
    The quantized parameters come back on exit; after a load, re-quantize them from the loaded
    masters (``hybridfp.quantize_master_weights``).

    Parameters
    ----------
    model:
        The sharded model.
    opt:
        Its optimizer (a ``MasterWeightOptimizer`` or a torch optimizer).

    Yields
    ------
    torch.optim.Optimizer
        The torch optimizer DCP reads (a ``MasterWeightOptimizer``'s own).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.train.distributed import masters_in_place
    >>> with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling(), preserve_high_precision_init_val=True):
    ...     lin = hf.Linear(32, 32, bias=False)
    >>> opt = hf.MasterWeightOptimizer(torch.optim.AdamW, lin.parameters(), lr=1e-3)
    >>> with masters_in_place(lin, opt) as torch_opt:
    ...     lin.weight.dtype, torch_opt is opt.optimizer
    (torch.float32, True)
    >>> type(lin.weight).__name__
    'QuantizedTensor'
    """
    from ..integration.master_weights import MasterWeightOptimizer

    if not isinstance(opt, MasterWeightOptimizer):
        yield opt
        return
    masters = {id(p): m for p, m in zip(opt.model_params, opt.master_params) if m is not None}
    swapped = [(mod, name, p) for mod in model.modules() for name, p in list(mod._parameters.items())
               if p is not None and id(p) in masters]
    for mod, name, p in swapped:
        mod._parameters[name] = masters[id(p)]
    try:
        yield opt.optimizer
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


def clip_grad_norm(model: nn.Module, max_norm: float, par: Optional[Parallel]) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients, wherever they live;
    returns the norm before clipping (the same on every rank).

    One process: torch's own. FSDP2 shards: their norm is a DTensor, made whole. Experts spread
    by ``--ep``: their squared norms are summed over the expert-parallel group (each rank
    holds other experts) and added to the replicated weights'.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if par is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if par.tp > 1:  # DTensors of the tp mesh and plain tensors: torch's foreach norm takes one kind
        from .tensor_parallel import grad_norm_tp, local_grad
        norm = grad_norm_tp(params, par.tp_mesh)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch's clip_grads_with_norm_
        for p in params:
            local_grad(p.grad).mul_(coef.to(p.grad.dtype))
        return norm
    experts = {id(p) for p in expert_parameters(model)}
    shared_p = [p for p in params if id(p) not in experts]
    expert_p = [p for p in params if id(p) in experts]
    shared, mine = [p.grad for p in shared_p], [p.grad for p in expert_p]
    norm = torch.nn.utils.get_total_norm(shared)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if mine:
        sq = torch.nn.utils.get_total_norm(mine)
        sq = (sq.full_tensor() if hasattr(sq, "full_tensor") else sq) ** 2
        dist.all_reduce(sq, group=par.ep_group)
        norm = (norm ** 2 + sq).sqrt()
    for part in (shared_p, expert_p):  # apart: foreach ops take DTensors of one mesh only
        if part:
            torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)
    return norm


def mean_over_ranks(value: torch.Tensor, par: Optional[Parallel]) -> float:
    """The mean over the ranks of a scalar each rank computed on its rows (the global mean:
    the ranks hold equal row counts)."""
    if par is None or par.world == 1:
        return value.item()
    t = value.detach().float().reshape(1).clone()
    dist.all_reduce(t, group=par.group)
    return (t / par.dp).item()


def all_true(flag: bool, par: Optional[Parallel]) -> bool:
    """Whether ``flag`` holds on every rank (a collective: every rank calls it)."""
    if par is None or par.world == 1:
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int64, device=par.device)
    dist.all_reduce(t, group=par.group)
    return int(t.item()) == 0


def barrier(par: Optional[Parallel]) -> None:
    """Wait for every rank (no-op in one process)."""
    if par is not None and par.world > 1:
        dist.barrier()


def finish(par: Optional[Parallel]) -> None:
    """Leave the process group (end of a ``torchrun`` run)."""
    if par is not None and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["Parallel", "TORCHRUN_ENV", "all_true", "barrier", "check_batch", "check_parallel_args",
           "clip_grad_norm", "expert_parameters", "finish", "init_parallel", "masters_in_place", "mean_over_ranks", "shard_model", "sync_gradients"]
