"""``robust-attn diff``: two runs compared image by image (:mod:`robust_attn.reports.run_diff`)."""
import pandas as pd
import pytest
import torch

from robust_attn.attacks import AttackConfig
from robust_attn.cli import main
from robust_attn.data import build_dataset
from robust_attn.protocols.attack import run_attack
from robust_attn.models.registry import create_model
from robust_attn.reports.run_diff import diff_runs
from robust_attn.runs.store import RunStore
from robust_attn.models.wrapper import NormalizedModel


def _model(seed: int):
    torch.manual_seed(seed)
    return NormalizedModel(create_model("resnet26", num_classes=10, resolution="cifar", width=0.25,
                                        stem_downsample=4), (0.5,) * 3, (0.5,) * 3).eval()


def _run(path, model, limit=6, eps=4 / 255, seed=0):
    data = build_dataset("synthetic", split="test", limit=limit)
    config = AttackConfig("pgd", eps=eps, steps=2, seed=seed)
    return run_attack(model, data, path, configs=[config], num_classes=10, batch_size=4, checks=False,
                      progress=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff")
    model, other = _model(0), _model(1)
    return {"a": _run(root / "a", model), "again": _run(root / "again", model),
            "fewer": _run(root / "fewer", model, limit=4), "other_model": _run(root / "other", other),
            "other_eps": _run(root / "eps", model, eps=2 / 255)}


def test_a_run_computed_again_is_the_same(runs, capsys):
    assert main(["diff", str(runs["a"].root), str(runs["again"].root)]) == 0
    out = capsys.readouterr().out
    assert "other settings: the same" in out
    assert out.splitlines()[-1] == "the same: every field of every image in the 2 conditions both runs have"


def test_the_fields_that_differ_are_those_a_plain_merge_finds(runs, capsys):
    """Another model's run: per condition and field, the differing images equal what a merge of the
    two record tables, written here independently, finds."""
    a, b = runs["a"].records(), runs["other_model"].records()
    merged = a.merge(b, on=["condition", "index"], suffixes=("_a", "_b"))
    diff = diff_runs(runs["a"], runs["other_model"])
    assert not diff.same and diff.settings.startswith("{weights_sha256: ")   # same architecture, other weights
    for cond in diff.conditions:
        rows = merged[merged["condition"] == cond.condition]
        for name in [c for c in a.columns if c not in ("condition", "index")]:
            x, y = rows[f"{name}_a"], rows[f"{name}_b"]
            expected = sorted(rows.loc[~((x == y) | (x.isna() & y.isna())), "index"].tolist())
            assert cond.fields.get(name, []) == expected, (cond.condition, name)
        assert cond.top1_a == pytest.approx(100 * rows["top1_a"].mean())
    assert main(["diff", str(runs["a"].root), str(runs["other_model"].root)]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("they differ in 2 of the 2 conditions")


def test_images_in_one_run_only_and_a_condition_defined_differently_are_differences(runs, capsys):
    fewer = diff_runs(runs["a"], runs["fewer"])
    assert [(c.only_a, c.only_b, c.common) for c in fewer.conditions] == [([4, 5], [], 4)] * 2
    assert not fewer.same
    assert main(["diff", str(runs["fewer"].root), str(runs["a"].root)]) == 1
    assert "only in A 0, only in B 2" in capsys.readouterr().out

    eps = diff_runs(runs["a"], runs["other_eps"])
    assert [c.condition for c in eps.conditions] == ["clean"]   # the attacks are named by eps
    assert eps.same and eps.only_a and eps.only_b   # the clean part agrees; the rest is context
    assert main(["diff", str(runs["a"].root), str(runs["other_eps"].root)]) == 0
    assert "conditions with records in A only: " in capsys.readouterr().out


def test_atol_loosens_the_real_numbers_only(runs):
    """``atol`` applies to margins and norms, never to classes: with a huge one, another model's
    run still differs in its predictions and no longer in its margins."""
    exact = {c.condition: c.fields for c in diff_runs(runs["a"], runs["other_model"]).conditions}
    loose = {c.condition: c.fields for c in diff_runs(runs["a"], runs["other_model"], atol=1e9).conditions}
    assert exact["clean"]["margin"] and "margin" not in loose["clean"]
    for condition, fields in loose.items():
        assert set(fields) == set(exact[condition]) - {"margin", "linf", "l2"}
        assert fields["pred"] == exact[condition]["pred"] != []
    with pytest.raises(ValueError, match="atol"):
        diff_runs(runs["a"], runs["a"], atol=-1)


def test_bad_input_is_an_error_naming_the_fix(runs, tmp_path, capsys):
    assert main(["diff", str(tmp_path), str(runs["a"].root)]) == 2
    assert "is not a run directory (no run.json)" in capsys.readouterr().err
    assert main(["diff", str(runs["a"].root), str(runs["a"].root), "--atol", "-1"]) == 2
    assert "--atol must be at least 0" in capsys.readouterr().err


def test_damaged_records_are_named_not_compared(runs, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(runs["a"].root, copy)
    store = RunStore(copy)
    condition, start, stop = store.chunks()[-1]
    path = store.chunk_path(condition, start, stop)
    table = pd.read_csv(path)
    table.loc[0, "margin"] += 1.0   # an edited record: its checksum no longer matches
    table.to_csv(path, index=False)
    assert main(["diff", str(copy), str(runs["a"].root)]) == 2
    assert "has damaged records" in capsys.readouterr().err
