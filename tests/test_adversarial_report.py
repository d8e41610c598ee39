"""The report's adversarial-training section (robust_attn/reports/adversarial.py) on per-image
records made here, where the answers are known by construction: a family that gains robustness
(and pays in clean accuracy), SAN10 pairwise whose weakness under a gradient attack flips, a
difference from the best that is one image of 400 (not resolved), and the masking mark; and
the CIFAR-10 adversarial study config with its clear error for models not trained yet."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from robust_attn.protocols.report_section import ReportContext
from robust_attn.reports.adversarial import adversarial_findings, adversarial_section, pair_models
from robust_attn.reports.masking_marks import MARK, annotate_masking
from robust_attn.reports.runs import Run
from robust_attn.reports.stats import bootstrap_mean_ci

N = 400
FGSM = {"method": "fgsm", "norm": "linf", "eps": 8 / 255, "eps_255": 8.0, "steps": 1}
ATTACK_CONDITIONS = [{"name": "clean", "attack": "none", "eps": 0.0},
                     {"name": "apgd-ce_linf_eps2", "attack": "apgd-ce", "eps": 2 / 255, "norm": "linf"},
                     {"name": "autoattack_linf_eps8", "attack": "autoattack", "eps": 8 / 255, "norm": "linf"}]


def _hits(p: float, seed: int) -> np.ndarray:
    """Exactly round(p * N) ones, at seeded places."""
    out = np.zeros(N, dtype=int)
    out[np.random.default_rng(seed).permutation(N)[:round(p * N)]] = 1
    return out


def _without(hits: np.ndarray, k: int, seed: int) -> np.ndarray:
    """``hits`` with ``k`` of its ones turned to zero."""
    out = hits.copy()
    out[np.random.default_rng(seed).choice(np.flatnonzero(hits), k, replace=False)] = 0
    return out


def _with(hits: np.ndarray, k: int, seed: int) -> np.ndarray:
    """``hits`` with ``k`` of its zeros turned to one."""
    out = hits.copy()
    out[np.random.default_rng(seed).choice(np.flatnonzero(hits == 0), k, replace=False)] = 1
    return out


def _run(tmp_path, protocol, label, arch, training, conditions, hits: dict[str, np.ndarray]) -> Run:
    description = {"protocol": protocol, "model": label, "arch": {"name": arch}, "adversarial": training,
                   "dataset": {"name": "cifar10", "split": "test", "limit": N}, "conditions": conditions,
                   "checkpoint": {"path": f"{label}.safetensors", "sha256": label.encode().hex().ljust(64, "0")[:64]}}
    records = pd.concat([pd.DataFrame({"index": np.arange(N), "condition": c, "top1": h}) for c, h in hits.items()],
                        ignore_index=True) if hits else pd.DataFrame(columns=["index", "condition", "top1"])
    path = tmp_path / f"{protocol}-{label}"
    path.mkdir()
    return Run(path, description, records)


@pytest.fixture
def study(tmp_path):
    """Standard and FGSM-trained resnet26, san10_pairwise and sasa_resnet26 (hits per image):

    * standard: APGD-CE 2/255 leaves resnet26 60% and san10_pairwise 160 images fewer (-40 points);
      AutoAttack 8/255 leaves every standard model 0%;
    * adversarial: AutoAttack 8/255 leaves resnet26_adv 40%, san10_pairwise_adv 60 images more
      (+15 points, the best), sasa_resnet26_adv one image fewer than the best (not resolved);
    * clean: 80% standard, 40 images fewer after adversarial training (-10 points); rotation and
      corruption for resnet26's pair only."""
    clean = _hits(0.8, 1)
    apgd = _hits(0.6, 2)
    aa_conv = _hits(0.4, 3)
    aa_san = _with(aa_conv, 60, 4)
    hits = {
        ("resnet26", False): {"apgd": apgd, "aa": np.zeros(N, int)},
        ("san10_pairwise", False): {"apgd": _without(apgd, 160, 5), "aa": np.zeros(N, int)},
        ("sasa_resnet26", False): {"apgd": _hits(0.5, 6), "aa": np.zeros(N, int)},
        ("resnet26", True): {"apgd": _hits(0.7, 7), "aa": aa_conv},
        ("san10_pairwise", True): {"apgd": _hits(0.7, 8), "aa": aa_san},
        ("sasa_resnet26", True): {"apgd": _hits(0.7, 9), "aa": _without(aa_san, 1, 10)},
    }
    runs = []
    for (arch, adv), h in hits.items():
        label = arch + ("_adv" if adv else "")
        runs.append(_run(tmp_path, "attack", label, arch, FGSM if adv else {}, ATTACK_CONDITIONS,
                         {"clean": _without(clean, 40, 11) if adv else clean, "apgd-ce_linf_eps2": h["apgd"],
                          "autoattack_linf_eps8": h["aa"]}))
    # rotation: Table 9's four rotations count, the left-right flip does not; each condition its own hits
    rotation = ["none", "cw90", "cw180", "cw270", "flip_ud", "flip_lr"]
    rot_std = {c: _hits(0.5 - 0.05 * i, 12 + i) for i, c in enumerate(rotation[1:])}
    rot_adv = {c: _hits(0.3 + 0.1 * i, 20 + i) for i, c in enumerate(rotation[1:])}
    # corruption: the mean over the corrupted conditions, not the clean one
    corrupted = ["gaussian_noise_s1", "contrast_s5"]
    cor_std = {c: _hits(0.6 - 0.3 * i, 30 + i) for i, c in enumerate(corrupted)}
    cor_adv = {c: _hits(0.55 - 0.1 * i, 40 + i) for i, c in enumerate(corrupted)}
    clean_adv = _without(clean, 40, 11)
    for label, training, top, rot, cor in (("resnet26", {}, clean, rot_std, cor_std),
                                           ("resnet26_adv", FGSM, clean_adv, rot_adv, cor_adv)):
        runs.append(_run(tmp_path, "rotation", label, "resnet26", training, [{"name": c} for c in rotation],
                         {"none": top, **rot}))
        runs.append(_run(tmp_path, "corruption", label, "resnet26", training,
                         [{"name": "clean"}] + [{"name": c} for c in corrupted], {"clean": top, **cor}))
    hits_data = SimpleNamespace(clean=clean, aa_conv=aa_conv, aa_san=aa_san, apgd=apgd, rot_std=rot_std,
                                rot_adv=rot_adv, cor_std=cor_std, cor_adv=cor_adv)
    return runs, hits_data


