"""The per-image measures behind the report's findings and intervals, checked against the records.

* :func:`robust_attn.reports.comparison.per_image_losses`: every measure (``pgd_drop``,
  ``pgd_success``, ``shift_drop``, ``attack_drop``, ``rotation_drop``) per image equals the same
  quantity computed here from the records with pandas.
* :func:`robust_attn.reports.agreement.rank_agreement`: a flipped pair is resolved only when
  BOTH measures separate it; Kendall's tau has the right sign.
* ``headline_ci.csv``: a drop's interval is the bootstrap of the PAIRED per-image differences.

Runs are hand-made: records written with the run store (:meth:`robust_attn.runs.store.RunStore.open`,
:meth:`~robust_attn.runs.store.RunStore.write_chunk`) and read back as a report reads them, so no
model is evaluated and every test takes well under a second.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from robust_attn.reports import make_report
from robust_attn.reports.agreement import agreement_lines, rank_agreement
from robust_attn.reports.comparison import compare_models, per_image_losses
from robust_attn.reports.stats import bootstrap_mean_ci
from robust_attn.reports.runs import load_runs
from robust_attn.reports.tables import headline_ci
from robust_attn.runs.store import RunStore

DATASET = {"name": "synthetic", "split": "test", "limit": None}
IMAGES = json.dumps(DATASET, sort_keys=True)       # the image-set key of per_image_losses
PGD_SETTINGS = ("pgd_eps8_step4_n2", "pgd_eps8_step2_n4")
CORRUPTIONS = ("fog_s1", "fog_s3", "gaussian_noise_s5")
ROTATIONS = ("none", "cw90", "cw180", "cw270", "flip_ud")


def _write_run(root, protocol: str, model: str, conditions: list[dict], records: dict[str, pd.DataFrame],
               chunk: int = 32):
    """A finished run directory: ``records[condition]`` (one row per image, ``index`` 0..n-1)
    written in chunks of ``chunk`` images, as a protocol writes them."""
    n = len(next(iter(records.values())))
    store = RunStore(root)
    store.open({"model": model, "dataset": DATASET, "checkpoint": None, "init_seed": 0, "protocol": protocol,
                "parameters": {}, "conditions": conditions, "num_images": n, "chunk_size": chunk})
    for c in conditions:
        frame = records[c["name"]]
        assert list(frame["index"]) == list(range(n))
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            store.write_chunk(c["name"], start, stop, frame.iloc[start:stop].reset_index(drop=True))
    return root


def _predictions(rng, labels: np.ndarray, hit: float, other: float, targets: np.ndarray | None = None):
    """Predictions hitting the label with probability ``hit``, else the target (when given) with
    probability ``other`` / (1 - hit) of the rest, else a wrong class that is not the target."""
    u = rng.random(len(labels))
    wrong = (labels + 1 + rng.integers(0, 8, len(labels))) % 10
    if targets is not None:
        wrong = np.where(wrong == targets, (wrong + 1) % 10, wrong)
        wrong = np.where(wrong == labels, (wrong + 1) % 10, wrong)
        wrong = np.where(wrong == targets, (wrong + 1) % 10, wrong)
    pred = np.where(u < hit, labels, wrong)
    if targets is not None:
        pred = np.where((u >= hit) & (u < hit + other), targets, pred)
    return pred


# --- gap 1: per-image measures against the records -------------------------------------------
N1 = 60
MODELS1 = {"resnet26": (0.80, 0.50, 0.30), "sasa_resnet26": (0.70, 0.45, 0.10), "san10_pairwise": (0.90, 0.20, 0.40)}


@pytest.fixture(scope="module")
def measure_runs(tmp_path_factory):
    """PGD (clean + two settings), corruption (clean + three unequal corruptions) and attack
    runs of three models on the same 60 images; returns (run dirs, records per run)."""
    root = tmp_path_factory.mktemp("measures")
    rng = np.random.default_rng(11)
    labels = rng.integers(0, 10, N1)
    targets = (labels + 1 + rng.integers(0, 9, N1)) % 10
    dirs, written = [], {}
    for m, (clean_rate, attacked_rate, success_rate) in MODELS1.items():
        # PGD: pred == label is a hit, pred == target a success
        pgd = {}
        for k, cond in enumerate(("clean",) + PGD_SETTINGS):
            hit = clean_rate if cond == "clean" else attacked_rate / (k + 1)
            pred = _predictions(rng, labels, hit, 0.0 if cond == "clean" else success_rate * k, targets)
            pgd[cond] = pd.DataFrame({"index": range(N1), "label": labels, "target": targets, "pred": pred,
                                      "top1": (pred == labels).astype(int), "success": (pred == targets).astype(int),
                                      "top5": 1, "linf": 0.0 if cond == "clean" else 8.0})
        conditions = [{"name": "clean", "eps": 0.0, "step": 0.0, "steps": 0}]
        conditions += [{"name": s, "eps": 8.0, "step": float(s.split("step")[1][0]), "steps": int(s[-1])}
                       for s in PGD_SETTINGS]
        dirs.append(_write_run(root / f"pgd-{m}", "pgd", m, conditions, pgd))
        written[("pgd", m)] = pgd
        # corruption: three shifted conditions with clearly different hit rates
        shift = {}
        for cond, hit in zip(("clean",) + CORRUPTIONS, (clean_rate, 0.7, 0.4, 0.1)):
            pred = _predictions(rng, labels, hit, 0.0)
            shift[cond] = pd.DataFrame({"index": range(N1), "label": labels, "pred": pred,
                                        "top1": (pred == labels).astype(int), "top5": 1})
        conditions = [{"name": "clean", "corruption": "clean", "severity": 0}]
        conditions += [{"name": c, "corruption": c.rsplit("_s", 1)[0], "severity": int(c[-1])} for c in CORRUPTIONS]
        dirs.append(_write_run(root / f"corruption-{m}", "corruption", m, conditions, shift))
        written[("corruption", m)] = shift
        # evaluation attack: clean and one attack
        attack = {}
        for cond, hit in (("clean", clean_rate), ("autoattack_linf_eps8", attacked_rate / 3)):
            pred = _predictions(rng, labels, hit, 0.0)
            attack[cond] = pd.DataFrame({"index": range(N1), "label": labels, "pred": pred,
                                         "top1": (pred == labels).astype(int)})
        conditions = [{"name": "clean", "attack": "none", "eps": 0.0},
                      {"name": "autoattack_linf_eps8", "attack": "autoattack", "norm": "linf", "eps": 8 / 255}]
        dirs.append(_write_run(root / f"attack-{m}", "attack", m, conditions, attack))
        written[("attack", m)] = attack
        # rotation: Table 9's five conditions, the left-right flip and one angle of the sweep, each
        # with its own hit rate (the last two are not among Table 9's rotations)
        rotation = {}
        for cond, hit in zip(ROTATIONS + ("flip_lr", "angle30"), (clean_rate, 0.3, 0.5, 0.2, 0.45, 0.75, 0.6)):
            pred = _predictions(rng, labels, hit, 0.0)
            rotation[cond] = pd.DataFrame({"index": range(N1), "label": labels, "pred": pred,
                                           "top1": (pred == labels).astype(int), "top5": 1})
        conditions = [{"name": c, "kind": "identity" if c == "none" else "rot90" if c.startswith("cw") else
                       "angle" if c.startswith("angle") else c, "angle": float(c[2:]) if c.startswith("cw") else
                       30.0 if c == "angle30" else 0.0} for c in rotation]
        dirs.append(_write_run(root / f"rotation-{m}", "rotation", m, conditions, rotation))
        written[("rotation", m)] = rotation
    return dirs, written


def _column(records: dict[str, pd.DataFrame], condition: str, column: str = "top1") -> pd.Series:
    return records[condition].set_index("index")[column].astype(float)


def _expected_measures(written) -> dict[str, pd.DataFrame]:
    """Every measure per image (image index x model), computed here from the records."""
    expected: dict[str, dict[str, pd.Series]] = {}
    for m in MODELS1:
        pgd, shift, attack = written[("pgd", m)], written[("corruption", m)], written[("attack", m)]
        for s in PGD_SETTINGS:
            expected.setdefault(f"pgd_drop:{s}", {})[m] = _column(pgd, "clean") - _column(pgd, s)
            expected.setdefault(f"pgd_success:{s}", {})[m] = _column(pgd, s, "success")
        shifted = pd.concat([_column(shift, c) for c in CORRUPTIONS], axis=1).sum(axis=1) / len(CORRUPTIONS)
        expected.setdefault("shift_drop:corruption", {})[m] = _column(shift, "clean") - shifted
        expected.setdefault("attack_drop:autoattack_linf_eps8", {})[m] = (
            _column(attack, "clean") - _column(attack, "autoattack_linf_eps8"))
        rotation = written[("rotation", m)]
        rotated = sum(_column(rotation, c) for c in ("cw90", "cw180", "cw270", "flip_ud")) / 4
        expected.setdefault("rotation_drop", {})[m] = _column(rotation, "none") - rotated
    return {k: pd.DataFrame(v) for k, v in expected.items()}


def test_the_records_are_not_degenerate(measure_runs):
    """The fixture's records tell the mutations apart: attacked hits differ from clean ones, the
    three corruptions differ from each other, and success is not a function of the hits."""
    _, written = measure_runs
    for m in MODELS1:
        pgd, shift = written[("pgd", m)], written[("corruption", m)]
        for s in PGD_SETTINGS:
            drop = _column(pgd, "clean") - _column(pgd, s)
            assert (drop > 0).any() and drop.mean() > 0.05
            assert 0 < pgd[s]["success"].mean() < 1
            assert ((pgd[s]["success"] == 1) & (pgd[s]["top1"] == 0)).any()
        means = [shift[c]["top1"].mean() for c in CORRUPTIONS]
        assert len(set(means)) == 3
        assert (shift[CORRUPTIONS[0]]["top1"] != shift[CORRUPTIONS[1]]["top1"]).any()


def test_per_image_losses_match_the_records(measure_runs):
    dirs, written = measure_runs
    runs = load_runs(dirs)
    losses = per_image_losses(runs)
    expected = _expected_measures(written)
    assert set(losses) == {(IMAGES, k) for k in expected}
    for key, frame in expected.items():
        got = losses[(IMAGES, key)]
        assert sorted(got.columns) == sorted(MODELS1) and list(got.index) == list(range(N1)), key
        pd.testing.assert_frame_equal(got[sorted(MODELS1)].astype(float), frame[sorted(MODELS1)],
                                      check_names=False, check_index_type=False, obj=key)


@pytest.mark.parametrize("key", [f"pgd_drop:{PGD_SETTINGS[1]}", f"pgd_success:{PGD_SETTINGS[0]}",
                                 "shift_drop:corruption"])
def test_each_measure_per_image(measure_runs, key):
    """Per model and image, spelled out: the drop is clean hit minus attacked (or mean shifted)
    hit, the success the records' success column."""
    dirs, written = measure_runs
    got = per_image_losses(load_runs(dirs))[(IMAGES, key)]
    for m in MODELS1:
        for i in range(N1):
            if key.startswith("pgd_drop:"):
                rec = written[("pgd", m)]
                want = rec["clean"]["top1"][i] - rec[key.split(":")[1]]["top1"][i]
            elif key.startswith("pgd_success:"):
                want = written[("pgd", m)][key.split(":")[1]]["success"][i]
            else:
                rec = written[("corruption", m)]
                want = rec["clean"]["top1"][i] - np.mean([rec[c]["top1"][i] for c in CORRUPTIONS])
            assert got.loc[i, m] == pytest.approx(want, abs=1e-12), (m, i)


