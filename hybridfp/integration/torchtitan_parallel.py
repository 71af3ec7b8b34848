"""torchtitan's tensor parallelism on hybridfp's converted ``Linear``.

torchtitan (>= 0.3.0) parallelizes a model with ``Model.parallelize(parallel_dims)``: each
module's ``sharding_config`` (set by the model's ``set_*_sharding_config``) says how its weight
is placed on the ``tp`` mesh axis (``Shard(0)``: column-parallel, ``Shard(1)``: row-parallel)
and how its output is redistributed. torch's DTensor GEMM would multiply the high-precision
shards; hybridfp's modules quantize their operands themselves, so a converted ``Linear`` reads
its stock sharding and applies hybridfp's own :class:`~hybridfp.ColwiseParallel` /
:class:`~hybridfp.RowwiseParallel` on the ``tp`` mesh instead (as torchtitan's float8 path
applies torchao's ``Float8ColwiseParallel``): the weight becomes the same DTensor torchtitan
would make, each rank runs the module's quantized GEMM on its shard with the split operands'
amaxes reduced over the group, and the output is the DTensor torchtitan's next module expects
(column-parallel: ``Shard(-1)``; row-parallel: all-reduced ``Replicate()``). torchtitan's
sequence parallelism is refused (not supported yet), naming its option.

Only the ``partial_dtensor`` backend (DTensors on the ``tp`` / ``ep`` axes) is supported;
torchtitan's ``spmd_types`` / ``full_dtensor`` backends are refused, naming the option.
"""

from __future__ import annotations

from typing import Any

from .tensor_parallel import ColwiseParallel, RowwiseParallel

#: torchtitan's ``parallelism.spmd_backend`` values whose TP this module composes with.
SUPPORTED_BACKENDS = ("partial_dtensor",)


def _tp_type(layout: Any) -> Any:
    """The ``tp`` axis entry of a torchtitan ``SpmdLayout`` (None when it declares none)."""
    if layout is None:
        return None
    from torchtitan.distributed.parallel_dims import MeshAxisName
    return layout.per_axis_spmd_types().get(MeshAxisName.TP)


def _shard_dim(spmd_type: Any) -> Any:
    """``Shard(d)``'s d for a torchtitan / spmd_types per-axis type, else None."""
    import spmd_types as spmd
    return spmd_type.dim if isinstance(spmd_type, spmd.Shard) else None


def refuse_backend(who: str, parallel_dims: Any, what: str) -> None:
    """Refuse a torchtitan ``spmd_backend`` whose sharded tensors hybridfp cannot read.

    Parameters
    ----------
    who:
        The module, for the message.
    parallel_dims:
        torchtitan's ``ParallelDims``.
    what:
        The parallelism (``"TP"``, ``"EP"``), for the message.

    Raises
    ------
    NotImplementedError
        ``parallel_dims.spmd_backend`` is not one of :data:`SUPPORTED_BACKENDS`.

    Example
    -------
    >>> from types import SimpleNamespace
    >>> from hybridfp.integration.torchtitan_parallel import refuse_backend
    >>> refuse_backend("wo", SimpleNamespace(spmd_backend="partial_dtensor"), "TP")  # accepted
    >>> try:
    ...     refuse_backend("wo", SimpleNamespace(spmd_backend="spmd_types"), "TP")
    ... except NotImplementedError as e:
    ...     print(str(e)[:62])
    wo: torchtitan's TP with parallelism.spmd_backend='spmd_types'
    """
    backend = getattr(parallel_dims, "spmd_backend", None)
    if backend not in SUPPORTED_BACKENDS:
        raise NotImplementedError(
            f"{who}: torchtitan's {what} with parallelism.spmd_backend={backend!r} is not supported "
            f"by hybridfp's torchtitan converter (its modules run their quantized GEMMs on DTensor "
            f"shards); set parallelism.spmd_backend='partial_dtensor', or keep these modules in high "
            f"precision with the converter's filter_fqns.")


