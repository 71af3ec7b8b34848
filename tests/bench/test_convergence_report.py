"""bench.convergence_report: the t quantile, paired and Welch gap intervals, verdicts, and the
per-recipe table from metrics files with several seeds (synthetic numbers)."""

import gzip
import json
import math

import pytest

from bench import convergence_report as cr
from bench import convergence_stats as cs


def _write(path, finals, steps=(0, 20), rate=100.0):
    """One metrics file: for each label a val loss at each step (final one = finals[label])."""
    with gzip.open(path, "wt") as f:
        for label, v in finals.items():
            for s in steps:
                rec = {"step": s, "recipe": label, "val_loss": v if s == steps[-1] else 5.0}
                if s:
                    rec.update(train_loss=2.0, tokens_per_s=rate)
                f.write(json.dumps(rec) + "\n")
    return path


@pytest.mark.parametrize("df,expected", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_t_quantile_matches_tables(df, expected):
    assert cs.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)
    assert cs.t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-4)
    assert cs.t_cdf(expected, df) == pytest.approx(0.975, abs=1e-5)  # the tables round to 4 digits


def test_t_quantile_refuses_bad_arguments():
    with pytest.raises(ValueError, match="0 < p < 1"):
        cs.t_quantile(1.0, 3)


def test_paired_interval_by_hand():
    # per-seed gaps 1, 2, 3 %: mean 2, sd 1, half width t(0.975, 2) / sqrt(3)
    g = cs.paired_gap({0: 1.01, 1: 1.02, 2: 1.03}, {0: 1.0, 1: 1.0, 2: 1.0})
    half = 4.302652729911275 / math.sqrt(3)
    assert g.gap_pct == pytest.approx(2.0) and g.lo == pytest.approx(2 - half) and g.hi == pytest.approx(2 + half)
    assert g.method == "paired (3 seeds)" and g.n == 3


def test_welch_interval_by_hand():
    # means 1.03 / 1.01, variances 1e-4 each: se = sqrt(2e-4 / 3), df = 4
    g = cs.welch_gap([1.02, 1.03, 1.04], [1.0, 1.01, 1.02])
    half = 100 * 2.7764451051977987 * math.sqrt(2e-4 / 3) / 1.01
    assert g.gap_pct == pytest.approx(100 * 0.02 / 1.01)
    assert g.lo == pytest.approx(g.gap_pct - half) and g.hi == pytest.approx(g.gap_pct + half)


@pytest.mark.parametrize("lo,hi,target,word", [
    (-0.1, 0.2, 0.25, "met"), (-0.25, 0.25, 0.25, "met"), (0.3, 0.9, 0.25, "missed"),
    (-0.9, -0.3, 0.25, "missed"), (0.1, 0.4, 0.25, "unresolved"), (-0.4, 0.4, 0.25, "unresolved"),
    (None, None, 0.25, "unresolved"), (0.1, 0.2, None, "")])
def test_verdicts(lo, hi, target, word):
    assert cs.verdict(lo, hi, target) == word


def _study(tmp_path):
    bf16 = {0: 1.00, 1: 1.05, 2: 0.95}  # a seed spread of 10 %: only pairing resolves 0.1 %
    finals = {}
    for recipe, gaps in (("bf16", (0, 0, 0)), ("fp8", (0.10, 0.12, 0.08)), ("mxfp8", (0.5, 0.6, 0.7)),
                         ("per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8", (0.5, 1.5, 1.0))):
        for s, g in zip(bf16, gaps):
            finals[f"{recipe}@seed={s}"] = bf16[s] * (1 + g / 100)
    half = _write(tmp_path / "a.jsonl.gz", {k: v for i, (k, v) in enumerate(finals.items()) if i % 2})
    other = _write(tmp_path / "b.jsonl.gz", {k: v for i, (k, v) in enumerate(finals.items()) if not i % 2})
    return [half, other]  # one comparison written by two worker processes


def test_analyze_pairs_by_seed_and_gives_verdicts(tmp_path):
    result = cr.analyze(_study(tmp_path))
    rows = {r["recipe"]: r for r in result["rows"]}
    assert result["final_step"] == 20 and rows["bf16"]["seeds"] == [0, 1, 2]
    assert rows["bf16"]["mean"] == pytest.approx(1.0) and rows["bf16"]["std"] == pytest.approx(0.05)
    fp8 = rows["fp8"]
    half = 4.302652729911275 * 0.02 / math.sqrt(3)
    assert fp8["method"] == "paired (3 seeds)" and fp8["gap_pct"] == pytest.approx(0.10)
    assert fp8["ci_lo"] == pytest.approx(0.10 - half) and fp8["ci_hi"] == pytest.approx(0.10 + half)
    assert (fp8["verdict"], rows["mxfp8"]["verdict"]) == ("met", "missed")
    assert rows["per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"]["verdict"] == "unresolved"
    assert rows["fp8"]["tokens_per_s"] == 100.0
    json.dumps(result)  # plain data
    text = cr.to_markdown(result)
    # sd 0.02 %: t(0.975, 1) 0.02 / sqrt(2) = 0.18 <= 0.25, so 2 seeds would meet at a zero gap
    assert fp8["gap_sd"] == pytest.approx(0.02) and fp8["seeds_to_meet"] == 2
    # at its mean gap 0.10 %: t(0.975, 1) 0.02 / sqrt(2) = 0.18 > 0.15, t(0.975, 2) 0.02 / sqrt(3) = 0.05 <= 0.15
    assert fp8["seeds_to_meet_at_gap"] == 3
    assert "| `fp8` | 3 | 1.0010 ± 0.0503 | +0.10 % | [+0.05, +0.15] % | paired (3 seeds) | ± 0.25 % | met | 2 | 3 | 100 |" \
        in text
    # mxfp8's mean gap lies beyond its target: no seed count meets it
    assert "| missed | " in text and "| never |" in text
    assert "| `bf16` | 1.0000 | 1.0500 | 0.9500 |" in text