def test_the_comparison_means_are_the_records_means(measure_runs):
    """compare_models reports 100 x the per-image mean of each measure, in points (or %)."""
    dirs, written = measure_runs
    table = compare_models(load_runs(dirs), n_boot=20, seed=0).set_index(["measure", "model"])
    for key, frame in _expected_measures(written).items():
        for m in MODELS1:
            assert table.loc[(key, m), "value"] == pytest.approx(100 * frame[m].mean()), (key, m)
    # the headline PGD drop is positive for every model (clean beats attacked here)
    assert (table.xs(f"pgd_drop:{PGD_SETTINGS[1]}", level="measure")["value"] > 0).all()


# --- gap 2: a flip is resolved only when both measures separate the pair -----------------------
N2 = 3000


def _exact_losses(rates: dict[str, float], seed: int) -> pd.DataFrame:
    """0/1 losses: each model loses on exactly ``round(rate * N2)`` images, drawn independently."""
    rng = np.random.default_rng(seed)
    out = {}
    for m, r in rates.items():
        loses = np.zeros(N2)
        loses[rng.permutation(N2)[:round(r * N2)]] = 1.0
        out[m] = loses
    return pd.DataFrame(out)


# A: r < s < t < u, every neighbour clearly separated. B: s and r swap by half a point (a tie: a
# paired interval of about +-2.3 points) and t and u swap by 20 points (separated).
RATES_A = {"r": 0.10, "s": 0.30, "t": 0.50, "u": 0.70}
RATES_B = {"r": 0.305, "s": 0.30, "t": 0.90, "u": 0.70}


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_a_flip_separated_by_one_measure_only_is_not_resolved(order):
    a, b = _exact_losses(RATES_A, 5), _exact_losses(RATES_B, 6)
    first, second = (a, b) if order == "ab" else (b, a)
    result = rank_agreement(first, second, n_boot=300, seed=0)
    assert result.paired
    flips = {(f["model_1"], f["model_2"]): f for f in result.flips}
    assert set(flips) == {("r", "s"), ("t", "u")}
    # the premise: r/s is clearly separated under A, tied under B; t/u separated under both
    ci = {name: bootstrap_mean_ci(frame["r"] - frame["s"], n_boot=300, seed=0) for name, frame in (("a", a), ("b", b))}
    assert ci["a"].high < -15 and ci["b"].low < 0 < ci["b"].high
    assert ci["b"].value == pytest.approx(0.5)
    rs, tu = flips[("r", "s")], flips[("t", "u")]
    diff_rs_a, diff_rs_b = (rs["diff_a"], rs["diff_b"]) if order == "ab" else (rs["diff_b"], rs["diff_a"])
    assert diff_rs_a == pytest.approx(-20) and diff_rs_b == pytest.approx(0.5)
    assert rs["resolved"] is False                     # separated by one measure only: noise
    assert tu["resolved"] is True                      # separated by both: a finding
    assert [(f["model_1"], f["model_2"]) for f in result.resolved_flips] == [("t", "u")]
    text = "\n".join(agreement_lines("A", "B", result))
    assert "2 of 6 pairs change order, 1 of them resolved" in text
    assert "t minus u" in text and "r minus s" not in text
    # ranks (1, 2, 3, 4) against (2, 1, 4, 3): 4 concordant, 2 discordant pairs
    assert result.tau == pytest.approx(1 / 3)


