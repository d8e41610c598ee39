"""``robust-attn status``: chunks written and missing per run, and an attack's state within a chunk."""
import re

import pytest
import torch

from robust_attn.attacks import AttackConfig, make_attack
from robust_attn.cli import main
from robust_attn.data import build_dataset
from robust_attn.protocols.attack import STATE_DIR, run_attack
from robust_attn.models.registry import create_model
from robust_attn.runs.store import RunStore
from robust_attn.models.wrapper import NormalizedModel


class Killed(Exception):
    pass


TIMED = re.compile(r", compute time \d+\.\d\d h$", re.M)   # what the chunks' seconds sum to


def _untimed(text: str) -> str:
    """``text`` without the first line's compute time, which it must have."""
    assert TIMED.search(text), text
    return TIMED.sub("", text, count=1)


def test_status_of_a_run_its_missing_chunk_and_the_autoattack_state_within_it(tmp_path, capsys):
    data = build_dataset("synthetic", split="test", limit=4)
    torch.manual_seed(0)
    model = NormalizedModel(create_model("resnet26", num_classes=10, resolution="cifar", width=0.25,
                                         stem_downsample=4), (0.5,) * 3, (0.5,) * 3).eval()
    config = AttackConfig("autoattack", eps=8 / 255, steps=2, queries=5)
    run = tmp_path / "runs" / "autoattack-tiny"
    run_attack(model, data, run, configs=[config], num_classes=10, batch_size=4, checks=False, progress=False)
    assert main(["status", str(tmp_path / "runs")]) == 0
    out = _untimed(capsys.readouterr().out)
    assert out == f"{run}: attack, {RunStore(run).description()['model']}: 2 of 2 chunks written (finished)\n"

    store = RunStore(run)   # the attacked chunk lost: what running the command again computes
    chunk = store.chunk_path(config.name, 0, 4)
    chunk.unlink()
    store.checksum_path(chunk).unlink()
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        labels = model(images).argmax(1)   # all robust to begin with
    aa = make_attack(AttackConfig("autoattack", eps=1 / 255, steps=2, queries=5, options={"attacks": ["apgd-ce", "apgd-t"]}))
    aa.state_path, aa.progress_every_s = run / STATE_DIR / f"{config.name}-000000000.pt", 0
    calls = {"n": 0}

    def killing(x):   # the ensemble's clean pass, APGD-CE's 5 calls; APGD-T: 1, then 3 per target run
        calls["n"] += 1
        if calls["n"] > 17:
            raise Killed
        return model(x)
    killer = torch.nn.Module()
    killer.forward = killing
    with pytest.raises(Killed):
        aa.run(killer.eval(), images, labels)
    state = torch.load(aa.state_path, weights_only=True)
    robust = int(state["robust"].sum())
    assert main(["status", str(run)]) == 0
    out = _untimed(capsys.readouterr().out).splitlines()
    assert out[:2] == [f"{run}: attack, {store.description()['model']}: 1 of 2 chunks written",
                       f"  to compute: {config.name}[0:4]"]
    # the finished conditions' top-1, as a direct evaluation of the model gives it
    x = torch.stack([data[i][0] for i in range(4)])
    y = torch.tensor([int(data[i][1]) for i in range(4)])
    with torch.no_grad():
        clean = 100 * (model(x).argmax(1) == y).float().mean().item()
    assert out[2] == f"  top-1 of the finished conditions: clean {clean:.1f}% (4 images)"
    # described by the run's own condition: the standard ensemble's four members
    assert out[3].startswith(f"  {config.name}[0:]: 1 of 4 members done, {robust} of 6 images robust; "
                             f"apgd-t: {state['member']['note']}; 0 min in it, about 0 min left at that pace; "
                             f"then fab-t, square (saved ")
    assert re.fullmatch(r"run [1-8] of 9 done, [1-6] images not fooled yet", state["member"]["note"])
    # and how to report what is finished (a folder of runs stands for each run in it)
    assert out[-1] == (f"what is finished, with intervals and paired comparisons: robust-attn report {run} "
                       f"--out DIR --partial")
    assert main(["status", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"report {tmp_path / 'runs'}/* --out DIR --partial")

    # damaged records are named with the fix, never summarized, and the exit status says so
    clean_chunk = store.chunk_path("clean", 0, 4)
    clean_chunk.write_bytes(clean_chunk.read_bytes() + b"0")
    assert main(["status", str(run)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{run}: attack, {store.description()['model']}: 1 of 2 chunks written, damaged"
    assert out[1].startswith(f"  damaged: run {run} has damaged records: {clean_chunk}: sha256 differs")
    assert "--repair" in out[1] and "top-1" not in "".join(out) and "--partial" not in "".join(out)


def _tiny_rotation_run(out):
    from robust_attn.protocols.rotation import run_rotation

    torch.manual_seed(0)
    model = NormalizedModel(create_model("resnet26", num_classes=10, resolution="cifar", width=0.25,
                                         stem_downsample=4), (0.5,) * 3, (0.5,) * 3).eval()
    return run_rotation(model, build_dataset("synthetic", split="test", limit=4), out, batch_size=2,
                        progress=False)


def test_status_checks_every_record_of_a_finished_run_and_of_a_packed_one(tmp_path, capsys):
    store = _tiny_rotation_run(tmp_path / "rot")
    model = store.description()["model"]
    assert main(["status", str(store.root)]) == 0
    assert _untimed(capsys.readouterr().out).endswith("chunks written (finished)\n")
    packed = store.pack(tmp_path / "packed")
    assert main(["status", str(packed.root)]) == 0
    assert _untimed(capsys.readouterr().out) == f"{packed.root}: rotation, {model}: finished (packed)\n"

    chunk = store.chunk_path(*store.chunks()[-1])      # one line more: every chunk is written, yet damaged
    chunk.write_bytes(chunk.read_bytes() + chunk.read_bytes().splitlines(keepends=True)[-1])
    assert main(["status", str(store.root)]) == 1
    first, second = capsys.readouterr().out.splitlines()
    assert first.endswith(", damaged") and "finished" not in first
    assert second.startswith(f"  damaged: run {store.root} has damaged records: {chunk}: sha256 differs "
                             f"from the recorded one (altered: 3 rows, recorded 2 rows)")

    records = packed.root / "records.csv.gz"           # a packed run cut short
    records.write_bytes(records.read_bytes()[:len(records.read_bytes()) // 2])
    assert main(["status", str(packed.root)]) == 1
    first, second = capsys.readouterr().out.splitlines()
    assert first == f"{packed.root}: rotation, {model}: damaged (packed)"
    assert f"{records}: sha256 differs" in second and "git checkout" in second


@pytest.mark.parametrize("text, what", [('{"protocol": "rotation", "mod', "is damaged"), ("[]", "holds a JSON list")])
def test_status_names_a_damaged_run_json_and_the_fix(tmp_path, capsys, text, what):
    (tmp_path / "run.json").write_text(text)
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'run.json'} {what}" in err and "restore it from a copy" in err and "Traceback" not in err


def test_status_refuses_what_is_not_a_run(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert "neither a run directory" in capsys.readouterr().err
