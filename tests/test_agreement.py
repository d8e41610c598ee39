"""Rank agreement between robustness measures (robust_attn.reports.agreement): Kendall's tau
against a brute-force count written here, flips resolved only when both measures separate the
pair, and the report section built from pgd and attack runs."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from robust_attn.reports.agreement import agreement_lines, kendall_tau, rank_agreement
from robust_attn.reports.comparison import agreement_findings


def tau_b_by_counting(a, b) -> float:
    """Kendall's tau-b from its definition: (concordant - discordant) / sqrt((n0 - t_a)(n0 - t_b))."""
    n = len(a)
    concordant = discordant = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            sa, sb = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
            ties_a += sa == 0
            ties_b += sb == 0
            if sa * sb > 0:
                concordant += 1
            elif sa * sb < 0:
                discordant += 1
    n0 = n * (n - 1) / 2
    return (concordant - discordant) / math.sqrt((n0 - ties_a) * (n0 - ties_b))


@pytest.mark.parametrize("seed", range(6))
def test_kendall_tau_matches_the_definition_with_ties(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 4, 7).astype(float), rng.integers(0, 4, 7).astype(float)
    if len(set(a)) == 1 or len(set(b)) == 1:
        assert math.isnan(kendall_tau(a, b))
    else:
        assert kendall_tau(a, b) == pytest.approx(tau_b_by_counting(a, b))


def test_kendall_tau_extremes():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    with pytest.raises(ValueError, match="one length"):
        kendall_tau([1, 2], [1, 2, 3])


def _losses(rates: dict[str, float], n: int, seed: int) -> pd.DataFrame:
    """0/1 losses per image: each model misses a fixed fraction of the images, drawn at random."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({m: (rng.random(n) < r).astype(float) for m, r in rates.items()})


def test_same_order_gives_tau_one_and_no_flips():
    a = _losses({"r": 0.1, "s": 0.3, "t": 0.5, "u": 0.7}, 2000, 0)
    b = _losses({"r": 0.2, "s": 0.4, "t": 0.6, "u": 0.8}, 2000, 1)
    result = rank_agreement(a, b, n_boot=200)
    assert result.tau == 1.0 and result.flips == [] and result.paired
    assert result.low > 0.5


def test_a_clear_swap_is_a_resolved_flip_and_a_tie_is_not():
    a = _losses({"r": 0.10, "s": 0.30, "t": 0.50, "u": 0.51}, 4000, 2)
    b = _losses({"r": 0.30, "s": 0.10, "t": 0.51, "u": 0.50}, 3000, 3)   # r/s swap clearly; t/u are a tie
    result = rank_agreement(a, b, n_boot=300)
    assert not result.paired and (result.n_a, result.n_b) == (4000, 3000)
    flips = {(f["model_1"], f["model_2"]): f for f in result.flips}
    assert flips[("r", "s")]["resolved"]
    assert flips[("r", "s")]["diff_a"] < -10 and flips[("r", "s")]["diff_b"] > 10   # points
    assert all(not f["resolved"] for pair, f in flips.items() if pair != ("r", "s"))
    text = "\n".join(agreement_lines("A", "B", result))
    assert "r minus s" in text and "1 of them resolved" in text


def test_fewer_than_two_shared_models_is_an_error():
    with pytest.raises(ValueError, match="at least 2 models"):
        rank_agreement(pd.DataFrame({"r": [0.0]}), pd.DataFrame({"s": [1.0]}))


def _run(protocol, model, conditions: dict[str, list[int]], limit=None):
    """A finished run as the report sees it: per-image top1 records for each condition."""
    rows = []
    for condition, hits in conditions.items():
        rows += [{"condition": condition, "index": i, "top1": h, "success": 0} for i, h in enumerate(hits)]
    return SimpleNamespace(protocol=protocol, model=model, dataset="synthetic", records=pd.DataFrame(rows),
                           description={"dataset": {"name": "synthetic", "split": "test", "limit": limit}})


def test_report_section_compares_table10_with_each_attack():
    rng = np.random.default_rng(0)
    n = 400
    clean = {m: (rng.random(n) < 0.9).astype(int) for m in "pqrs"}
    # Table 10 keeps p > q > r > s; AutoAttack fools every image of every model but p
    weak = {"p": 0.8, "q": 0.6, "r": 0.4, "s": 0.2}
    runs = []
    for m in "pqrs":
        pgd = clean[m] * (rng.random(n) < weak[m])
        runs.append(_run("pgd", m, {"clean": clean[m], "pgd_eps8_step2_n4": pgd}))
        survives = rng.random(200) < (0.5 if m == "p" else 0.0)
        strong = (clean[m][:200] * survives).astype(int)
        runs.append(_run("attack", m, {"clean": clean[m][:200], "autoattack_linf_eps8": strong}, limit=200))
    lines = agreement_findings(runs, n_boot=200)
    text = "\n".join(lines)
    assert "targeted PGD (eps 8, step 2, n 4)" in text and "AutoAttack 8/255" in text
    assert "resampled separately: 400 and 200 images" in text
    assert "Kendall's tau" in text


def test_report_section_compares_rotation_with_each_shift():
    rng = np.random.default_rng(1)
    n, runs = 300, []
    for m, keep in zip("pqrs", (0.2, 0.4, 0.6, 0.8)):
        clean = (rng.random(n) < 0.9).astype(int)
        rotated = {c: clean * (rng.random(n) < keep) for c in ("cw90", "cw180", "cw270", "flip_ud")}
        runs.append(_run("rotation", m, {"none": clean, **rotated}))
        shifted = {f"fog_s{s}": clean * (rng.random(n) < keep) for s in (1, 3)}
        runs.append(_run("corruption", m, {"clean": clean, **shifted}))
    text = "\n".join(agreement_findings(runs, n_boot=200))
    assert "rotation: mean top-1 drop" in text and "corruption: mean top-1 drop over every shifted condition" in text
    assert "paired over the same images" in text