def _ctx(runs, tmp_path, **kw):
    return ReportContext(runs, tmp_path, n_boot=400, seed=0, level=0.95, plots=False, baseline="resnet26", **kw)


def test_pairs_each_adversarial_model_with_the_standard_model_of_its_architecture(study):
    runs, _ = study
    models, notes = pair_models(runs)
    paired = {m["model"]: m["standard"] for m in models if m["training"]}
    assert paired == {"resnet26_adv": "resnet26", "san10_pairwise_adv": "san10_pairwise",
                      "sasa_resnet26_adv": "sasa_resnet26"}
    assert notes == []


def test_most_robust_family_gain_and_flip_are_the_constructed_ones(study, tmp_path):
    runs, h = study
    lines, table = adversarial_findings(runs, _ctx(runs, tmp_path))
    md = "\n".join(lines)
    # most robust: san10_pairwise_adv (55%); sasa_resnet26_adv one image behind: not resolved; resnet26_adv resolved
    assert "**Most robust under adversarial fgsm, eps 8/255, 1 step:** san10_pairwise_adv (san); not resolved " \
           "from sasa_resnet26_adv, so" in md
    best = table[(table["question"] == "most_robust")].set_index("model")
    assert best.loc["san10_pairwise_adv", "value"] == pytest.approx(100 * h.aa_san.mean())
    assert best.loc["sasa_resnet26_adv", "minus_best"] == pytest.approx(-100 / N)
    assert best.loc["sasa_resnet26_adv", "minus_best_low"] < 0 <= best.loc["sasa_resnet26_adv", "minus_best_high"]
    assert best.loc["resnet26_adv", "minus_best"] == pytest.approx(-15.0)
    assert best.loc["resnet26_adv", "minus_best_high"] < 0
    # its interval is that of the per-image differences (one resample of images for both models)
    paired = bootstrap_mean_ci(h.aa_conv - h.aa_san, n_boot=400, seed=0)
    shown = best.loc["resnet26_adv", ["minus_best_low", "minus_best_high"]].tolist()
    assert shown == pytest.approx([paired.low, paired.high])
    # SAN10 pairwise: 40 points weaker under APGD-CE 2/255 when standard, 15 points stronger adversarially
    weak = table[table["question"] == "weakness"].set_index(["family", "attack"])
    assert weak.loc[("standard", "APGD-CE 2/255"), "value"] == pytest.approx(-40.0)
    assert weak.loc[("standard", "APGD-CE 2/255"), "high"] < 0
    assert weak.loc[("adversarial", "AutoAttack 8/255"), "value"] == pytest.approx(15.0)
    assert "No, the ranking flips: weaker under standard training (APGD-CE 2/255)" in md
    # gains: adversarial minus standard, paired per image
    gain = table[table["question"] == "gain"].set_index(["model", "measure"])
    assert gain.loc[("resnet26_adv", "AutoAttack 8/255"), "value"] == pytest.approx(100 * h.aa_conv.mean())
    assert gain.loc[("san10_pairwise_adv", "AutoAttack 8/255"), "low"] > 0
    assert gain.loc[("resnet26_adv", "clean"), "value"] == pytest.approx(-10.0)
    assert gain.loc[("resnet26_adv", "clean"), "high"] < 0
    table9 = ("cw90", "cw180", "cw270", "flip_ud")
    assert gain.loc[("resnet26_adv", "rotation"), "value"] == pytest.approx(
        100 * np.mean([h.rot_adv[c] - h.rot_std[c] for c in table9]))
    assert gain.loc[("resnet26_adv", "corruption"), "value"] == pytest.approx(
        100 * np.mean([h.cor_adv[c] - h.cor_std[c] for c in h.cor_std]))
    assert ("san10_pairwise_adv", "rotation") not in gain.index   # no rotation run of that pair
    # Bai et al. beside the result: their figures, and the verdict of ours (san10_pairwise_adv ahead, resolved)
    assert "DeiT-S 35.50%" in md and "ResNet-50-GELU 35.51%" in md and "Bai et al." in md
    assert "san10_pairwise_adv, minus resnet26_adv: +15.0" in md and "the attention model is resolved ahead" in md
    assert "the most robust of the 2 attention models, san10_pairwise_adv" in md and "after the fact" in md


