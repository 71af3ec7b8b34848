"""``hybridfp train``'s training step, fused SwiGLU vs eager: paired step time and tokens/s.

The fused SwiGLU is ``hybridfp.swiglu`` (Triton kernels on CUDA), the eager one
``F.silu(g) * u``. Rows: the presets ``gpt-100m`` (dense, SwiGLU MLP) and ``moe-small`` (8
experts, top-2), each under the recipes ``bf16``, ``fp8`` (FP8 current scaling) and ``mxfp8``
(``hybridfp train --recipe``'s names). Per row two models are built as the train command builds them
(``build_model``, seed 0: the same initial weights), one with ``GPTConfig.fused_swiglu=False``
(the baseline, ``--eager-swiglu``), one with ``True`` (the default), each with its own
``make_optimizer`` and ``make_scheduler``, and trained on one fixed batch (``get_batch`` over
seeded random bytes, the preset's batch size and sequence length). The step mirrors the one in
``train_recipe`` (one process): forward under ``autocast(recipe=...)``, backward, the gradient
clip, optimizer step, scheduler step, ``zero_grad``, and the loss read back to the host.
Output check: the first step of each model gives a loss and a gradient norm (the clip's) that
agree within ``BOUND``, relative; a bigger difference fails the run, as does an eager step that
cannot run (``MissingBaselineError``). Step time: a paired ratio (``bench.protocol.paired_ratio``)
of eager against fused: the median over alternating rounds of eager ms / fused ms, with its
≥ 95 % interval; above 1 the fused step is faster.

    python -m bench.bench_train_step [--out results.json] [--quick] [--rounds N] [--samples N]
                                     [--presets gpt-100m,moe-small] [--recipes bf16,fp8,mxfp8]
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from bench import common
from bench.common import (AccuracyError, MissingBaselineError, environment, finish, md_table, parser,
                          protocol_from, protocol_record, require_baseline, require_cuda)
from bench.protocol import Protocol, clock_spread, paired_ratio
from hybridfp.recipes import autocast
from hybridfp.train.data import get_batch
from hybridfp.train.distributed import clip_grad_norm, mean_over_ranks
from hybridfp.train.cli import build_parser, config_from_args
from hybridfp.train.loop import TrainConfig, build_model, make_optimizer, make_scheduler
from hybridfp.train.model import PRESETS
from hybridfp.train.recipes_by_name import parse_recipe

PRESET_NAMES, QUICK_PRESETS = ("gpt-100m", "moe-small"), ("test", "test-moe")
RECIPE_NAMES = ("bf16", "fp8", "mxfp8")
#: byte-level tokens, the train command's vocabulary on its own corpora
VOCAB = 256
#: relative bound on the first step's loss and gradient norm, fused vs eager: the kernels round
#: where eager torch rounds (within 2 BF16 ulps of it, tests/nn/test_swiglu.py), so the unbiased
#: differences move a mean over B x T tokens or a norm over every gradient far below 2^-8; 1e-2
#: leaves room for the FP8 roundings a differing bit flips. Dropping the up half of the SwiGLU
#: moves the gradient norm by 9-26 % on the test presets, the initial loss by < 0.1 % (a wrong
#: backward alone moves neither by 1 %: the kernels' own tests bound it).
BOUND = 1e-2


def train_config(preset: str, fused: bool) -> TrainConfig:
    """The settings ``hybridfp train --preset PRESET [--eager-swiglu]`` runs with on
    ``common.DEVICE`` (the train command's own ``config_from_args``: seed 0, BF16 activations,
    grad clip 1.0, decay over the preset's steps); ``fused`` False adds ``--eager-swiglu``."""
    argv = ["train", "--preset", preset, "--device", common.DEVICE] + ([] if fused else ["--eager-swiglu"])
    return config_from_args(build_parser().parse_args(argv))


def fixed_batch(preset: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) on ``common.DEVICE``: the loop's ``get_batch`` (batch 0) over seeded random bytes."""
    p = PRESETS[preset]
    tokens = torch.randint(0, VOCAB, (4 * p.batch_size * (p.seq_len + 1),), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))
    x, y = get_batch(tokens.numpy(), p.batch_size, p.seq_len, seed, 0)
    return x.to(common.DEVICE), y.to(common.DEVICE)