def test_unshared_seeds_fall_back_to_welch_and_say_so(tmp_path):
    path = _write(tmp_path / "m.jsonl.gz", {"bf16@seed=0": 1.0, "bf16@seed=1": 1.01, "bf16": 1.02,
                                            "fp8@seed=5": 1.03, "fp8@seed=6": 1.04})
    rows = {r["recipe"]: r for r in cr.analyze([path])["rows"]}
    assert rows["fp8"]["method"] == "Welch" and rows["fp8"]["verdict"] == "unresolved"
    one = _write(tmp_path / "one.jsonl.gz", {"bf16": 1.0, "fp8": 1.001})  # labels without @seed: seed 0
    row = cr.analyze([one])["rows"][1]
    assert row["ci_lo"] is None and row["verdict"] == "unresolved" and "no interval" in row["method"]


def test_report_refusals(tmp_path):
    with pytest.raises(ValueError, match="no bf16 run"):
        cr.analyze([_write(tmp_path / "a.jsonl.gz", {"fp8@seed=0": 1.0})])
    short = tmp_path / "short.jsonl.gz"
    _write(short, {"bf16@seed=0": 1.0})
    longer = _write(tmp_path / "long.jsonl.gz", {"fp8@seed=0": 1.0}, steps=(0, 30))
    with pytest.raises(ValueError, match="ended at different steps"):
        cr.analyze([short, longer])


def test_planned_steps_leave_out_incomplete_runs_and_say_so(tmp_path):
    done = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.0, "bf16@seed=1": 1.01, "fp8@seed=0": 1.0})
    stopped = _write(tmp_path / "b.jsonl.gz", {"fp8@seed=1": 9.0}, steps=(0, 10))
    result = cr.analyze([done, stopped], steps=20)
    assert result["incomplete"] == ["fp8@seed=1"] and result["seeds"]["fp8"] == {"0": 1.0}
    assert "`fp8@seed=1` (stopped at step 10)" in cr.to_markdown(result)