def test_kendall_tau_is_negative_for_reversed_rankings():
    a = _exact_losses({"r": 0.10, "s": 0.30, "t": 0.50, "u": 0.70}, 7)
    b = _exact_losses({"r": 0.70, "s": 0.50, "t": 0.30, "u": 0.10}, 8)
    result = rank_agreement(a, b, n_boot=200, seed=0)
    assert result.tau == -1.0
    assert result.low <= result.high < 0
    assert len(result.flips) == 6 and all(f["resolved"] for f in result.flips)
    same = rank_agreement(a, _exact_losses({"r": 0.20, "s": 0.40, "t": 0.60, "u": 0.80}, 9), n_boot=200, seed=0)
    assert same.tau == 1.0 and same.low > 0 and same.flips == []


# --- gap 3: a drop's interval is bootstrapped over paired per-image differences ----------------
N3 = 400


@pytest.fixture(scope="module")
def rotation_run(tmp_path_factory):
    """One rotation run: 70% clean hits; each rotated condition the clean hits with a few flips
    (cw90: 12 hits lost, 2 misses gained)."""
    root = tmp_path_factory.mktemp("rotation")
    rng = np.random.default_rng(3)
    none = (rng.random(N3) < 0.7).astype(int)
    hits = {"none": none}
    for cond, lost in zip(ROTATIONS[1:], (12, 10, 16, 14)):
        flipped = none.copy()
        flipped[rng.choice(np.flatnonzero(none == 1), lost, replace=False)] = 0
        flipped[rng.choice(np.flatnonzero(none == 0), 2, replace=False)] = 1
        hits[cond] = flipped
    records = {c: pd.DataFrame({"index": range(N3), "label": 0, "pred": 1 - h, "top1": h, "top5": 1})
               for c, h in hits.items()}
    kinds = {"none": ("identity", 0), "cw90": ("rot90", 90), "cw180": ("rot90", 180), "cw270": ("rot90", 270),
             "flip_ud": ("flip_ud", 0)}
    conditions = [{"name": c, "kind": kinds[c][0], "angle": kinds[c][1]} for c in ROTATIONS]
    return _write_run(root / "rot", "rotation", "resnet26", conditions, records, chunk=64), hits