class TrainStep:
    """One model's training step as ``train_recipe`` runs it in one process (``loop.py``; not a
    function there, so its public pieces are called here in its order).

    Parameters
    ----------
    preset, recipe:
        A ``PRESETS`` name and a ``hybridfp train --recipe`` name.
    batch:
        The fixed (x, y) every call trains on.
    fused:
        ``GPTConfig.fused_swiglu``.

    Attributes
    ----------
    first:
        (loss, gradient norm before clipping) of the first call; None before it.
    """

    def __init__(self, preset: str, recipe: str, batch: tuple[torch.Tensor, torch.Tensor], fused: bool) -> None:
        self.cfg = train_config(preset, fused)
        self.recipe = parse_recipe(recipe).recipe
        self.model = build_model(self.cfg, VOCAB, self.recipe)
        self.opt = make_optimizer(self.model, self.cfg)
        self.sched = make_scheduler(self.opt, self.cfg)
        self.model.train()
        self.x, self.y = batch
        self.first: Optional[tuple[float, float]] = None
        torch.manual_seed(self.cfg.seed + 1)  # the training randomness, seeded as train_recipe seeds it

    def __call__(self) -> float:
        """One step; returns its loss.

        Raises
        ------
        FloatingPointError
            The loss is not finite (as the loop stops)."""
        with autocast(recipe=self.recipe):
            _, loss = self.model(self.x, self.y)
        loss.backward()
        norm = clip_grad_norm(self.model, self.cfg.grad_clip, None) if self.cfg.grad_clip > 0 else None
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        mean_over_ranks(self.model.last_ce_loss, None)  # the loop logs it: a read back, a sync, each step
        value = loss.item()
        if self.first is None:
            self.first = (value, 0.0 if norm is None else float(norm))
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss became {value}")
        return value


def rel_diff(got: float, want: float) -> float:
    """|got - want| / |want| (inf where ``want`` is 0 and ``got`` is not; NaN propagates)."""
    if want == 0:
        return 0.0 if got == 0 else math.inf
    return abs(got - want) / abs(want)


def check_first_step(where: str, eager: tuple[float, float], fused: tuple[float, float],
                     bound: float = BOUND) -> dict[str, float]:
    """Compare the first step's (loss, gradient norm) of the fused model with the eager one's.

    Returns
    -------
    dict[str, float]
        ``loss_rel_diff`` and ``grad_norm_rel_diff``.

    Raises
    ------
    AccuracyError
        Naming ``where``: a relative difference above ``bound``, or NaN.
    """
    out = {}
    for name, e, f in zip(("loss", "grad_norm"), eager, fused):
        d = rel_diff(f, e)
        if not d <= bound:
            raise AccuracyError(f"{where}: the first step's {name} with the fused SwiGLU ({f:.6g}) differs from the "
                                f"eager one's ({e:.6g}) by {d:.3g} relative, above {bound:g}: the two steps do not "
                                "compute the same training step")
        out[f"{name}_rel_diff"] = d
    return out