def test_command_line_prints_the_tables_and_writes_json(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    paths = _study(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "bench.convergence_report", *map(str, paths), "--json",
                           str(tmp_path / "r.json")], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| `mxfp8` | 3 |" in proc.stdout and "missed" in proc.stdout
    assert json.loads((tmp_path / "r.json").read_text())["final_step"] == 20


def _lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_recipe_with_any_failed_run_is_failed_and_named(tmp_path):
    # fp8 meets its target on seeds 0 and 1 but diverges on seed 2; mxfp8 never completes a run;
    # fp8-block was dropped at the probe: each gets the verdict "failed", naming its runs
    recs = []
    for s, b in enumerate((1.00, 1.05, 0.95)):
        recs += [{"step": 20, "recipe": f"bf16@seed={s}", "val_loss": b, "train_loss": 2.0}]
        if s < 2:
            recs += [{"step": 20, "recipe": f"fp8@seed={s}", "val_loss": b * 1.001, "train_loss": 2.0}]
    recs += [{"step": 5, "recipe": "fp8@seed=2", "train_loss": 2.0, "val_loss": 3.0},
             {"step": 6, "recipe": "fp8@seed=2", "train_loss": float("nan")},
             {"step": 10, "recipe": "mxfp8@seed=0", "val_loss": 2.0, "train_loss": 2.0},
             {"step": 3, "recipe": "mxfp8@seed=1", "train_loss": 2.0}]
    path = _lines(tmp_path / "m.jsonl", recs)
    expected = [f"{r}@seed={s}" for s in range(3) for r in ("bf16", "fp8", "mxfp8")]
    result = cr.analyze([path], steps=20, expected=expected,
                        dropped={f"fp8-block@seed={s}": "dropped at the probe" for s in range(3)})
    rows = {r["recipe"]: r for r in result["rows"]}
    assert rows["bf16"]["verdict"] == "" and "failed_runs" not in rows["bf16"]
    assert rows["fp8"]["verdict"] == "failed" and rows["fp8"]["seeds"] == [0, 1]
    assert rows["fp8"]["failed_runs"] == {"fp8@seed=2": "diverged at step 6"}
    assert rows["mxfp8"]["verdict"] == "failed" and rows["mxfp8"]["seeds"] == []
    assert rows["mxfp8"]["failed_runs"] == {"mxfp8@seed=0": "stopped at step 10", "mxfp8@seed=1": "stopped at step 3",
                                            "mxfp8@seed=2": "never started"}
    assert rows["fp8-block"]["verdict"] == "failed" and rows["fp8-block"]["gap_pct"] is None
    assert set(rows["fp8-block"]["failed_runs"].values()) == {"dropped at the probe"}
    assert result["failed"]["fp8"] == ["fp8@seed=2"]
    json.dumps(result)
    text = cr.to_markdown(result)
    assert "| `fp8` | 2 |" in text and "| failed |" in text
    assert "| `mxfp8` | 0 | — | — | — |" in text and "| `fp8-block` | 0 |" in text
    assert "`fp8@seed=2` (diverged at step 6)" in text and "`mxfp8@seed=2` (never started)" in text


def test_a_failed_baseline_run_fails_the_baseline_row(tmp_path):
    path = _lines(tmp_path / "m.jsonl", [
        {"step": 20, "recipe": "bf16@seed=0", "val_loss": 1.0}, {"step": 20, "recipe": "fp8@seed=0", "val_loss": 1.0},
        {"step": 20, "recipe": "fp8@seed=1", "val_loss": 1.0}, {"step": 2, "recipe": "bf16@seed=1", "train_loss": 1e9}])
    result = cr.analyze([path], steps=20, expected=["bf16@seed=0", "fp8@seed=0", "bf16@seed=1", "fp8@seed=1"])
    rows = {r["recipe"]: r for r in result["rows"]}
    assert rows["bf16"]["verdict"] == "failed" and rows["bf16"]["failed_runs"] == {"bf16@seed=1": "stopped at step 2"}
    assert "| `bf16` | 1 |" in cr.to_markdown(result)


def test_seeds_to_meet_by_hand():
    # the first n with t(0.975, n-1) sd / sqrt(n) <= target; n - 1 misses it
    for sd, target in ((0.67, 0.25), (0.2, 0.25), (1.11, 1.0), (0.456, 0.5)):
        n = cs.seeds_to_meet(sd, target)
        assert cs.t_quantile(0.975, n - 1) * sd / math.sqrt(n) <= target
        assert n == 2 or cs.t_quantile(0.975, n - 2) * sd / math.sqrt(n - 1) > target
        assert cs.resolvable_sd(target, n) >= sd > (cs.resolvable_sd(target, n - 1) if n > 2 else 0)
    assert (cs.seeds_to_meet(0.67, 0.25), cs.seeds_to_meet(0.2, 0.25)) == (31, 5)
    assert cs.seeds_to_meet(0.0, 0.25) == 2 and cs.seeds_to_meet(40.0, 0.25) is None
    with pytest.raises(ValueError, match="sd must be >= 0"):
        cs.seeds_to_meet(-0.1, 0.25)
    with pytest.raises(ValueError, match="target > 0"):
        cs.seeds_to_meet(0.1, 0.0)


def test_the_committed_study_needs_the_seeds_the_docs_state():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    rows = {r["recipe"]: r for r in cr.analyze([root / "docs/convergence/gpt100m-3seeds-446steps.metrics.jsonl.gz"],
                                                steps=446)["rows"]}
    need = {k: rows[k]["seeds_to_meet"] for k in ("fp8-block", "mxfp8", "mxfp8-fwd-nvfp4-bwd", "fp8",
                                                  "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8")}
    assert need == {"fp8-block": 31, "mxfp8": 30, "mxfp8-fwd-nvfp4-bwd": 6, "fp8": 5,
                    "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8": 8}
    doc = (root / "docs" / "convergence.md").read_text()
    assert "**31 seed pairs for `fp8-block` and 30 for `mxfp8`**" in doc


def test_resolvable_spread_by_hand():
    # meeting +-0.25 % with 3 seeds: half width t(0.975, 2) sd / sqrt(3) <= 0.25 at a zero mean gap
    assert cs.resolvable_sd(0.25, 3) == pytest.approx(0.25 * math.sqrt(3) / 4.302652729911275)
    assert round(cs.resolvable_sd(0.25, 3), 2) == 0.10
    with pytest.raises(ValueError, match="at least two seeds"):
        cs.resolvable_sd(0.25, 1)


def test_report_and_docs_say_what_the_interval_widths_need(tmp_path):
    from pathlib import Path
    text = cr.to_markdown(cr.analyze(_study(tmp_path)))
    assert "With 3 seeds (t = 4.30), a row meets ± 0.25 % only if its per-seed gaps' standard deviation is " \
           "below 0.10 %" in text
    doc = (Path(__file__).resolve().parents[2] / "docs" / "convergence.md").read_text()
    for n in (3, 5, 10):
        t = cs.t_quantile(0.975, n - 1)
        cells = " | ".join(f"{cs.resolvable_sd(x, n):.2f} %" for x in (0.25, 0.5, 1.0))
        assert f"| {n} | {t:.2f} | {cells} |" in doc, (n, cells)


def test_studies_run_one_after_another_pair_by_seed(tmp_path):
    """Two studies with disjoint seeds (``--first-seed``) report as one: the metrics files of both,
    each run from its own file."""
    first = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.00, "fp8@seed=0": 1.01, "bf16@seed=1": 1.05,
                                              "fp8@seed=1": 1.06})
    later = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=2": 0.95, "fp8@seed=2": 0.96})
    rows = {r["recipe"]: r for r in cr.analyze([first, later])["rows"]}
    assert rows["fp8"]["seeds"] == [0, 1, 2] and rows["fp8"]["method"] == "paired (3 seeds)"


def test_a_run_in_two_files_is_refused(tmp_path):
    """The same run in two files (studies with overlapping seeds) would mix two trajectories."""
    first = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.00, "fp8@seed=0": 1.01})
    again = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": 0.99, "fp8@seed=1": 1.02})
    with pytest.raises(ValueError, match=r"bf16@seed=0 is in both .*a\.jsonl\.gz and .*b\.jsonl\.gz.*--first-seed"):
        cr.analyze([first, again])


def test_labels_are_read_by_the_trainers_rule():
    """The report splits a run label as the trainer that named the run did
    (``hybridfp.train.report.split_seed``), a non-numeric suffix included."""
    from hybridfp.train.report import split_seed
    for label in ("fp8@seed=3", "bf16", "per_gemm:fprop=nvfp4@seed=12", "mxfp8@seed=x"):
        assert cr.split_label(label) == split_seed(label, 0)