def test_headline_drop_interval_is_the_paired_bootstrap(rotation_run):
    path, hits = rotation_run
    ci = headline_ci(load_runs([path])).set_index("metric")   # the report's defaults: 1000 resamples, seed 0
    for cond in ROTATIONS[1:]:
        paired = bootstrap_mean_ci(hits["none"] - hits[cond], n_boot=1000, seed=0, level=0.95)
        row = ci.loc[f"{cond}_top1_drop"]
        assert (row["value"], row["low"], row["high"]) == pytest.approx((paired.value, paired.low, paired.high),
                                                                        abs=1e-9), cond
        assert row["value"] == pytest.approx(100 * (hits["none"].mean() - hits[cond].mean()))
        assert row["low"] > 0     # a few flips out of 400 images: the paired drop is resolved
        # the paired drop is far narrower than the rotated accuracy's own interval
        own = ci.loc[f"{cond}_top1"]
        assert row["high"] - row["low"] < 0.6 * (own["high"] - own["low"]), cond


def test_headline_ci_csv_gives_the_paired_drop_interval(rotation_run, tmp_path):
    """The written headline_ci.csv, with the report's own bootstrap arguments (seed, resamples)."""
    path, hits = rotation_run
    make_report([path], tmp_path, n_boot=400, seed=5, plots=False)
    ci = pd.read_csv(tmp_path / "headline_ci.csv").set_index("metric")
    drop, acc = ci.loc["cw90_top1_drop"], ci.loc["cw90_top1"]
    paired = bootstrap_mean_ci(hits["none"] - hits["cw90"], n_boot=400, seed=5, level=0.95)
    assert (drop["value"], drop["low"], drop["high"]) == pytest.approx((paired.value, paired.low, paired.high),
                                                                       abs=1e-4)   # the CSV keeps 4 decimals
    assert (drop["n_boot"], drop["n"]) == (400, N3)
    assert drop["high"] - drop["low"] < acc["high"] - acc["low"]