def test_a_weakness_that_survives_and_one_that_is_unresolved(study, tmp_path):
    runs, h = study
    san_adv = next(r for r in runs if r.model == "san10_pairwise_adv" and r.protocol == "attack")
    records = san_adv.records
    aa = records["condition"] == "autoattack_linf_eps8"
    records.loc[aa, "top1"] = _without(h.aa_conv, 60, 20)   # 15 points weaker than resnet26_adv
    md = "\n".join(adversarial_findings(runs, _ctx(runs, tmp_path))[0])
    assert "Yes: weaker under standard training (APGD-CE 2/255) and still weaker after adversarial training (-15.0" \
           in md
    records.loc[aa, "top1"] = _without(h.aa_conv, 1, 21)    # one image: not resolved
    md = "\n".join(adversarial_findings(runs, _ctx(runs, tmp_path))[0])
    assert "Not established: weaker under standard training (APGD-CE 2/255), but after adversarial training the " \
           "difference is not resolved (-0.2" in md


def test_the_weakness_question_says_which_standard_side_is_missing(study, tmp_path):
    runs, _ = study
    md = "\n".join(adversarial_findings([r for r in runs if r.model != "san10_pairwise"], _ctx(runs, tmp_path))[0])
    assert "No standard san10_pairwise among the runs: the standard side of the question is not measured." in md
    assert "no gradient attack separates" not in md
    for r in runs:   # the standard models keep only their clean records: no gradient attack in common
        if r.protocol == "attack" and r.model in ("san10_pairwise", "resnet26"):
            r.records = r.records[r.records["condition"] == "clean"]
    md = "\n".join(adversarial_findings(runs, _ctx(runs, tmp_path))[0])
    assert "The standard san10_pairwise and resnet26 ran no gradient attack in common: the standard side" in md
    assert "no gradient attack separates" not in md