def _with_corpus(path, corpus_of):
    """Rewrite ``path`` with each run's step-0 record naming its corpus (``corpus_of[label]``)."""
    recs = [json.loads(line) for line in gzip.open(path, "rt")]
    for r in recs:
        if r["step"] == 0 and r["recipe"] in corpus_of:
            r["data"] = corpus_of[r["recipe"]]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return path


def test_runs_of_two_corpora_are_refused(tmp_path):
    """Studies run on machines with other installed packages read other text: their losses are
    not comparable, and the report says which runs read which corpus."""
    first = _with_corpus(_write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.00, "fp8@seed=0": 1.01}),
                         {"bf16@seed=0": "packages-aaa", "fp8@seed=0": "packages-aaa"})
    later = _with_corpus(_write(tmp_path / "b.jsonl.gz", {"bf16@seed=1": 1.05, "fp8@seed=1": 1.06}),
                         {"bf16@seed=1": "packages-bbb", "fp8@seed=1": "packages-bbb"})
    with pytest.raises(ValueError, match=r"different corpora .*packages-aaa.*bf16@seed=0.*packages-bbb.*bf16@seed=1"):
        cr.analyze([first, later])


def test_the_report_names_the_one_corpus_and_the_runs_without_one(tmp_path):
    runs = {"bf16@seed=0": 1.00, "fp8@seed=0": 1.01, "bf16@seed=1": 1.05, "fp8@seed=1": 1.06}
    path = _with_corpus(_write(tmp_path / "a.jsonl.gz", runs), {k: "packages-aaa" for k in runs})
    result = cr.analyze([path])
    assert result["corpus"] == "packages-aaa" and result["runs_without_corpus"] == []
    assert "Corpus fingerprint `packages-aaa`, recorded by every run." in cr.to_markdown(result)
    older = _write(tmp_path / "old.jsonl.gz", {"bf16@seed=2": 0.95, "fp8@seed=2": 0.96})  # before the record
    result = cr.analyze([path, older])
    assert result["corpus"] == "packages-aaa" and result["runs_without_corpus"] == ["bf16@seed=2", "fp8@seed=2"]
    assert ("recorded by every run but 2 that record none (bf16@seed=2, fp8@seed=2: metrics written before "
            "runs recorded their corpus, or data without a fingerprint).") in cr.to_markdown(result)
    legacy = cr.analyze([older])
    assert legacy["corpus"] is None and "Corpus fingerprint" not in cr.to_markdown(legacy)


def test_a_run_whose_records_name_two_corpora_is_refused(tmp_path):
    """A run resumed on other data would carry two fingerprints: refused, not the last one kept."""
    path = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.00, "fp8@seed=0": 1.01})
    recs = [json.loads(line) for line in gzip.open(path, "rt")]
    for r in recs:
        r["data"] = "packages-aaa" if r["step"] == 0 else "packages-bbb"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    with pytest.raises(ValueError, match="different corpora"):
        cr.analyze([path])


def test_a_training_loss_window_replaces_the_final_validation_loss(tmp_path):
    """--train-window N: each run's mean training loss over its last N steps, paired by seed as
    the validation loss is; a run missing a step of the window is refused by name."""
    path = tmp_path / "m.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for seed, (base, gap) in enumerate([(2.0, 0.01), (2.2, 0.03), (1.9, 0.02)]):
            for recipe, level in (("bf16", base), ("fp8", base * (1 + gap))):
                for s in range(1, 11):
                    # the window's mean is `level`; the steps before it are far off
                    train = level + (0.1 if s % 2 else -0.1) if s > 6 else 9.0
                    rec = {"step": s, "recipe": f"{recipe}@seed={seed}", "train_loss": train}
                    if s == 10:
                        rec["val_loss"] = 5.0  # the same for both: a zero gap by validation
                    f.write(json.dumps(rec) + "\n")
    by_val = {r["recipe"]: r for r in cr.analyze([path])["rows"]}
    assert by_val["fp8"]["gap_pct"] == pytest.approx(0.0)
    result = cr.analyze([path], train_window=4)
    rows = {r["recipe"]: r for r in result["rows"]}
    assert result["metric"] == "mean training loss over steps 7-10"
    assert rows["fp8"]["gap_pct"] == pytest.approx(2.0) and rows["fp8"]["method"] == "paired (3 seeds)"
    assert rows["bf16"]["mean"] == pytest.approx((2.0 + 2.2 + 1.9) / 3)
    text = cr.to_markdown(result)
    assert text.startswith("Mean training loss over steps 7-10; gap")
    assert "| recipe | seeds | mean training loss over steps 7-10 (mean ± std) |" in text
    with pytest.raises(ValueError, match=r"no training loss recorded at step\(s\) \[0\]"):
        cr.analyze([path], train_window=11)
    with pytest.raises(ValueError, match="at most 10"):
        cr.analyze([path], train_window=11)
    with pytest.raises(ValueError, match=r"train_window \(--train-window\) must be >= 1"):
        cr.analyze([path], train_window=0)


