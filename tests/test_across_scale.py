"""The findings of one zoo tested in another (robust_attn/reports/across_scale.py, `robust-attn
report --compare-zoo`), on two hand-made zoos whose answers are known by construction:

* rotation: in both zoos SAN10 pairwise loses nothing and ResNet-26 half of its images -> holds;
* Table 10's PGD: SAN10 pairwise loses more than ResNet-26 in zoo A, less in zoo B -> flips;
* APGD-CE at 1/255: the two models have the same hits image by image in zoo A (a difference of
  exactly 0, whose interval covers 0) and SAN10 pairwise is worse in zoo B -> unresolved.

Zoo B labels its models differently (``*-efficient``); they are matched by architecture. Runs are
written with the run store and read back as the command reads them; no model is evaluated.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from robust_attn.cli import main
from robust_attn.protocols.pgd import PAPER_SETTINGS
from robust_attn.reports.across_scale import (FINDINGS, across_verdict, check_finding, compare_zoos, load_zoo,
                                              measure_losses)
from robust_attn.reports.comparison import ROTATED
from robust_attn.reports.stats import bootstrap_mean_ci
from robust_attn.runs.store import RunStore

N = 200
TABLE10 = PAPER_SETTINGS[1].name
MODELS = ("resnet26", "san10_pairwise", "sasa_resnet26")
HALF = (np.arange(N) < N // 2).astype(int)             # hit on the first half of the images only
QUARTER = (np.arange(N) < N // 4).astype(int)
THREE_QUARTERS = (np.arange(N) < 3 * N // 4).astype(int)
EVERY, NONE = np.ones(N, dtype=int), np.zeros(N, dtype=int)


def _write(root, protocol: str, model: str, label: str, hits: dict[str, np.ndarray]):
    """A finished run of ``protocol``: per condition, top-1 hits per image (labels all 0)."""
    store = RunStore(root)
    conditions = [{"name": name} for name in hits]
    store.open({"model": label, "arch": {"name": model}, "dataset": {"name": "synthetic", "split": "test",
                                                                      "limit": None},
                "protocol": protocol, "parameters": {}, "conditions": conditions, "num_images": N,
                "chunk_size": N, "checkpoint": {"path": f"{label}.safetensors", "sha256": label}})
    for name, top1 in hits.items():
        frame = pd.DataFrame({"index": np.arange(N), "label": 0, "pred": 1 - top1, "top1": top1})
        store.write_chunk(name, 0, N, frame)


def _zoo(root, table10: dict[str, np.ndarray], apgd: dict[str, np.ndarray], suffix: str = ""):
    """Rotation, Table 10 and APGD-CE runs of the three models; ``table10`` and ``apgd``: each
    model's hits under the attack (clean: every image)."""
    rotation = {"resnet26": HALF, "san10_pairwise": EVERY, "sasa_resnet26": THREE_QUARTERS}
    for model in MODELS:
        label = model + suffix
        _write(root / f"rotation-{label}", "rotation", model, label,
               {"none": EVERY, **{c: rotation[model] for c in ROTATED}})
        _write(root / f"pgd-{label}", "pgd", model, label, {"clean": EVERY, TABLE10: table10[model]})
        _write(root / f"apgd-{label}", "attack", model, label, {"clean": EVERY, "apgd-ce_linf_eps1": apgd[model]})
    return root


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoos")
    shuffled = np.random.default_rng(0).permutation(HALF)   # half the images, not the same half as HALF
    a = _zoo(root / "a", table10={"resnet26": HALF, "san10_pairwise": QUARTER, "sasa_resnet26": HALF},
             apgd={"resnet26": shuffled, "san10_pairwise": shuffled, "sasa_resnet26": QUARTER})
    b = _zoo(root / "b", table10={"resnet26": QUARTER, "san10_pairwise": HALF, "sasa_resnet26": HALF},
             apgd={"resnet26": HALF, "san10_pairwise": NONE, "sasa_resnet26": QUARTER}, suffix="-efficient")
    return a, b


def _finding(key: str):
    return next(f for f in FINDINGS if f.key == key)


