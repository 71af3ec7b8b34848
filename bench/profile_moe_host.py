"""Where the host time of a host-bound MoE step goes: cProfile of ``bench_moe``'s layer.

At 64 experts (ffn 1408) every hybridfp recipe is host-bound on the H200 ("GPU busy" 0.06-0.45
in ``bench_moe``): the Python and launch work per expert outruns the GPU. This runs the same
layer and step as ``bench_moe`` for one recipe (a substring of its name), warms it up, then
profiles ``--steps`` steps with cProfile (the GPU synchronized at the end, so the time the host
waits shows up as ``synchronize``) and prints the functions by own time and by cumulative time.

    python -m bench.profile_moe_host [--experts 64] [--ffn 1408] [--recipe Composer-2] [--steps 3]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

import hybridfp
from bench import common
from bench.bench_moe import HIDDEN, RECIPES, TOKENS, make_step, moe_layer
from bench.common import parser, require_cuda


def profile_recipe(recipe_text: str, experts: int, ffn: int, tokens: int, hidden: int, steps: int,
                   top: int = 40) -> str:
    """The cProfile report (own time, then cumulative) of ``steps`` steps of the first recipe
    whose name contains ``recipe_text``, after two warm-up steps, with wall ms per step."""
    found = [(n, r) for n, r in RECIPES if recipe_text in n]
    if not found:
        raise SystemExit(f"profile_moe_host: no bench_moe recipe name contains {recipe_text!r}; names: "
                         + "; ".join(n for n, _ in RECIPES))
    name, make = found[0]
    _, model, x, dy = moe_layer(experts, ffn, tokens, hidden)
    recipe = make()
    step = make_step(model, x, dy, lambda: hybridfp.autocast(recipe=recipe))
    for _ in range(2):
        step()
    _sync()
    prof = cProfile.Profile()
    # CUDA backward runs on autograd's device thread, which cProfile would not see
    with torch.autograd.set_multithreading_enabled(False):
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            step()
        _sync()
        prof.disable()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    out = io.StringIO()
    out.write(f"## {experts} experts, ffn {ffn}: {name}, {steps} steps, {ms:.1f} ms/step under cProfile\n")
    for key in ("tottime", "cumulative"):
        out.write(f"\n### by {key}\n")
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
    return out.getvalue()


def _sync() -> None:
    if common.DEVICE == "cuda":
        torch.cuda.synchronize()


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--recipe", default="Composer-2", help="a substring of a bench_moe recipe name")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    require_cuda()
    warnings.simplefilter("ignore")
    tokens, hidden = (512, 256) if args.quick else (TOKENS, HIDDEN)
    text = profile_recipe(args.recipe, args.experts, args.ffn, tokens, hidden, args.steps)
    if args.out is not None:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