def test_the_36_seed_fp8_block_and_mxfp8_study_is_what_the_docs_state():
    """docs/convergence.md's 36-seed table and its correlation line, recomputed from the committed
    metrics: the figures cannot drift from the runs they describe."""
    from pathlib import Path
    import statistics
    root = Path(__file__).resolve().parents[2]
    files = [root / "docs/convergence" / f for f in ("gpt100m-3seeds-446steps.metrics.jsonl.gz",
                                                     "gpt100m-fp8block-mxfp8-seeds3-9-446steps.metrics.jsonl.gz",
                                                     "gpt100m-bf16-fp8block-mxfp8-seeds83-108-446steps.metrics.jsonl.gz")]
    study = cr.analyze(files, steps=446)
    rows = {r["recipe"]: r for r in study["rows"]}
    doc = (root / "docs" / "convergence.md").read_text()
    for name in ("fp8-block", "mxfp8"):
        r = rows[name]
        assert len(r["seeds"]) == 36 and r["method"] == "paired (36 seeds)" and r["verdict"] == "unresolved"
        pct = lambda x: f"{x:+.2f}".replace("-", "−")  # noqa: E731 - the docs' minus sign
        cells = (f"| `{name}` | 36 | {r['mean']:.4f} ± {r['std']:.4f} | {pct(r['gap_pct'])} % | "
                 f"[{pct(r['ci_lo'])}, {pct(r['ci_hi'])}] % | ± 0.25 % | unresolved | {r['gap_sd']:.2f} % | "
                 f"{r['seeds_to_meet']} |")
        assert cells in doc, cells
    finals = study["seeds"]
    gaps = {n: [100 * (finals[n][s] - finals["bf16"][s]) / finals["bf16"][s] for s in finals["bf16"]]
            for n in ("fp8-block", "mxfp8")}
    assert round(statistics.correlation(gaps["fp8-block"], gaps["mxfp8"]), 2) == 0.89
    assert "per seed they correlate at 0.89" in doc



def test_the_seed_effect_study_is_what_the_docs_state():
    """docs/convergence.md's seed-effect section, recomputed from the committed metrics: its floors,
    its correlations and its table against the mean of BF16's runs per seed."""
    from pathlib import Path
    import statistics
    from bench.convergence_replicates import replicate_gaps
    root = Path(__file__).resolve().parents[2]
    d = root / "docs/convergence"
    study = d / "gpt100m-bf16-fp8block-mxfp8-seeds83-108-446steps.metrics.jsonl.gz"
    again = d / "gpt100m-bf16-seeds83-108-446steps-again.metrics.jsonl.gz"
    third = d / "gpt100m-bf16-fp8block-seeds83-95-446steps-again.metrics.jsonl.gz"
    doc = (root / "docs" / "convergence.md").read_text()
    pct = lambda x: f"{x:+.2f}".replace("-", "−")  # noqa: E731 - the docs' minus sign
    for recipe, first, second, label in (("bf16", study, again, "36-seed study → bf16-only study"),
                                         ("bf16", study, third, "36-seed study → third study"),
                                         ("bf16", again, third, "bf16-only study → third study"),
                                         ("fp8-block", study, third, "36-seed study → third study")):
        r = replicate_gaps([first], [second], steps=446, recipes=[recipe])[recipe]
        cells = (f"| `{recipe}`: {label} | {r['seeds']} | {pct(r['gap_pct'])} % | [{pct(r['lo'])}, {pct(r['hi'])}] % | "
                 f"{r['sd']:.2f} % |")
        assert cells in doc, cells
    # correlations across seeds 83-108 of the final losses (seed -> loss, each run's file)
    finals = {name: cr.analyze([f], steps=446)["seeds"] for name, f in (("study", study), ("again", again))}
    seeds = sorted(finals["again"]["bf16"], key=int)
    col = lambda name, recipe: [finals[name][recipe][s] for s in seeds]  # noqa: E731
    corr = lambda a, b: f"{statistics.correlation(a, b):.2f}"  # noqa: E731
    b1, b2, blk, mx = col("study", "bf16"), col("again", "bf16"), col("study", "fp8-block"), col("study", "mxfp8")
    assert f"| `bf16` run 1 | 1 | {corr(b1, b2)} | {corr(b1, blk)} | {corr(b1, mx)} |" in doc
    assert f"| `bf16` run 2 | | 1 | {corr(b2, blk)} | {corr(b2, mx)} |" in doc
    assert f"| `fp8-block` | | | 1 | {corr(blk, mx)} |" in doc
    # the second view: each recipe against the mean of its seed's BF16 runs
    files = [d / "gpt100m-3seeds-446steps.metrics.jsonl.gz", d / "gpt100m-fp8block-mxfp8-seeds3-9-446steps.metrics.jsonl.gz",
             study, again]
    rows = {r["recipe"]: r for r in cr.analyze(files, steps=446, baseline_replicates=True)["rows"]}
    for name in ("fp8-block", "mxfp8"):
        r = rows[name]
        assert r["verdict"] == "unresolved"
        cells = (f"| `{name}` | 36 | {pct(r['gap_pct'])} % | [{pct(r['ci_lo'])}, {pct(r['ci_hi'])}] % | "
                 f"{r['gap_sd']:.2f} % | ± 0.25 % | unresolved | {r['seeds_to_meet']} / {r['seeds_to_meet_at_gap']} |")
        assert cells in doc, cells

def _replicated(tmp_path):
    """bf16 trained again at seeds 0 and 1 in a file of its own: seed 0's runs 1.00 and 1.02 (mean
    1.01), seed 1's 2.00 twice, seed 2 one run; fp8's gaps to those means are +1, +3 and +2 %."""
    first = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.00, "fp8@seed=0": 1.0201, "bf16@seed=1": 2.00,
                                              "fp8@seed=1": 2.06, "bf16@seed=2": 1.00, "fp8@seed=2": 1.02})
    again = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": 1.02, "bf16@seed=1": 2.00})
    return first, again


