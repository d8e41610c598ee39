"""Gradient-masking checks where they run: ``eval attack --attack autoattack`` compares its
white-box members with its own Square member, and the unbounded attack tells the gradient steps'
work from the random start's, so a model whose input gradient is zero is flagged on any subset."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

from robust_attn.attacks.base import AttackConfig, make_attack
from robust_attn.attacks.masking import check_unbounded, unbounded_success
from robust_attn.data.base import TensorImageDataset
from robust_attn.protocols.attack import run_attack


class RoundedBrightness(nn.Module):
    """Four classes by the mean brightness of the image rounded to 8 grey levels (torch.round has
    a zero gradient, so every gradient attack is blind), nearest of 0.3, 0.45, 0.55 and 0.7."""

    def forward(self, x):
        r = torch.round(x * 7) / 7
        return -50 * (r.mean((1, 2, 3))[:, None] - torch.tensor([0.3, 0.45, 0.55, 0.7])).abs()


class RoundedContrast(nn.Module):
    """Two classes on the image rounded to 8 grey levels: 1 ("noisy") when the mean distance of
    its pixels from mid-grey exceeds 0.2, else 0. Uniform noise over the cube is class 1."""

    def forward(self, x):
        r = torch.round(x * 7) / 7
        z = 50 * ((r - 0.5).abs().mean((1, 2, 3)) - 0.2)
        return torch.stack([-z, z], 1)


def _grey_images(n=8, size=16, seed=0):
    """Near mid-grey images: 0.5 plus up to 0.04, every pixel within one rounding step of 0.5."""
    gen = torch.Generator().manual_seed(seed)
    return 0.5 + 0.04 * torch.rand(n, 3, size, size, generator=gen)


@pytest.mark.parametrize("faked_near_misses", ["none", "rare", "many"])
def test_autoattack_run_compares_its_white_box_members_with_its_own_square(tmp_path, monkeypatch, faked_near_misses):
    """The zero-gradient model leaves every image to AutoAttack's Square member, and PGD from the
    clean image leaves their margins where they were: flagged. Were PGD to close their margins
    (faked), the same images would be near misses: passed while near misses may be that many
    ("rare": the bound raised to every image), flagged as they are here, all of the images
    compared ("many")."""
    import pandas as pd

    from robust_attn.attacks.masking import near_miss

    if faked_near_misses != "none":
        monkeypatch.setattr(near_miss, "margins", lambda model, images, labels, indices, eps, **kw: pd.DataFrame(
            {"index": indices, "eps": eps, "clean_margin": 1.0, "margin": 0.5}))
    if faked_near_misses == "rare":
        monkeypatch.setattr(near_miss, "RARE", 1.0)
    model = RoundedBrightness().eval()
    images = _grey_images()
    labels = model(images).argmax(1)
    assert labels.tolist() == [2] * 8
    data = TensorImageDataset((images * 255).round().to(torch.uint8), labels)
    store = run_attack(model, data, tmp_path / "aa", configs=[AttackConfig("autoattack", eps=8 / 255, steps=5)],
                       num_classes=4, batch_size=4, progress=False, checks=True)
    from robust_attn.runs.store import load_records

    records = load_records(store.root)
    fooled_by = records.loc[records["condition"] != "clean", "by"]
    square_only = int((fooled_by == "square").sum())
    assert square_only > 0   # this model's zero gradient leaves every image to Square
    checks = {c["name"]: c for c in json.loads((store.root / "checks.json").read_text())}
    check = checks["blackbox_beats_whitebox"]
    evidence = check["evidence"]["autoattack's square"]
    margins = pd.read_csv(store.root / "masking" / "whitebox_margins.csv")
    assert sorted(margins["index"]) == sorted(records.loc[records["by"] == "square", "index"])
    assert np.allclose(margins["eps"], 8 / 255)
    if faked_near_misses == "rare":
        assert check["verdict"] == "pass" and evidence["beats"] == 0 and evidence["near_misses"] == square_only
        assert evidence["near_misses_counted"] is False
    elif faked_near_misses == "many":
        assert square_only > 1   # more than the one image the bound always excuses
        assert check["verdict"] == "flag" and evidence["beats"] == evidence["near_misses"] == square_only
        assert evidence["near_misses_counted"] is True and "counted among them" in check["detail"]
    else:
        assert (margins["margin"] == margins["clean_margin"]).all()   # the zero gradient moved nothing
        assert check["verdict"] == "flag" and evidence["beats"] == square_only and "near_misses" not in evidence


def test_a_rerun_keeps_the_checks_and_says_when_their_near_misses_were_decided_by_another_rule(
        tmp_path, monkeypatch, capsys):
    """A finished masking step's checks.json is kept as decided (deciding again could change a
    verdict for other reasons: another set of models, another follow-up), but where its near misses
    were decided under another rule than today's, the rerun says so and how to decide again."""
    import pandas as pd

    from robust_attn.attacks.masking import near_miss

    monkeypatch.setattr(near_miss, "margins", lambda model, images, labels, indices, eps, **kw: pd.DataFrame(
        {"index": indices, "eps": eps, "clean_margin": 1.0, "margin": 0.5}))
    model = RoundedBrightness().eval()
    images = _grey_images()
    data = TensorImageDataset((images * 255).round().to(torch.uint8), model(images).argmax(1))

    def run():
        store = run_attack(model, data, tmp_path / "aa", configs=[AttackConfig("autoattack", eps=8 / 255, steps=5)],
                           num_classes=4, batch_size=4, progress=False, checks=True)
        return store, json.loads((store.root / "masking" / "checks.json").read_text())

    store, first = run()   # every image a near miss: too many to pass
    assert {c["name"]: c["verdict"] for c in first}["blackbox_beats_whitebox"] == "flag"
    assert near_miss.rule_changed(first) is None
    _, again = run()
    assert again == first and "decided its near misses" not in capsys.readouterr().err
    monkeypatch.setattr(near_miss, "RARE", 1.0)   # today's rule would pass them
    _, kept = run()
    assert kept == first
    err = capsys.readouterr().err
    assert "decided its near misses under the rule {'near_miss': 0.5, 'rare': 0.01}, not today's" in err
    assert f"delete {store.root / 'masking'}" in err
    earlier = [{**c, "evidence": {s: {k: v for k, v in e.items() if k != "near_miss_rule"}
                                  for s, e in c["evidence"].items()}} if c["name"] == "blackbox_beats_whitebox" else c
               for c in first]
    assert near_miss.rule_changed(earlier).startswith("decided its near misses under an earlier rule")