def test_measures_are_per_image_losses_named_by_architecture(zoos):
    runs = load_zoo([zoos[1]])
    rotation = measure_losses(runs, _finding("rotation_vs_resnet26").measures[0])
    assert list(rotation.columns) == sorted(MODELS) and len(rotation) == N   # labels "-efficient" dropped
    # the drop from the upright image to the mean over Table 9's four rotations, image by image
    np.testing.assert_array_equal(rotation["resnet26"].to_numpy(), 1 - HALF)
    np.testing.assert_array_equal(rotation["san10_pairwise"].to_numpy(), NONE)
    # an attack's loss is its error: one minus the attacked top-1
    apgd = measure_losses(runs, _finding("apgd1_vs_resnet26").measures[0])
    np.testing.assert_array_equal(apgd["san10_pairwise"].to_numpy(), EVERY)


def test_one_finding_holds_one_flips_one_is_unresolved(zoos):
    table = compare_zoos(load_zoo([zoos[0]]), load_zoo([zoos[1]]), n_boot=300)
    verdict = table.drop_duplicates("finding").set_index("finding")["across"]
    assert verdict["rotation_vs_resnet26"] == "holds"
    assert verdict["table10_vs_resnet26"] == "flips"
    assert verdict["apgd1_vs_resnet26"] == "unresolved"
    by = table.set_index(["finding", "zoo"])
    assert by.loc[("table10_vs_resnet26", "reference"), "verdict"] == "yes"
    assert by.loc[("table10_vs_resnet26", "other"), "verdict"] == "no"
    assert by.loc[("apgd1_vs_resnet26", "reference"), "verdict"] == "unresolved"
    assert by.loc[("apgd1_vs_resnet26", "other"), "verdict"] == "yes"
    assert set(table["dataset"]) == {"synthetic"}   # each zoo's runs', for whoever reads the CSV alone
    # the statistic: resnet26's rotation drop minus san10_pairwise's, in points (0.5 - 0), with the
    # interval of the PAIRED per-image difference
    row = by.loc[("rotation_vs_resnet26", "other")]
    paired = bootstrap_mean_ci((1 - HALF) - NONE, n_boot=300)
    assert (row["value"], row["low"], row["high"]) == pytest.approx((50.0, paired.low, paired.high))
    assert row["detail"] == "resnet26 minus san10_pairwise" and row["n"] == N
    # zoo A's APGD-CE: the same hits image by image, so exactly 0 with the interval [0, 0]
    row = by.loc[("apgd1_vs_resnet26", "reference")]
    assert (row["value"], row["low"], row["high"]) == (0.0, 0.0, 0.0)
    # a finding on protocols the zoos did not run is said to be not measured, in both
    assert (by.loc[("noise_jpeg_most", "other"), "verdict"], verdict["noise_jpeg_most"]) == ("not measured",) * 2


def test_a_group_is_compared_at_its_closest_pair(zoos):
    runs = load_zoo([zoos[1]])
    # "SAN10 pairwise loses the least to rotation of all": against the runner-up, sasa (drop 0.25),
    # not resnet26 (drop 0.5)
    finding = _finding("rotation_least")
    result = check_finding(finding, {m: measure_losses(runs, m) for m in finding.measures}, n_boot=100)
    assert result["detail"] == "sasa_resnet26 minus san10_pairwise; 2 of 2 pairs resolved as the claim says"
    assert result["value"] == pytest.approx(25.0) and result["verdict"] == "yes"