def test_baseline_replicates_pair_each_recipe_with_the_mean_of_its_seeds_runs(tmp_path):
    first, again = _replicated(tmp_path)
    result = cr.analyze([first, again], baseline_replicates=True)
    rows = {r["recipe"]: r for r in result["rows"]}
    assert result["seeds"]["bf16"] == pytest.approx({"0": 1.01, "1": 2.00, "2": 1.00})
    fp8 = rows["fp8"]
    half = 4.302652729911275 / math.sqrt(3)  # gaps 1, 3, 2 %: mean 2, sd 1
    assert fp8["gap_pct"] == pytest.approx(2.0) and fp8["gap_sd"] == pytest.approx(1.0)
    assert fp8["ci_lo"] == pytest.approx(2.0 - half) and fp8["ci_hi"] == pytest.approx(2.0 + half)
    assert fp8["method"] == "paired vs mean of bf16 replicates (3 seeds, 2 with 2 runs)"
    assert rows["bf16"]["mean"] == pytest.approx((1.01 + 2.00 + 1.00) / 3) and rows["bf16"]["runs"] == 5
    assert rows["bf16"]["method"] == "mean of its runs per seed (3 seeds, 2 with 2 runs)"
    reps = result["baseline_replicates"]
    assert reps["recipe"] == "bf16" and reps["runs_per_seed"] == {"1": 1, "2": 2}
    assert reps["losses"] == {"0": [1.00, 1.02], "1": [2.00, 2.00], "2": [1.00]}
    assert reps["runs"]["0"] == [f"bf16@seed=0 in {first}", f"bf16@seed=0 in {again}"]
    # the floor: second run vs first at seeds 0 and 1, +2 % and 0 %: mean 1, sd sqrt(2)
    floor = reps["floor"]
    assert floor["seeds"] == 2 and floor["gaps"] == pytest.approx({"0": 2.0, "1": 0.0})
    assert floor["gap_pct"] == pytest.approx(1.0) and floor["sd"] == pytest.approx(math.sqrt(2))
    assert floor["hi"] == pytest.approx(1.0 + 12.706204736174696)  # t(0.975, 1) sqrt(2) / sqrt(2)
    json.dumps(result)
    text = cr.to_markdown(result)
    assert text.startswith("Final validation loss at step 20; gap = recipe vs the mean of the `bf16` runs at the "
                           "same seed in %")
    assert "| gap vs mean of bf16 runs |" in text
    assert "| `bf16` | 3 (5 runs) | 1.3367 ± 0.5745 | baseline: mean of runs |  | mean of its runs per seed " \
           "(3 seeds, 2 with 2 runs) |" in text
    assert "| `fp8` | 3 | " in text and "| +2.00 % | [-0.48, +4.48] % | paired vs mean of bf16 replicates" in text
    assert "every recipe is paired with that mean, not with one run (3 seeds: 1 with 1 run, 2 with 2 runs; " \
           "5 runs)." in text
    assert "differs from the first by +1.00 % [-11.71, +13.71] % on average, with a standard deviation of " \
           "**1.41 %**" in text and "one run's own share is about 1.00 %" in text
    assert "The recipes' per-seed gaps' standard deviations: `fp8` 1.00 %." in text
    assert "| `bf16` (mean of runs) | 1.0100 | 2.0000 | 1.0000 |" in text
    assert "| `bf16` run 1 | 1.0000 | 2.0000 | 1.0000 |" in text and "| `bf16` run 2 | 1.0200 | 2.0000 |  |" in text


def test_one_bf16_run_per_file_is_paired_with_its_mean_exactly(tmp_path):
    """bf16@seed=0 at 1.00 and 1.02 in two files: the baseline is 1.01, and a recipe at 1.0201
    is +1.00 % from it (against either run alone: +2.01 % or +0.01 %)."""
    one = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.00, "fp8@seed=0": 1.0201})
    two = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": 1.02})
    fp8 = cr.analyze([one, two], baseline_replicates=True)["rows"][1]
    assert fp8["recipe"] == "fp8" and fp8["gap_pct"] == pytest.approx(1.0, abs=1e-12)
    assert fp8["method"] == "one shared seed: no interval; vs mean of bf16 replicates (1 seed, each with 2 runs)"


def test_bf16_in_two_files_is_refused_without_the_option_and_names_it(tmp_path):
    first, again = _replicated(tmp_path)
    with pytest.raises(ValueError, match=r"bf16@seed=0 is in both .*a\.jsonl\.gz and .*b\.jsonl\.gz.*--first-seed.*"
                                         r"pass --baseline-replicates"):
        cr.analyze([first, again])
    with pytest.raises(ValueError, match="--baseline-replicates"):
        cr.failed_runs([first, again])
    with pytest.raises(SystemExit, match="pass --baseline-replicates"):
        cr.main([str(first), str(again)])
    other = _write(tmp_path / "c.jsonl.gz", {"fp8@seed=0": 1.0})  # not the baseline: no word of the option
    with pytest.raises(ValueError, match=r"fp8@seed=0 is in both .*--first-seed\)\.$"):
        cr.analyze([first, other])