def test_zero_gradient_model_is_flagged_on_a_subset_without_the_noise_class():
    """Every image here is class 0 and uniform noise is class 1: PGD's random start alone fools all
    of them, so a check on the random-start attack's success would pass this fully masked model."""
    model = RoundedContrast().eval()
    images = _grey_images()
    labels = model(images).argmax(1)
    assert labels.tolist() == [0] * 8
    noise = torch.rand(64, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    assert model(noise).argmax(1).tolist() == [1] * 64   # the class uniform noise is assigned to
    # the attack with its random start "succeeds" on every image though its steps did nothing
    random_start = make_attack(AttackConfig("pgd", eps=1.0, steps=20)).run(model, images, labels).adv
    assert (model(random_start).argmax(1) != labels).all()
    records = unbounded_success(model, images, labels, steps=20, batch_size=3)
    assert records["start_success"].tolist() == [1] * 8 and records["success"].tolist() == [0] * 8
    check = check_unbounded(records)
    assert check.verdict == "flag"
    assert check.evidence["by_steps"] == 0 and check.evidence["fooled_by_random_start"] == 8
    assert "the random start alone 8 of 8" in check.detail


def test_unbounded_attack_in_batches_equals_one_batch():
    from helpers import tiny_resnet

    model = tiny_resnet(1, stem_downsample=4)
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    labels = model(images).argmax(1)
    whole = unbounded_success(model, images, labels, steps=5)
    parts = unbounded_success(model, images, labels, steps=5, batch_size=2)
    assert whole[["index", "success", "clean_success"]].equals(parts[["index", "success", "clean_success"]])
    assert check_unbounded(whole).verdict == "pass" and check_unbounded(whole).evidence["by_steps"] == 6


def test_masking_flags_travel_with_the_numbers(tmp_path):
    """A masked model (input rounded: PGD is blind, so it looks robust) beside a plain one: every
    label of the masked model in the report carries the mark, and the sentence ranking it first
    says its lead is not evidence of robustness."""
    from helpers import tiny_resnet
    from test_masking import Quantized   # a ResNet behind an input rounded to 4 grey levels

    from robust_attn.data import build_dataset
    from robust_attn.reports import make_report
    from robust_attn.reports.masking_marks import MARK

    data = build_dataset("synthetic", split="test", limit=8)
    plain, masked = tiny_resnet(1, stem_downsample=4), Quantized(tiny_resnet(1, stem_downsample=4)).eval()
    dirs = []
    for name, model in (("plain", plain), ("masked", masked)):
        info = {"model": name, "dataset": {"name": "synthetic", "split": "test", "limit": 8},
                "checkpoint": {"path": f"{name}.safetensors", "sha256": name[0] * 64}}
        dirs.append(run_attack(model, data, tmp_path / f"run_{name[0]}",
                               configs=[AttackConfig("pgd", eps=8 / 255, steps=5)], num_classes=10, batch_size=4,
                               run_info=info, progress=False, checks=True).root)
    verdicts = {d.name[-1]: {c["name"]: c["verdict"] for c in json.loads((d / "checks.json").read_text())}
                for d in dirs}
    assert verdicts["m"]["unbounded_attack"] == "flag" and verdicts["m"]["input_gradients"] == "flag"
    assert "flag" not in verdicts["p"].values()
    make_report(dirs, tmp_path / "report", n_boot=20, plots=False)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "**[masking flag]** marks a model" in md
    assert MARK in md and f"plain{MARK}" not in md
    for line in md.splitlines():   # every mention of the masked model's numbers carries the mark
        if re.search(r"\bmasked\b", line) and not line.startswith("| masked |"):   # but the checks' own table
            assert MARK in line, line
        if "loses least (" in line and line.split("**: ")[1].startswith("masked"):
            assert "not evidence of robustness" in line, line
    robust = __import__("pandas").read_csv(tmp_path / "report" / "robust_accuracy.csv")
    assert {m for m in robust["model"] if MARK in m} == {f"masked{MARK}"}


def test_a_flagged_model_ranked_first_is_not_called_most_robust_without_the_mark():
    import pandas as pd

    from robust_attn.reports.comparison import _sentence
    from robust_attn.reports.masking_marks import MARK

    group = pd.DataFrame([{"title": "PGD", "model": f"masked{MARK}", "value": 1.0, "unit": "points", "level": 0.95,
                           "low": 0.5, "high": 1.5, "n": 100, "minus_best": 0.0, "minus_best_low": 0.0,
                           "minus_best_high": 0.0},
                          {"title": "PGD", "model": "plain", "value": 9.0, "unit": "points", "level": 0.95,
                           "low": 8.0, "high": 10.0, "n": 100, "minus_best": 8.0, "minus_best_low": 7.0,
                           "minus_best_high": 9.0}])
    text = _sentence(group)
    assert text.startswith(f"**PGD**: masked{MARK} loses least") and "not evidence of robustness" in text
    assert "the lead is resolved" in text
    assert "not evidence" not in _sentence(group.iloc[::-1].reset_index(drop=True).assign(
        model=["plain", "other"]))


def test_eval_attack_sends_what_square_alone_fooled_to_apgd_t_and_fab_t(tmp_path, monkeypatch):
    """``eval attack`` with APGD-CE and Square at one eps: with APGD-CE blind (it returns the clean
    images), the images Square fools go to APGD-T and FAB-T, and the check counts only those they
    miss too; the follow-up is saved per image in the run's masking folder."""
    import pandas as pd

    from robust_attn.attacks.apgd import APGDCE
    from robust_attn.attacks.base import AttackOutput
    from robust_attn.runs.store import load_records
    from helpers import tiny_resnet

    monkeypatch.setattr(APGDCE, "_run", lambda self, model, images, labels, targets: AttackOutput(images.clone()))
    model = tiny_resnet(1, stem_downsample=4)
    gen = torch.Generator().manual_seed(0)
    images = (torch.rand(12, 3, 32, 32, generator=gen) * 255).round().to(torch.uint8)
    with torch.no_grad():
        labels = model(images.float() / 255).argmax(1)   # every image classified "correctly"
    eps = 4 / 255
    configs = [AttackConfig("apgd-ce", eps=eps, steps=3), AttackConfig("square", eps=eps, queries=20)]
    store = run_attack(model, TensorImageDataset(images, labels), tmp_path / "run", configs=configs,
                       num_classes=10, batch_size=12, progress=False, checks=True)
    records = load_records(store.root)
    square = records[records["condition"] == configs[1].name].set_index("index")["success"].astype(bool)
    assert not records.loc[records["condition"] == configs[0].name, "success"].any()   # the blind APGD-CE
    assert square.any()
    followup = pd.read_csv(store.root / "masking" / "whitebox_followup.csv")
    assert sorted(followup["index"]) == sorted(square.index[square])
    check = next(c for c in json.loads((store.root / "checks.json").read_text())
                 if c["name"] == "blackbox_beats_whitebox")
    evidence = check["evidence"]["square"]
    assert evidence["followup"]["beat_white_box"] == int(square.sum())
    left = int((followup["by"] == "none").sum())
    assert evidence["beats"] + evidence.get("near_misses", 0) == left < int(square.sum())
    margins = store.root / "masking" / "whitebox_margins.csv"    # measured on what the follow-up left
    assert (sorted(pd.read_csv(margins)["index"]) if left else []) == sorted(followup.loc[followup["by"] == "none",
                                                                                          "index"])
    assert margins.is_file() == bool(left)
    assert "beyond APGD-CE" in check["detail"]
    assert check["verdict"] == ("flag" if evidence["beats"] else "pass")


def _six_images():
    """A tiny ResNet and six images it classifies "correctly" (labelled by its own prediction)."""
    from helpers import tiny_resnet

    model = tiny_resnet(1, stem_downsample=4)
    images = (torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 255).round().to(torch.uint8)
    with torch.no_grad():
        labels = model(images.float() / 255).argmax(1)
    return model, TensorImageDataset(images, labels)


def _six_records(success):
    import pandas as pd

    return pd.DataFrame({"index": range(6), "success": success})


def test_the_followup_is_read_back_only_for_the_images_it_holds(tmp_path, monkeypatch):
    """A masking step resumed after the follow-up was saved reads it back instead of attacking
    again, but only when the saved file holds exactly the images now contested."""
    import pandas as pd

    from robust_attn.attacks.masking import followup
    from robust_attn.protocols import masking as masking_protocol
    model, data = _six_images()
    records = _six_records
    white, square = {"s": records([0] * 6)}, {"s": records([1, 1, 0, 0, 0, 0])}
    calls = []
    original = followup.whitebox_followup
    monkeypatch.setattr(followup, "whitebox_followup", lambda *a, **k: (calls.append(a[3]), original(*a, **k))[1])

    def run():
        return masking_protocol._follow_up(model, data, "cpu", tmp_path, white, square, {"s": 4 / 255}, steps=2,
                                           seed=0, batch_size=6)

    first, followed = run()
    assert calls == [[0, 1]] and followed["s"][0] == [0, 1]
    again, _ = run()                                    # the same images contested: read back
    assert calls == [[0, 1]]
    pd.testing.assert_frame_equal(again["s"], first["s"])
    square["s"] = records([1, 1, 1, 0, 0, 0])           # now three: attacked again, and saved
    run()
    assert calls == [[0, 1], [0, 1, 2]]
    assert sorted(pd.read_csv(tmp_path / "whitebox_followup.csv")["index"]) == [0, 1, 2]


def test_near_miss_margins_are_measured_once_per_image_and_radius(tmp_path, monkeypatch):
    """The masking step measures the margins of the images each source still wins, at that
    source's radius, saves them, and measures only images it has not measured on a resumed run;
    per source, the near misses are those of its own images at its own radius."""
    import pandas as pd

    from robust_attn.attacks.masking import near_miss
    from robust_attn.protocols import masking as masking_protocol
    model, data = _six_images()
    records = _six_records
    calls = []

    def fake(model, images, labels, indices, eps, **kwargs):   # image i closes (i + 1) / 6 of a margin of 1
        calls.append((list(indices), round(eps * 255)))
        return pd.DataFrame({"index": indices, "eps": eps, "clean_margin": 1.0,
                             "margin": [1 - (i + 1) / 6 for i in indices]})

    monkeypatch.setattr(near_miss, "margins", fake)
    white = {"a": records([0] * 6), "b": records([0] * 6), "c": records([0] * 6)}
    black = {"a": records([1, 1, 0, 1, 0, 0]), "b": records([0, 0, 0, 1, 1, 0]), "c": records([0, 0, 0, 0, 1, 0])}
    radii = {"a": 8 / 255, "b": 2 / 255, "c": 8 / 255}

    def run():
        return masking_protocol._near_misses(model, data, "cpu", tmp_path, white, black, radii, steps=2, seed=0,
                                             batch_size=6)

    assert run() == {"a": {3}, "b": {3, 4}, "c": {4}}   # closed by half: images 2 and above, each its own
    assert sorted(calls) == [([0, 1, 3, 4], 8), ([3, 4], 2)]
    assert run() == {"a": {3}, "b": {3, 4}, "c": {4}} and len(calls) == 2   # read back
    black["a"] = records([1, 1, 0, 1, 0, 1])
    assert run() == {"a": {3, 5}, "b": {3, 4}, "c": {4}} and calls[2:] == [([5], 8)]
    saved = pd.read_csv(tmp_path / "whitebox_margins.csv")
    assert sorted(zip(saved["index"], (saved["eps"] * 255).round())) == [(0, 8), (1, 8), (3, 2), (3, 8), (4, 2),
                                                                         (4, 8), (5, 8)]