def test_a_model_flagged_by_a_masking_check_carries_the_mark(study, tmp_path):
    runs, _ = study
    masking = _run(tmp_path, "masking", "san10_pairwise_adv", "san10_pairwise", FGSM, [], {})
    masking.records = pd.DataFrame({"condition": "loss_sweep", "index": np.arange(10), "success": 1,  # as the
                                    "clean_success": 0, "start_success": 0})                         # protocol's
    (masking.path / "checks.json").write_text(json.dumps([{"name": "blackbox_beats_whitebox", "verdict": "flag"}]))
    runs = runs + [masking]
    annotate_masking(runs)
    lines, files = adversarial_section(_ctx(runs, tmp_path))
    md = "\n".join(lines)
    assert f"| san10_pairwise_adv{MARK} | san |" in md
    assert f"**Most robust under adversarial fgsm, eps 8/255, 1 step:** san10_pairwise_adv{MARK}" in md
    assert "A gradient-masking check flagged it" in md
    assert all(MARK not in line for line in lines if "sasa_resnet26_adv |" in line)
    assert [f.name for f in files] == ["adversarial_training.csv"]


def test_no_section_without_adversarial_runs_and_notes_on_what_cannot_be_paired(study, tmp_path):
    runs, _ = study
    standard = [r for r in runs if not r.description["adversarial"]]
    assert adversarial_section(_ctx(standard, tmp_path)) == ([], [])
    second = _run(tmp_path, "attack", "resnet26_wide", "resnet26", {}, ATTACK_CONDITIONS,
                  {"clean": _hits(0.8, 30), "autoattack_linf_eps8": np.zeros(N, int)})
    unknown = _run(tmp_path, "attack", "mystery", "resnet26", None, ATTACK_CONDITIONS, {"clean": _hits(0.8, 31)})
    del unknown.description["adversarial"]
    models, notes = pair_models(runs + [second, unknown])
    assert next(m for m in models if m["model"] == "resnet26_adv")["standard"] is None
    assert any(n.startswith("resnet26_adv: 2 standard models of resnet26") for n in notes)
    assert any(n.startswith("mystery: its runs do not say how it was trained") for n in notes)
    wider = next(r for r in runs if r.model == "sasa_resnet26_adv")
    wider.description["arch"] = {"name": "sasa_resnet26", "overrides": {"width": 0.5}}
    notes = pair_models(runs)[1]
    assert notes == ["sasa_resnet26_adv and sasa_resnet26 differ in their architecture arguments ({'name': "
                     "'sasa_resnet26', 'overrides': {'width': 0.5}} against {'name': 'sasa_resnet26'}): its gains mix "
                     "adversarial training with that difference"]


def test_the_adversarial_study_config_pairs_every_family_and_names_missing_models_at_once(tmp_path):
    from pathlib import Path

    from robust_attn.models.manifest import Manifest
    from robust_attn.study.config import load_study_config
    from robust_attn.study.models import load_models

    config = load_study_config(Path(__file__).resolve().parents[1] / "zoo/studies/cifar10_adversarial.toml")
    assert config.autoattack_eps == pytest.approx((8 / 255,)) and config.square_eps == pytest.approx(8 / 255)
    assert config.limit == config.attack_limit == 1000
    assert {"autoattack", "rotation", "corruption", "masking"} <= set(config.protocols)
    labels = [m.name for m in config.models]
    adversarial = [label for label in labels if label.endswith("-adv")]
    assert sorted(label[:-4] for label in adversarial) == sorted(set(labels) - set(adversarial))
    assert len(adversarial) == 7 and config.baseline in labels
    with pytest.raises(ValueError) as err:
        load_models(list(config.models), SimpleNamespace(name="cifar10"), "cpu", Manifest(tmp_path / "none.json"),
                    0, log=lambda *_: None)
    message = str(err.value)
    assert "has no cifar10 entry for 14 of the study's 14 models" in message and "robust-attn zoo add" in message
    assert all(label in message for label in labels)