def test_a_recipe_in_two_files_is_refused_with_the_option(tmp_path):
    first, again = _replicated(tmp_path)
    twice = _write(tmp_path / "c.jsonl.gz", {"bf16@seed=2": 1.01, "fp8@seed=2": 1.03})
    with pytest.raises(ValueError, match=r"fp8@seed=2 is in both .*a\.jsonl\.gz and .*c\.jsonl\.gz.*Only bf16's "
                                         r"runs may be in several files \(--baseline-replicates\)"):
        cr.analyze([first, again, twice], baseline_replicates=True)


def test_seeds_may_have_different_numbers_of_baseline_runs(tmp_path):
    """Seed 0 with three runs (its third enters the mean, not the floor), seed 1 with one, seed 2
    with two; the method and the report count them."""
    a = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.00, "bf16@seed=1": 1.50, "bf16@seed=2": 2.00,
                                         "fp8@seed=0": 1.01 * 1.01, "fp8@seed=1": 1.50 * 1.02,
                                         "fp8@seed=2": 2.01 * 1.03, "mxfp8@seed=0": 1.01, "mxfp8@seed=2": 2.01})
    b = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": 1.01, "bf16@seed=2": 2.02})
    c = _write(tmp_path / "c.jsonl.gz", {"bf16@seed=0": 1.02})
    result = cr.analyze([a, b, c], baseline_replicates=True)
    rows = {r["recipe"]: r for r in result["rows"]}
    assert result["seeds"]["bf16"] == pytest.approx({"0": 1.01, "1": 1.50, "2": 2.01})
    assert rows["fp8"]["gap_pct"] == pytest.approx(2.0) and rows["fp8"]["gap_sd"] == pytest.approx(1.0)
    assert rows["fp8"]["method"] == "paired vs mean of bf16 replicates (3 seeds, 1 with 2 runs, 1 with 3 runs)"
    assert rows["mxfp8"]["gap_pct"] == pytest.approx(0.0, abs=1e-12)
    assert rows["mxfp8"]["method"] == "paired vs mean of bf16 replicates (2 seeds, 1 with 2 runs, 1 with 3 runs)"
    reps = result["baseline_replicates"]
    assert reps["runs_per_seed"] == {"1": 1, "2": 1, "3": 1} and reps["losses"]["0"] == [1.00, 1.01, 1.02]
    assert reps["floor"]["seeds"] == 2 and reps["floor"]["gaps"] == pytest.approx({"0": 1.0, "2": 1.0})
    assert reps["floor"]["sd"] == pytest.approx(0.0, abs=1e-9)
    text = cr.to_markdown(result)
    assert "(3 seeds: 1 with 1 run, 1 with 2 runs, 1 with 3 runs; 6 runs)" in text
    assert "| `bf16` run 3 | 1.0200 |  |  |" in text


def test_the_option_without_replicates_says_each_seed_has_one_run(tmp_path):
    result = cr.analyze(_study(tmp_path), baseline_replicates=True)
    rows = {r["recipe"]: r for r in result["rows"]}
    plain = {r["recipe"]: r for r in cr.analyze(_study(tmp_path))["rows"]}
    assert rows["fp8"]["gap_pct"] == plain["fp8"]["gap_pct"] and rows["fp8"]["ci_lo"] == plain["fp8"]["ci_lo"]
    assert rows["fp8"]["method"] == "paired vs mean of bf16 replicates (3 seeds, each with 1 run)"
    assert result["baseline_replicates"]["floor"] is None
    assert "No seed has two runs: no run-to-run floor." in cr.to_markdown(result)
    assert "baseline_replicates" not in cr.analyze(_study(tmp_path)) and "method" not in plain["bf16"]


def test_the_floor_is_what_convergence_replicates_measures(tmp_path):
    from bench.convergence_replicates import replicate_gaps
    first, again = _replicated(tmp_path)
    floor = cr.analyze([first, again], baseline_replicates=True)["baseline_replicates"]["floor"]
    pairs = replicate_gaps([first], [again])["bf16"]
    assert floor["sd"] == pytest.approx(pairs["sd"]) and floor["gap_pct"] == pytest.approx(pairs["gap_pct"])
    assert (floor["lo"], floor["hi"]) == pytest.approx((pairs["lo"], pairs["hi"]))