def tensor_parallel_style(module: Any, who: str) -> Any:
    """hybridfp's parallel style for a converted torchtitan ``Linear`` from its stock
    ``sharding_config`` (torchtitan's ``colwise_config`` / ``rowwise_config``).

    Parameters
    ----------
    module:
        A converted ``Linear`` built from a config with ``sharding_config`` set.
    who:
        The module, for messages.

    Returns
    -------
    ColwiseParallel or RowwiseParallel
        Output as a DTensor (``use_local_output=False``), placed as torchtitan's stock
        redistribution would leave it.

    Raises
    ------
    NotImplementedError
        A placement hybridfp's styles do not take (a replicated weight under TP, a column-parallel
        output redistributed, a row-parallel output other than replicated (sequence parallelism).

    Example
    -------
    >>> from types import SimpleNamespace
    >>> from torchtitan.models.common.decoder_sharding import colwise_config, rowwise_config
    >>> from hybridfp.integration.torchtitan_parallel import tensor_parallel_style
    >>> type(tensor_parallel_style(SimpleNamespace(_sharding_config=colwise_config()), "w1")).__name__
    'ColwiseParallel'
    >>> type(tensor_parallel_style(SimpleNamespace(_sharding_config=rowwise_config()), "wo")).__name__
    'RowwiseParallel'
    """
    sc = module._sharding_config
    inputs = {**(sc.in_src_shardings or {}), **(sc.in_dst_shardings or {})}
    sharded_in = {k: _tp_type(v) for k, v in inputs.items() if _shard_dim(_tp_type(v)) is not None}
    weight = _shard_dim(_tp_type(sc.state_shardings.get("weight")))
    if weight == 0:
        if sharded_in:  # torchtitan's stock colwise_config declares none: its input is whole
            raise NotImplementedError(f"{who}: a column-parallel Linear whose sharding_config declares a "
                                      f"tp-sharded input {sharded_in} is not supported.")
        out_dst = _tp_type(sc.out_dst_shardings)
        if out_dst is not None and _shard_dim(out_dst) != -1:
            raise NotImplementedError(f"{who}: a column-parallel Linear whose output is redistributed "
                                      f"to {out_dst} on the tp axis is not supported.")
        return ColwiseParallel(use_local_output=False)
    if weight == 1:
        out_dst = _tp_type(sc.out_dst_shardings)
        seq = _shard_dim(out_dst)
        import spmd_types as spmd
        if seq is None and out_dst is not None and out_dst not in (spmd.R, spmd.I):
            raise NotImplementedError(f"{who}: a row-parallel Linear whose output stays {out_dst} on the "
                                      "tp axis is not supported (hybridfp all-reduces it: Replicate).")
        if seq is None and out_dst is None:
            raise NotImplementedError(f"{who}: a row-parallel Linear without an output redistribution "
                                      "(partial sums left to a later module) is not supported.")
        if seq is not None:
            raise NotImplementedError(
                f"{who}: torchtitan's sequence parallelism (a row-parallel output reduce-scattered "
                f"along dim {seq}) is not supported by hybridfp's torchtitan converter yet; set "
                "parallelism.enable_sequence_parallel=False.")
        return RowwiseParallel(use_local_output=False)
    raise NotImplementedError(
        f"{who}: its sharding_config places the weight {_tp_type(sc.state_shardings.get('weight'))} on "
        "the tp axis; hybridfp's tensor parallelism takes Shard(0) (column-) or Shard(1) (row-parallel). "
        "Keep this module in high precision with the converter's filter_fqns.")


def parallelize_linear(module: Any, parallel_dims: Any, module_base: type) -> None:
    """torchtitan's ``Module.parallelize`` for a converted ``Linear``: without TP (or without a
    ``sharding_config``) torchtitan's own; with TP, hybridfp's style on the ``tp`` mesh.

    Parameters
    ----------
    module:
        The converted ``Linear`` (a torchtitan ``Module``).
    parallel_dims:
        torchtitan's ``ParallelDims``.
    module_base:
        torchtitan's ``Module`` class (its ``parallelize``).

    Raises
    ------
    NotImplementedError
        TP under another ``spmd_backend``, or a placement hybridfp's styles do not take.
    ValueError
        The module was parallelized before.

    Example
    -------
    >>> from types import SimpleNamespace
    >>> from hybridfp.integration.torchtitan_parallel import parallelize_linear
    >>> class Base:  # stands for torchtitan's Module
    ...     @staticmethod
    ...     def parallelize(module, dims):
    ...         print("torchtitan's own parallelize")
    >>> parallelize_linear(SimpleNamespace(_sharding_config=None), SimpleNamespace(tp_enabled=False), Base)
    torchtitan's own parallelize
    """
    if not getattr(parallel_dims, "tp_enabled", False) or module._sharding_config is None:
        module_base.parallelize(module, parallel_dims)
        return
    who = f"hybridfp Linear {module.name!r}"
    refuse_backend(who, parallel_dims, "TP")
    if module._parallelized:
        raise ValueError(f"{who} has already been parallelized (Module.parallelize runs once).")
    style = tensor_parallel_style(module, who)
    module._parallelized = True
    style._apply(module, parallel_dims.get_mesh("tp"))
