"""FP32 master weights for quantized primary weights (``hybridfp.quantized_model_init``).

The optimizer steps FP32 copies (the masters) and holds its state for them; after each step
every quantized parameter is re-quantized in place from its master by its own quantizer (the
module's weight quantizer), so the weight the GEMMs read is the same function of the same FP32
value as in a run whose weights are FP32 parameters: bitwise the same training.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ..moe.primary_group import owner_of, requantize_primary
from ..tensors import QuantizedTensor


def quantize_master_weights(model_params: Iterable[torch.Tensor], master_params: Iterable[Optional[torch.Tensor]]) -> None:
    """Re-quantize each quantized parameter in place from its FP32 master (TransformerEngine's name).

    Each ``QuantizedTensor`` in ``model_params`` takes the value of the master at the same
    position, encoded by the parameter's quantizer into the copies it holds (its buffers keep
    their addresses). The experts of a ``GroupedLinear`` held as one joined encoding, all given
    with masters, are re-encoded together: one grouped encode, bitwise each one's own. Plain
    parameters and None masters are skipped. A tensor-parallel quantized
    primary weight (its parameter is its FP32 master shard) has its quantized shard re-encoded
    from it (``hybridfp.quantize_tensor_parallel_weights``: a collective over its group).

    A parameter that keeps its initial value (``quantized_model_init(preserve_high_precision
    _init_val=True)``) keeps the master's value instead (a copy in the parameter's dtype on the
    CPU, where the kept value is held): a ``MasterWeightOptimizer`` built afterwards seeds its
    master with the value written, not with the initial one. A parameter keeping none is left
    so (no copy is made).

    Parameters
    ----------
    model_params:
        The model's parameters (quantized or not).
    master_params:
        Their high-precision masters, in the same order (None: no master).

    Raises
    ------
    ValueError
        The two sequences differ in length, or a master's shape differs from its parameter's.
    RuntimeError
        A quantized parameter without a quantizer (set one with ``param.set_quantizer``).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling()):
    ...     lin = hf.Linear(32, 32)
    >>> master = torch.ones(32, 32)
    >>> hf.quantize_master_weights([lin.weight], [master])
    >>> lin.weight.dequantize().unique().tolist()
    [1.0]
    """
    model_params, master_params = list(model_params), list(master_params)
    if len(model_params) != len(master_params):
        raise ValueError(f"quantize_master_weights: {len(model_params)} model parameters but "
                         f"{len(master_params)} master parameters; pass one master (or None) per parameter.")
    with torch.no_grad():
        done = _requantize_joined(model_params, master_params)
        for i, (p, m) in enumerate(zip(model_params, master_params)):
            if m is None or not isinstance(p, QuantizedTensor):
                continue
            if id(p) in done:
                _keep_master_value(p, m)
                continue
            if tuple(m.shape) != tuple(p.shape):
                raise ValueError(f"quantize_master_weights: master {i} has shape {tuple(m.shape)}, its "
                                 f"parameter {p.qstorage.describe()}.")
            if p.quantizer is None:
                raise RuntimeError(f"quantize_master_weights: parameter {i} ({p.qstorage.describe()}) has "
                                   "no quantizer; call param.set_quantizer(q), or run one forward first.")
            p.quantizer.update_quantized(m.detach(), p, directions=p.directions())
            _keep_master_value(p, m)
    # tensor parallelism: the parameter is the FP32 master shard; its quantized shard re-encoded
    from .tensor_parallel_primary import quantize_tensor_parallel_weights
    quantize_tensor_parallel_weights(model_params)


def _keep_master_value(p: QuantizedTensor, m: torch.Tensor) -> None:
    """Quantized ``p``, just re-encoded from master ``m``: a kept initial value becomes ``m``'s
    value, the one its copies now encode (in ``p``'s dtype, on the CPU, as an in-place write
    through ``__torch_dispatch__`` keeps it); none kept, none made (a copy to the CPU a step
    would cost)."""
    if p.get_high_precision_init_val() is not None:
        p.__dict__["_high_precision_init_val"] = m.detach().to("cpu", dtype=p.dtype, copy=True)


def _requantize_joined(model_params: list[torch.Tensor], master_params: list[Optional[torch.Tensor]]) -> set[int]:
    """Re-encode every ``GroupedLinear`` whose experts' quantized weights are held joined
    (``moe.primary_group``) and all present with masters, in one grouped encode each; the ids of
    the parameters written (the others are re-encoded one by one)."""
    experts: dict[int, tuple[Any, dict[int, torch.Tensor]]] = {}
    for p, m in zip(model_params, master_params):
        if m is None or not isinstance(p, QuantizedTensor):
            continue
        found = owner_of(p)
        if found is not None:
            module, i = found
            experts.setdefault(id(module), (module, {}))[1][i] = m
    done: set[int] = set()
    for module, masters in experts.values():
        group = module._primary
        if len(masters) == len(group.params) and requantize_primary(group, [masters[i] for i in range(len(masters))]):
            done.update(id(p) for p in group.params)
    return done


def _packed_masters(model_params: list[torch.Tensor]) -> dict[int, nn.Parameter]:
    """The FP32 masters of every ``GroupedLinear`` whose experts' quantized weights are joined
    and all in ``model_params``, by id of the model parameter: one [E, N, K] buffer a layer, each
    master a Parameter viewing its row, filled with the value ``_master_of`` would give. The
    layer's re-encode then reads them as they lie (``requantize_primary``) instead of stacking
    them (8 bytes an element moved and 4 held a step)."""
    found: dict[int, tuple[Any, dict[int, torch.Tensor]]] = {}
    for p in model_params:
        hit = owner_of(p) if isinstance(p, QuantizedTensor) else None
        if hit is not None:
            found.setdefault(id(hit[0]), (hit[0], {}))[1][hit[1]] = p
    out: dict[int, nn.Parameter] = {}
    for module, experts in found.values():
        n = len(module._primary.params)
        if len(experts) != n:
            continue  # some experts elsewhere: their re-encode goes per expert anyway
        first = experts[0]
        buf = torch.empty((n, *first.shape), dtype=torch.float32, device=first.device)
        with torch.no_grad():
            for i, row in enumerate(buf.unbind(0)):
                row.copy_(_master_value(experts[i]))
                out[id(experts[i])] = nn.Parameter(row)  # a view of buf: the optimizer steps it in place
    return out


def _master_value(p: torch.Tensor) -> torch.Tensor:
    """Quantized ``p``'s value for its master: its preserved initial value, else its dequantized
    value."""
    init = p.get_high_precision_init_val()  # type: ignore[attr-defined]
    return init if init is not None else p.dequantize(torch.float32)


def _master_of(p: torch.Tensor) -> nn.Parameter:
    """An FP32 master for quantized ``p``: its preserved initial value, else its dequantized value."""
    return nn.Parameter(_master_value(p).detach().to(device=p.device, dtype=torch.float32, copy=True))


def _param_groups(params: Any) -> list[dict]:
    """``params`` as a torch optimizer reads it: a list of groups, each a dict whose
    ``"params"`` is a list (of tensors or ``(name, tensor)`` pairs)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("MasterWeightOptimizer: params must be an iterable of parameters, (name, parameter) "
                        f"pairs or dicts, got a single {torch.typename(params)}; pass [tensor].")
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"MasterWeightOptimizer: parameter group {i} must be a dict with \"params\" "
                            f"(as for a torch optimizer), got {type(g).__name__}.")
        ps = g["params"]
        if isinstance(ps, set):
            raise TypeError(f"MasterWeightOptimizer: the params of group {i} are a set, whose order changes "
                            "between runs (the masters and the optimizer state follow it); pass a list.")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for item in ps:
            if isinstance(item, tuple) and len(item) != 2:
                raise TypeError(f"MasterWeightOptimizer: group {i} holds a tuple of {len(item)} items; a "
                                "tuple stands for a (name, parameter) pair, as model.named_parameters() gives.")
        out.append({**g, "params": ps})
    return out