def test_a_group_is_decided_by_every_pair_and_shows_the_pair_that_decides_it():
    """"a loses the least of all" on 100 images. b, the runner-up by point estimate, loses more
    than a on 10 images and never less (resolved), but c, behind b on average, loses more on 56
    images and less on 44 (its interval covers 0): unresolved, shown at c. With c losing every
    image: yes, shown at the runner-up b. And with b level with a on average but scattered (its
    interval covers 0) while c loses less than a on every tenth image: no, shown at c."""
    import dataclasses

    index = np.arange(100)
    a = (index < 44).astype(float)
    b = a + ((index >= 44) & (index < 54))
    c = (index >= 44).astype(float)
    frame = pd.DataFrame({"a": a, "b": b, "c": c})
    assert frame.mean()["a"] < frame.mean()["b"] < frame.mean()["c"]
    finding = dataclasses.replace(_finding("rotation_least"), better=("a",), worse=("*",))
    result = check_finding(finding, {finding.measures[0]: frame}, n_boot=300)
    assert bootstrap_mean_ci(b - a, n_boot=300).low > 0        # the closest pair alone would say yes
    assert result["verdict"] == "unresolved" and result["value"] == pytest.approx(12.0)
    assert result["low"] < 0 < result["high"]                  # the cell's interval covers 0, as the legend says
    assert result["detail"] == "c minus a; 1 of 2 pairs resolved as the claim says"
    frame["c"] = 1.0
    resolved = check_finding(finding, {finding.measures[0]: frame}, n_boot=300)
    assert resolved["verdict"] == "yes" and resolved["low"] > 0
    assert resolved["detail"] == "b minus a; 2 of 2 pairs resolved as the claim says"
    a = np.ones(100) * 0.5
    frame = pd.DataFrame({"a": a, "b": np.where(index % 2 == 0, 0.0, 1.0), "c": np.where(index % 10 == 0, 0.0, 0.5)})
    assert frame.mean()["b"] - frame.mean()["a"] == 0 > frame.mean()["c"] - frame.mean()["a"]
    against = check_finding(finding, {finding.measures[0]: frame}, n_boot=300)
    assert against["verdict"] == "no" and against["high"] < 0 and against["value"] == pytest.approx(-5.0)
    assert against["detail"] == "c minus a; 0 of 2 pairs resolved as the claim says"


def test_chance_reads_the_worst_case_of_the_attacks_image_by_image(tmp_path):
    # Square leaves each model images 0-99, AutoAttack 25-174, APGD-CE 0-74 and 150-199: an image
    # is robust only where all three failed, images 25-74 (25%), not the 37.5-75% any one or two give
    index = np.arange(N)
    square_kept = HALF
    autoattack_kept = ((index >= 25) & (index < 175)).astype(int)
    apgd_kept = ((index < 75) | (index >= 150)).astype(int)
    for model in MODELS[:2]:
        _write(tmp_path / f"square-{model}", "attack", model, model, {"clean": EVERY, "square_linf_eps8": square_kept})
        _write(tmp_path / f"autoattack-{model}", "attack", model, model,
               {"clean": EVERY, "autoattack_linf_eps8": autoattack_kept})
        _write(tmp_path / f"apgd-{model}", "attack", model, model, {"clean": EVERY, "apgd-ce_linf_eps8": apgd_kept})
    finding = _finding("none_robust_at_8")
    runs = load_zoo([tmp_path])
    losses = {m.title.split(" ")[0]: measure_losses(runs, m) for m in finding.measures}

    def measured(**frames):   # the finding in a zoo that ran the attacks named (their first word)
        return check_finding(finding, {m: frames[m.title.split(" ")[0]] for m in finding.measures
                                       if m.title.split(" ")[0] in frames}, n_boot=100)

    def chance_minus(kept):   # chance-level error minus the error of an image set's survivors, in points
        return bootstrap_mean_ci((1 - kept) - 0.9, n_boot=100)

    result = measured(**losses)
    survivors = square_kept * autoattack_kept * apgd_kept
    assert survivors.mean() == 0.25
    expected = chance_minus(survivors)
    assert (result["value"], result["low"], result["high"]) == pytest.approx((expected.value, expected.low,
                                                                              expected.high))
    assert result["verdict"] == "no" and result["n"] == N
    assert result["measure"] == ("worst case of AutoAttack 8/255: robust error, APGD-CE 8/255: robust error, "
                                 "Square 8/255: robust error")
    # Square alone (a zoo without AutoAttack or APGD-CE at 8/255): its own 50%
    assert measured(Square=losses["Square"])["value"] == pytest.approx(-40.0)
    # Square beside APGD-CE (a study of AutoAttack at 2/255 only): APGD-CE overturns Square's number
    assert measured(Square=losses["Square"], **{"APGD-CE": losses["APGD-CE"]})["value"] == pytest.approx(
        chance_minus(square_kept * apgd_kept).value)
    # an attack on other images shares nothing to combine: it is left out, the others still combine
    shifted = losses["Square"].set_axis(losses["Square"].index + N)
    apart = measured(Square=shifted, AutoAttack=losses["AutoAttack"], **{"APGD-CE": losses["APGD-CE"]})
    assert apart["measure"] == "worst case of AutoAttack 8/255: robust error, APGD-CE 8/255: robust error"
    assert apart["value"] == pytest.approx(chance_minus(autoattack_kept * apgd_kept).value)
    # ... and where none shares the first one's images, the first stands alone
    alone = measured(Square=shifted, AutoAttack=losses["AutoAttack"])
    assert alone["measure"] == "AutoAttack 8/255: robust error" and alone["value"] == pytest.approx(-65.0)