def test_the_committed_bf16_replicates_give_the_documented_floor():
    """bf16 at seeds 3-9 in two studies: the report's floor is bench.convergence_replicates'
    +0.51 % [-0.13, +1.15] with a standard deviation of 0.69 % (docs/convergence.md)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "docs/convergence"
    files = [root / f"gpt100m-{f}-446steps.metrics.jsonl.gz"
             for f in ("fp8block-mxfp8-seeds3-9", "4recipes-seeds3-8", "4recipes-seeds9-14")]
    result = cr.analyze(files, steps=446, baseline_replicates=True)
    floor = result["baseline_replicates"]["floor"]
    assert floor["seeds"] == 7 and result["baseline_replicates"]["runs_per_seed"] == {"1": 5, "2": 7}
    assert (round(floor["gap_pct"], 2), round(floor["lo"], 2), round(floor["hi"], 2), round(floor["sd"], 2)) == \
        (0.51, -0.13, 1.15, 0.69)
    assert {r["recipe"]: r["method"] for r in result["rows"]}["fp8-block"] == \
        "paired vs mean of bf16 replicates (7 seeds, each with 2 runs)"


def test_baseline_replicates_with_a_training_loss_window(tmp_path):
    """--train-window with replicates: each run's window mean, then the mean over a seed's runs."""
    def write(path, levels):
        with gzip.open(path, "wt") as f:
            for label, level in levels.items():
                for s in range(1, 11):
                    train = level + (0.1 if s % 2 else -0.1) if s > 6 else 9.0  # the window's mean is `level`
                    rec = {"step": s, "recipe": label, "train_loss": train}
                    if s == 10:
                        rec["val_loss"] = 5.0
                    f.write(json.dumps(rec) + "\n")
        return path
    first = write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 2.0, "fp8@seed=0": 2.02 * 1.01, "bf16@seed=1": 2.2,
                                            "fp8@seed=1": 2.2 * 1.03, "bf16@seed=2": 1.9, "fp8@seed=2": 1.9 * 1.02})
    again = write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": 2.04, "bf16@seed=1": 2.2})
    result = cr.analyze([first, again], train_window=4, baseline_replicates=True)
    rows = {r["recipe"]: r for r in result["rows"]}
    assert result["metric"] == "mean training loss over steps 7-10"
    assert result["seeds"]["bf16"] == pytest.approx({"0": 2.02, "1": 2.2, "2": 1.9})
    assert rows["fp8"]["gap_pct"] == pytest.approx(2.0) and rows["fp8"]["gap_sd"] == pytest.approx(1.0)
    assert result["baseline_replicates"]["losses"]["0"] == pytest.approx([2.0, 2.04])
    assert result["baseline_replicates"]["floor"]["gaps"] == pytest.approx({"0": 2.0, "1": 0.0})
    by_val = {r["recipe"]: r for r in cr.analyze([first, again], baseline_replicates=True)["rows"]}
    assert by_val["fp8"]["gap_pct"] == pytest.approx(0.0)


def test_replicates_of_two_corpora_are_refused(tmp_path):
    first, again = _replicated(tmp_path)
    _with_corpus(first, {k: "packages-aaa" for k in ("bf16@seed=0", "fp8@seed=0", "bf16@seed=1", "fp8@seed=1",
                                                     "bf16@seed=2", "fp8@seed=2")})
    _with_corpus(again, {"bf16@seed=0": "packages-bbb", "bf16@seed=1": "packages-bbb"})
    with pytest.raises(ValueError, match=r"different corpora .*packages-aaa.*bf16@seed=0 in .*a\.jsonl\.gz.*"
                                         r"packages-bbb.*bf16@seed=0 in .*b\.jsonl\.gz"):
        cr.analyze([first, again], baseline_replicates=True)
    _with_corpus(again, {"bf16@seed=0": "packages-aaa", "bf16@seed=1": "packages-aaa"})
    assert cr.analyze([first, again], baseline_replicates=True)["corpus"] == "packages-aaa"


def test_a_failed_replicate_fails_the_baseline_and_leaves_its_seeds_mean(tmp_path):
    """A bf16 replicate that stopped early is named and fails the baseline row, as any failed
    baseline run does; its seed's mean is that of the runs that completed."""
    first, _ = _replicated(tmp_path)
    stopped = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": 9.0}, steps=(0, 10))
    result = cr.analyze([first, stopped], steps=20, baseline_replicates=True)
    rows = {r["recipe"]: r for r in result["rows"]}
    run = f"bf16@seed=0 in {stopped}"
    assert rows["bf16"]["verdict"] == "failed" and rows["bf16"]["failed_runs"] == {run: "stopped at step 10"}
    assert result["incomplete"] == [run] and result["seeds"]["bf16"]["0"] == 1.00
    assert rows["fp8"]["gap_pct"] == pytest.approx((2.01 + 3 + 2) / 3) and rows["fp8"]["verdict"] != "failed"
    assert f"`{run}` (stopped at step 10)" in cr.to_markdown(result)


def test_the_command_line_takes_baseline_replicates(tmp_path, capsys):
    first, again = _replicated(tmp_path)
    cr.main([str(first), str(again), "--baseline-replicates", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "paired vs mean of bf16 replicates (3 seeds, 2 with 2 runs)" in out and "Run-to-run floor" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["baseline_replicates"]["losses"]["0"] == [1.00, 1.02]


def test_a_dropped_baseline_label_drops_each_of_its_replicates(tmp_path):
    """With replicates a baseline run is named by its file: a label the plan dropped (``dropped``,
    keyed by label) still leaves every run of it out of its seed's mean."""
    a = _write(tmp_path / "a.jsonl.gz", {"bf16@seed=0": 1.00, "fp8@seed=0": 1.02, "bf16@seed=1": 2.0,
                                          "fp8@seed=1": 2.04})
    b = _write(tmp_path / "b.jsonl.gz", {"bf16@seed=0": 1.04})
    r = cr.analyze([a, b], dropped={"bf16@seed=0": "dropped at the probe"}, baseline_replicates=True)
    assert r["seeds"]["bf16"] == {"1": 2.0}
    assert sorted(r["incomplete"]) == sorted(f"bf16@seed=0 in {p}" for p in (a, b))


def test_two_runs_of_one_label_concatenated_into_one_file_are_refused(tmp_path):
    """The trainer writes one step-0 record a run: a second one in a file is another run's, and
    merging the two would report a loss from one trajectory as the other's."""
    path = tmp_path / "cat.jsonl"
    for finals in ({"bf16@seed=0": 1.04, "fp8@seed=0": 1.05}, {"bf16@seed=0": 1.10}):
        with open(path, "a") as f:
            f.write(gzip.decompress(_write(tmp_path / "part.jsonl.gz", finals).read_bytes()).decode())
    with pytest.raises(ValueError, match=r"run bf16@seed=0 starts twice .*a file of its own"):
        cr.analyze([path])
    with pytest.raises(ValueError, match="starts twice"):
        cr.analyze([path], baseline_replicates=True)