def _called_by_grad_scaler(frame: Any) -> bool:
    """Whether ``frame`` is ``torch.amp.GradScaler``'s call of ``optimizer.step`` (its
    ``_maybe_opt_step``): the scaler has unscaled the gradients of ``param_groups`` by then."""
    if frame is None or frame.f_code.co_name != "_maybe_opt_step":
        return False
    return isinstance(frame.f_locals.get("self"), torch.amp.GradScaler)


def _tensor_of(item: Any) -> Any:
    """The parameter of a ``params`` entry: the tensor, or the tensor of a (name, tensor) pair."""
    return item[1] if isinstance(item, tuple) else item


class MasterWeightOptimizer:
    """A torch optimizer over FP32 masters of the quantized parameters.

    Quantized parameters (``QuantizedTensor``) get an FP32 master (seeded from
    ``get_high_precision_init_val()`` when kept, else the dequantized value); the wrapped
    optimizer holds the masters (and its state for them) in their place, and plain parameters
    as they are. :meth:`step` hands each master its parameter's gradient (as FP32), steps, and
    re-quantizes the parameters (:func:`quantize_master_weights`; a tensor-parallel weight's
    parameter is its FP32 master shard, stepped in place, its quantized shard re-encoded). Under FSDP2
    (``enable_quantized_all_gather`` on a ``quantized_model_init`` model) a sharded weight's
    parameter is its FP32 master shard, stepped in place; :meth:`step` then re-encodes every
    rank's quantized shards (``hybridfp.quantize_sharded_weights``: a collective).

    ``params`` takes what a torch optimizer takes: tensors, ``(name, tensor)`` pairs
    (``model.named_parameters()``; the names go to the wrapped optimizer, whose state dict then
    holds them as ``param_names``), or groups (dicts with ``"params"`` of either). A step's
    ``closure`` (``torch.optim.LBFGS`` needs one) is run as torch runs it, with each evaluation
    reading the current masters and handing them its gradients (:meth:`step`).

    The first step frees each stepped weight's kept initial value
    (``get_high_precision_init_val()``): from then on the master holds the weight's exact value
    (:meth:`master_of`), and an optimizer built later seeds from the dequantized weight, never
    from the value it started training from.

    ``torch.amp.GradScaler`` reads the gradients of :attr:`param_groups` (the masters'): call
    :meth:`copy_model_grads_to_masters` after the backward, before ``scaler.unscale_(opt)`` or
    ``scaler.step(opt)``, and clip the gradients the step reads, those of the
    :attr:`param_groups` tensors::

        scaler.scale(loss).backward()
        opt.copy_model_grads_to_masters()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    Parameters
    ----------
    optimizer_class:
        A ``torch.optim.Optimizer`` class (e.g. ``torch.optim.AdamW``).
    params:
        The model's parameters, ``(name, parameter)`` pairs, or parameter groups (dicts with
        ``"params"``).
    **kwargs:
        The optimizer's arguments (lr, betas, weight_decay, foreach...).

    Raises
    ------
    TypeError
        ``optimizer_class`` is not an optimizer class; ``params`` is a single tensor, a set, or
        holds a tuple that is not a ``(name, parameter)`` pair.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> recipe = hf.MXFP8BlockScaling()
    >>> with hf.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
    ...     lin = hf.Linear(32, 32)
    >>> opt = hf.MasterWeightOptimizer(torch.optim.AdamW, lin.named_parameters(), lr=1e-3)
    >>> with hf.autocast(recipe=recipe):
    ...     loss = lin(torch.randn(4, 32)).square().mean()
    >>> loss.backward()
    >>> opt.step()
    >>> opt.zero_grad()
    >>> type(lin.weight).__name__, opt.master_of(lin.weight).dtype, opt.param_groups[0]["param_names"]
    ('QuantizedTensor', torch.float32, ['weight', 'bias'])
    """

    def __init__(self, optimizer_class: Callable[..., torch.optim.Optimizer], params: Iterable[Any], **kwargs: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"MasterWeightOptimizer: optimizer_class must be a torch.optim.Optimizer "
                            f"class (e.g. torch.optim.AdamW), got {optimizer_class!r}.")
        groups = _param_groups(params)
        self.model_params: list[torch.Tensor] = [_tensor_of(p) for g in groups for p in g["params"]]
        packed = _packed_masters(self.model_params)
        self.master_params: list[Optional[nn.Parameter]] = [
            packed[id(p)] if id(p) in packed else _master_of(p) if isinstance(p, QuantizedTensor) else None
            for p in self.model_params]
        stepped = {id(p): m for p, m in zip(self.model_params, self.master_params) if m is not None}

        def swap(item: Any) -> Any:  # a master in its parameter's place, a name kept with it
            if isinstance(item, tuple):
                return (item[0], stepped.get(id(item[1]), item[1]))
            return stepped.get(id(item), item)

        self.optimizer = optimizer_class([{**g, "params": [swap(p) for p in g["params"]]} for g in groups], **kwargs)
        #: whether the masters hold this step's gradients already (copy_model_grads_to_masters)
        self._grads_copied = False

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's groups (holding the masters in place of quantized parameters)."""
        return self.optimizer.param_groups

    def master_of(self, p: torch.Tensor) -> Optional[nn.Parameter]:
        """The FP32 master of model parameter ``p`` (None for a plain parameter)."""
        for q, m in zip(self.model_params, self.master_params):
            if q is p:
                return m
        raise KeyError("MasterWeightOptimizer.master_of: not one of this optimizer's parameters.")

    def copy_model_grads_to_masters(self) -> None:
        """Hand each master its quantized parameter's gradient, as FP32 (None where it has none);
        the step that follows reads the masters' gradients as they are then.

        :meth:`step` calls it unless it was called since the last step or :meth:`zero_grad`.
        Call it yourself after the last backward of a step where something reads or changes the
        gradients of :attr:`param_groups` before the step: ``torch.amp.GradScaler``'s
        ``unscale_`` and ``step``, ``clip_grad_norm_`` over the :attr:`param_groups` tensors. An
        FP32 gradient is handed over without a copy (the master's gradient shares the model
        gradient's memory, so unscaling or clipping either changes both); a gradient of another
        dtype is copied, and changes made to it after this call do not reach the step.

        Returns
        -------
        None
        """
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master_params):
                if m is not None:
                    m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
        self._grads_copied = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of the wrapped optimizer on the masters, then every quantized parameter
        re-quantized from its master.

        Without ``closure`` the masters take the model's gradients first
        (:meth:`copy_model_grads_to_masters`, unless called since the last step). With one
        (``torch.optim.LBFGS`` needs it; it clears the gradients, runs the forward and the
        backward and returns the loss, as torch's closures do), each evaluation the wrapped
        optimizer makes runs it with gradients enabled and hands the masters the gradients it
        computed; from the second evaluation on, the parameters are first re-quantized from the
        masters, which the optimizer moves between evaluations (the first reads the weights as
        they are, as a step without closure does).

        Parameters
        ----------
        closure:
            None, or a callable that re-evaluates the model and returns the loss.

        Returns
        -------
        Any
            What the wrapped optimizer's ``step`` returns (the closure's first loss, or None).

        Raises
        ------
        RuntimeError
            Called by ``torch.amp.GradScaler.step`` while the masters do not hold the step's
            gradients (:meth:`copy_model_grads_to_masters` not called after the backward): the
            scaler unscaled and checked other gradients than those the step would read.
        """
        if closure is None:
            if not self._grads_copied:
                if _called_by_grad_scaler(sys._getframe(1)):
                    raise RuntimeError(
                        "MasterWeightOptimizer.step: torch.amp.GradScaler unscaled and checked for inf the "
                        "gradients of opt.param_groups (the FP32 masters), which do not hold this step's "
                        "gradients yet (the quantized weights would be stepped with the scaled gradients); "
                        "call opt.copy_model_grads_to_masters() after the backward, before "
                        "scaler.unscale_(opt) / scaler.step(opt).")
                self.copy_model_grads_to_masters()
            with torch.no_grad():
                out = self.optimizer.step()
        else:
            out = self.optimizer.step(self._evaluation(closure))
        self._grads_copied = False
        with torch.no_grad():
            self._requantize()
        return out

    def _evaluation(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` as the wrapped optimizer calls it: from the second call on, the quantized
        parameters re-encoded from the masters first (the optimizer moved them in between); the
        closure run with gradients enabled; its gradients handed to the masters."""
        calls = [0]

        def evaluate() -> Any:
            if calls[0]:
                with torch.no_grad():
                    self._requantize()
            calls[0] += 1
            with torch.enable_grad():
                loss = closure()
            self.copy_model_grads_to_masters()
            return loss

        return evaluate

    def _requantize(self) -> None:
        """The quantized parameters re-encoded from their masters (their kept initial values,
        which the masters supersede, freed first: no copy to the CPU a step)."""
        for p, m in zip(self.model_params, self.master_params):
            if m is not None:
                p.clear_high_precision_init_val()  # type: ignore[attr-defined]
        quantize_master_weights(self.model_params, self.master_params)
        # FSDP2's quantized primary weights: the parameter is the FP32 master shard; each rank's
        # quantized shard is re-encoded from it (one amax all-reduce for all of them)
        from .fsdp_primary import is_primary_shard, quantize_sharded_weights
        sharded = [p for p in self.model_params if is_primary_shard(p)]
        if sharded:
            quantize_sharded_weights(sharded)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model parameters and of the masters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self._grads_copied = False

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, the masters (plain tensors: weights_only loads) and,
        per master, a SHA-256 digest of its quantized parameter's payload bytes (what
        :meth:`load_state_dict` compares to tell whether a weight already holds this encoding)."""
        return {"optimizer": self.optimizer.state_dict(),
                "master_params": [None if m is None else m.detach().clone() for m in self.master_params],
                "weight_digests": [None if m is None else _payload_digest(p)
                                   for p, m in zip(self.model_params, self.master_params)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s dict: masters copied, the optimizer's state loaded, and
        every quantized parameter that does not hold the encoding it had when the dict was saved
        re-quantized from its loaded master.

        The quantized parameters take the loaded masters' values here, not at the next
        :meth:`step`: a forward between the two already sees the loaded weights. A parameter whose
        payload bytes are those saved with the dict (the model's state dict of the same checkpoint
        loaded first) is left as it is: re-encoding it would use its quantizer's state of now
        (a delayed scale moved by a forward run since) instead of the one it was encoded with,
        and training would not continue bitwise. A dict without digests (an older one) re-encodes
        every quantized parameter. An FSDP2 sharded primary weight is left as it is: its
        parameter is its own master, loaded with the model's state dict (whose load is followed
        by ``hybridfp.quantize_sharded_weights``), not with this dict. Loading the model's state
        dict alone (after this optimizer is built) leaves the masters at their old values, and
        the next :meth:`step` re-encodes the weights from those: load both. A weight that keeps
        an initial value (``get_high_precision_init_val()``) keeps its loaded master's value.

        Parameters
        ----------
        state:
            A dict of :meth:`state_dict` (after ``torch.load(..., weights_only=True)``).

        Raises
        ------
        ValueError
            The dict is not one of :meth:`state_dict`, holds another number of masters, or a
            master of another shape than its parameter's.
        """
        keys = set(state) if isinstance(state, dict) else set()
        if not {"optimizer", "master_params"} <= keys <= {"optimizer", "master_params", "weight_digests"}:
            raise ValueError("MasterWeightOptimizer.load_state_dict: expected the dict of "
                             "MasterWeightOptimizer.state_dict() (keys 'optimizer', 'master_params', "
                             "'weight_digests').")
        masters = state["master_params"]
        if len(masters) != len(self.master_params) or any(
                (a is None) != (b is None) for a, b in zip(masters, self.master_params)):
            raise ValueError("MasterWeightOptimizer.load_state_dict: the saved masters do not match this "
                             "optimizer's quantized parameters (another model or parameter order).")
        for i, (m, saved) in enumerate(zip(self.master_params, masters)):
            if m is not None and tuple(saved.shape) != tuple(m.shape):
                raise ValueError(f"MasterWeightOptimizer.load_state_dict: saved master {i} has shape "
                                 f"{tuple(saved.shape)}, its parameter {tuple(m.shape)} (another model, or "
                                 "a checkpoint of another sharding).")
        digests = state.get("weight_digests") or [None] * len(masters)
        if len(digests) != len(masters):
            raise ValueError(f"MasterWeightOptimizer.load_state_dict: {len(digests)} weight digests for "
                             f"{len(masters)} masters (a damaged or hand-edited dict).")
        # the wrapped optimizer checks its part first: a dict it refuses leaves the model as it was
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, saved in zip(self.master_params, masters):
                if m is not None:
                    m.copy_(saved)
            stale = [None if m is None or (d is not None and d == _payload_digest(p)) else m
                     for p, m, d in zip(self.model_params, self.master_params, digests)]
            quantize_master_weights(self.model_params, stale)
            for p, m, s in zip(self.model_params, self.master_params, stale):
                if m is not None and s is None and isinstance(p, QuantizedTensor):
                    _keep_master_value(p, m)  # it holds that master's encoding already

    def __repr__(self) -> str:
        n = sum(m is not None for m in self.master_params)
        return f"MasterWeightOptimizer({type(self.optimizer).__name__}, {n} FP32 masters)"