def test_across_verdicts():
    assert across_verdict("yes", "yes") == "holds"
    assert across_verdict("no", "no") == "holds (false in both)"
    assert across_verdict("yes", "no") == across_verdict("no", "yes") == "flips"
    assert across_verdict("yes", "unresolved") == across_verdict("unresolved", "no") == "unresolved"
    assert across_verdict("not measured", "yes") == "not measured"


def test_report_compare_zoo_writes_the_table(zoos, tmp_path, capsys):
    out = tmp_path / "across"
    assert main(["report", str(zoos[1]), "--compare-zoo", str(zoos[0]), "--out", str(out), "--bootstrap", "200"]) == 0
    table = pd.read_csv(out / "across_scale.csv")
    assert set(table["zoo"]) == {"reference", "other"} and len(table) == 2 * len(FINDINGS)
    md = (out / "report.md").read_text()
    claim = _finding("table10_vs_resnet26").claim
    assert next(line for line in md.splitlines() if line.startswith(f"| {claim} |")).endswith("| flips |")
    assert (out / "report.html").is_file()
    # a path holding no runs is an error naming it, not a traceback
    assert main(["report", str(zoos[1]), "--compare-zoo", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "holds no runs" in capsys.readouterr().err


def test_a_group_on_the_better_side_is_compared_at_its_weakest_model(zoos):
    # "SAN10 pairwise is the least robust of all under APGD-CE at 1/255" in zoo B: of the others, sasa
    # (loss 0.75) comes closest to san10_pairwise (1.0), not resnet26 (0.5)
    finding = _finding("apgd1_least")
    runs = load_zoo([zoos[1]])
    result = check_finding(finding, {m: measure_losses(runs, m) for m in finding.measures}, n_boot=100)
    assert result["detail"].startswith("san10_pairwise minus sasa_resnet26; ")
    assert result["value"] == pytest.approx(25.0) and result["verdict"] == "yes"


def test_chance_is_tested_on_the_most_robust_model(tmp_path):
    # resnet26 keeps half of the images under both attacks, san10_pairwise none: the zoo is not at chance,
    # which the most robust model shows (its loss 0.5 against chance's 0.9)
    for model, kept in (("resnet26", HALF), ("san10_pairwise", NONE)):
        _write(tmp_path / f"square-{model}", "attack", model, model, {"clean": EVERY, "square_linf_eps8": kept})
        _write(tmp_path / f"autoattack-{model}", "attack", model, model, {"clean": EVERY, "autoattack_linf_eps8": kept})
    finding = _finding("none_robust_at_8")
    runs = load_zoo([tmp_path])
    result = check_finding(finding, {m: measure_losses(runs, m) for m in finding.measures}, n_boot=100)
    assert result["value"] == pytest.approx(-40.0) and result["verdict"] == "no"
    assert "minus resnet26's (50.0%)" in result["detail"]


def test_the_same_ranking_is_a_no_only_where_every_resample_keeps_it():
    # one order of the three models under both measures, but a and b differ by 1 image in 200 under
    # each, on different images: resamples swap them, so "the rankings differ" is unresolved, not false
    rng = np.random.default_rng(1)
    close = {m: rng.permutation((np.arange(N) < k).astype(float)) for m, k in (("a", 100), ("b", 101))}
    first = pd.DataFrame({**close, "c": np.ones(N)})
    second = pd.DataFrame({m: rng.permutation(v) for m, v in close.items()} | {"c": np.ones(N)})
    finding = _finding("corruptions_unlike_rotation")
    measures = {finding.measures[0]: first, finding.against: second}
    result = check_finding(finding, measures, n_boot=200)
    assert result["value"] == 1.0 and result["low"] < 1 and result["verdict"] == "unresolved"
    # well apart (a keeps 150 images, b 100), every resample keeps the order: no
    apart = {m: pd.DataFrame({"a": (np.arange(N) < 50).astype(float), "b": HALF.astype(float), "c": np.ones(N)})
             for m in measures}
    assert check_finding(finding, apart, n_boot=200)["verdict"] == "no"