def test_a_zoo_model_records_how_it_was_trained(tmp_path):
    import robust_attn
    from robust_attn.cli import main
    from robust_attn.data import dataset_info
    from robust_attn.models.checkpoint import save_checkpoint
    from robust_attn.models.wrapper import NormalizedModel
    from robust_attn.sources import load_model_spec

    model = NormalizedModel(robust_attn.create_model("resnet26", 10, "cifar", width=0.25), (0.3,) * 3, (0.3,) * 3)
    manifest = tmp_path / "manifest.json"
    for name, meta in (("plain", {}), ("at", {"adversarial": FGSM})):
        path = tmp_path / f"{name}.safetensors"
        save_checkpoint(path, model.eval(), meta)
        assert main(["zoo", "add", name, "--dataset", "synthetic", "--checkpoint", str(path),
                     "--manifest", str(manifest)]) == 0
    for name, training in (("plain", {}), ("at", FGSM)):
        loaded = load_model_spec(f"zoo:{name}", dataset_info=dataset_info("synthetic"), manifest=str(manifest),
                                 device="cpu")
        assert loaded.description["adversarial"] == training



def test_make_report_writes_the_section_from_run_directories(study, tmp_path):
    """The section is registered: `robust-attn report` over run directories whose run.json records
    the training (as a zoo model's runs do) writes it, with its CSV."""
    from robust_attn.protocols.runner import open_run
    from robust_attn.reports import make_report

    runs, _ = study
    dirs = []
    for run in (r for r in runs if r.protocol == "attack"):
        info = {k: run.description[k] for k in ("model", "arch", "adversarial", "dataset", "checkpoint")}
        store = open_run(tmp_path / "runs" / run.path.name, dict(info, weights_origin="zoo"), protocol="attack",
                         parameters={}, conditions=run.description["conditions"], num_images=N, chunk_size=N)
        for condition, group in run.records.groupby("condition"):
            hit = group["top1"].to_numpy()
            store.write_chunk(condition, 0, N, pd.DataFrame({
                "index": np.arange(N), "label": 0, "target": -1, "clean_pred": 0, "pred": 1 - hit, "top1": hit,
                "success": 1 - hit, "margin": hit - 0.5, "linf": 0.0, "l2": 0.0, "queries": -1,
                "by": np.where(hit == 1, "none", "apgd-ce")}))
        dirs.append(store.root)
    make_report(dirs, tmp_path / "report", n_boot=50, plots=False)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Adversarial training: which family is most robust" in md
    assert "**Most robust under adversarial fgsm, eps 8/255, 1 step:** san10_pairwise_adv (san)" in md
    table = pd.read_csv(tmp_path / "report" / "adversarial_training.csv")
    assert set(table["question"]) == {"most_robust", "weakness", "gain"}


def test_the_findings_name_an_adversarial_models_family_from_its_architecture(study):
    """A label such as ``sasa_resnet26_adv`` names no architecture; the findings' family column
    comes from the architecture its runs record, the same family as its standard counterpart's."""
    from robust_attn.reports.comparison import compare_models

    runs, _ = study
    findings = compare_models(runs, n_boot=20).drop_duplicates("model").set_index("model")["family"]
    assert {m: findings[m] for m in ("resnet26_adv", "san10_pairwise_adv", "sasa_resnet26_adv")} == \
        {"resnet26_adv": "resnet", "san10_pairwise_adv": "san", "sasa_resnet26_adv": "sasa"}
    assert findings["sasa_resnet26_adv"] == findings["sasa_resnet26"]