def step_row(preset: str, recipe: str, protocol: Protocol) -> dict[str, Any]:
    """One row: the eager step (baseline) and the fused step of ``preset`` under ``recipe``,
    their first steps checked against each other, then paired.

    Raises
    ------
    MissingBaselineError
        The eager model cannot be built or its step cannot run.
    AccuracyError
        The first steps differ (``check_first_step``).
    """
    where = f"train_step {preset} {recipe}"
    batch = fixed_batch(preset)
    eager = require_baseline(where, "the eager SwiGLU step (F.silu(g) * u)",
                             lambda: TrainStep(preset, recipe, batch, fused=False))  # its first step runs here
    fused = TrainStep(preset, recipe, batch, fused=True)
    fused()
    check = check_first_step(where, eager.first, fused.first)
    r = paired_ratio(eager, fused, protocol)
    tokens = batch[0].numel()
    return dict(preset=preset, recipe=recipe, tokens_per_step=tokens, ms_eager=r.baseline_ms, ms_fused=r.candidate_ms,
                tokens_per_s_eager=tokens / r.baseline_ms * 1e3, tokens_per_s_fused=tokens / r.candidate_ms * 1e3,
                fused_vs_eager=r.as_dict(), loss=fused.first[0], **check)


def _names(text: str, known: Any, what: str, p: Any) -> list[str]:
    """The comma-separated names of ``text``; argparse's error (exit 2) for one not in ``known``."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        p.error(f"--{what}: {', '.join(bad) or 'none given'}; pick from {', '.join(known)}")
    return names


def _ci(p: dict[str, Any]) -> str:
    return f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}]"


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--presets", default=None, help=f"comma-separated presets (default {','.join(PRESET_NAMES)}; "
                   f"--quick: {','.join(QUICK_PRESETS)})")
    p.add_argument("--recipes", default=",".join(RECIPE_NAMES), help="comma-separated hybridfp train recipe names "
                   f"(default {','.join(RECIPE_NAMES)})")
    args = p.parse_args(argv)
    presets = _names(args.presets or ",".join(QUICK_PRESETS if args.quick else PRESET_NAMES), PRESETS, "presets", p)
    recipes = _names(args.recipes, RECIPE_NAMES, "recipes", p)
    require_cuda()
    protocol = protocol_from(args)
    rows, failures = [], []
    for preset in presets:
        for recipe in recipes:
            try:
                rows.append(step_row(preset, recipe, protocol))
            except (AccuracyError, MissingBaselineError, FloatingPointError) as e:
                failures.append(f"{preset} {recipe}: {e}")
                rows.append(dict(preset=preset, recipe=recipe, error=str(e)))
    ok = [r for r in rows if "error" not in r]
    md = ("### `hybridfp train` step, fused vs eager SwiGLU\n\n"
          f"x eager: median over {protocol.rounds} alternating rounds ({protocol.samples} steps a side each) of eager "
          "step time / fused step time, [≥ 95 % interval]; above 1 the fused step is faster. First step's loss and "
          f"gradient norm agree within {BOUND:g}, relative."
          + ("" if protocol.reportable else " NOT REPORTABLE (fewer than 10 rounds or samples).") + "\n\n"
          + md_table(["preset", "recipe", "tokens / step", "step ms eager / fused", "tokens/s eager / fused",
                      "x eager [interval]", "loss / grad norm rel diff", "SM MHz", "power W"],
                     [(r["preset"], r["recipe"], r["tokens_per_step"], f"{r['ms_eager']:.2f} / {r['ms_fused']:.2f}",
                       f"{r['tokens_per_s_eager']:,.0f} / {r['tokens_per_s_fused']:,.0f}", _ci(r["fused_vs_eager"]),
                       f"{r['loss_rel_diff']:.2g} / {r['grad_norm_rel_diff']:.2g}",
                       clock_spread(r["fused_vs_eager"]["clocks"], "sm_mhz", "-"),
                       clock_spread(r["fused_vs_eager"]["clocks"], "power_w", "-")) for r in ok]
                     + [(r["preset"], r["recipe"], "FAILED", r["error"]) + ("",) * 5 for r in rows if "error" in r])
          + "\n")
    finish("train_step", {"env": environment(), "protocol": protocol_record(protocol),
                          "args": {"quick": args.quick, "presets": presets, "recipes": recipes},
                          "rows": rows, "failures": failures, "markdown": md}, args.out)
    if failures:
        raise SystemExit("train_step failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