def _payload_digest(p: torch.Tensor) -> Optional[str]:
    """SHA-256 of quantized ``p``'s payload tensors (dtype, shape and bytes of each, in order);
    None for a plain tensor.

    Parameters
    ----------
    p:
        A parameter.

    Returns
    -------
    str or None
        The hex digest; equal digests mean the same encoding (copies, codes and scales).
    """
    if not isinstance(p, QuantizedTensor):
        return None
    h = hashlib.sha256()
    for t in p.qstorage.tensors():
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _nbytes(t: torch.Tensor) -> int:
    if isinstance(t, QuantizedTensor):
        return t.quantized_nbytes()
    return t.numel() * t.element_size()


def memory_per_parameter(model: nn.Module, optimizer: Any) -> dict[str, float]:
    """Bytes per model parameter held by the weights, the FP32 masters and the optimizer state
    (gradients and activations excluded), and the same for BF16 training (BF16 weights, FP32
    masters, the same optimizer state).

    Parameters
    ----------
    model:
        The model (its parameters are counted once each).
    optimizer:
        A :class:`MasterWeightOptimizer` or a torch optimizer, after at least one step (its state
        exists then).

    Returns
    -------
    dict
        ``weights``, ``masters``, ``optimizer_state``, ``total`` and ``bf16_total`` (bytes per
        parameter element, every parameter counted), and ``quantized_weight`` (bytes per element
        of the quantized parameters alone, both copies and scales; 0 without any).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> lin = hf.Linear(32, 32, bias=False)
    >>> opt = torch.optim.AdamW(lin.parameters())
    >>> lin.weight.grad = torch.zeros(32, 32); opt.step()
    >>> m = hf.memory_per_parameter(lin, opt)
    >>> m["weights"], m["optimizer_state"], m["bf16_total"]
    (4.0, 8.0, 14.0)
    """
    params = list({id(p): p for p in model.parameters()}.values())
    n = sum(p.numel() for p in params)
    inner = optimizer.optimizer if isinstance(optimizer, MasterWeightOptimizer) else optimizer
    masters = [m for m in getattr(optimizer, "master_params", []) if m is not None]
    weights = sum(_nbytes(p) for p in params)
    master_bytes = sum(_nbytes(m) for m in masters)
    state = sum(_nbytes(v) for s in inner.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.numel() > 1)
    quantized = [p for p in params if isinstance(p, QuantizedTensor)]
    nq = sum(p.numel() for p in quantized)
    out = {"weights": weights / n, "masters": master_bytes / n, "optimizer_state": state / n,
           "quantized_weight": sum(_nbytes(p) for p in quantized) / nq if nq else 0.0}
    out["total"] = out["weights"] + out["masters"] + out["optimizer_state"]
    out["bf16_total"] = 2.0 + 4.0 + out["optimizer_state"]
    return out
