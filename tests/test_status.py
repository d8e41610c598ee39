"""``robust-attn status``: chunks written and missing per run, and an attack's state within a chunk."""
import re

import pytest
import torch

from robust_attn.attacks import AttackConfig, make_attack
from robust_attn.cli import main
from robust_attn.data import build_dataset
from robust_attn.protocols.attack import STATE_DIR, run_attack
from robust_attn.registry import create_model
from robust_attn.results import RunStore
from robust_attn.wrapper import NormalizedModel


class Killed(Exception):
    pass


def test_status_of_a_run_its_missing_chunk_and_the_autoattack_state_within_it(tmp_path, capsys):
    data = build_dataset("synthetic", split="test", limit=4)
    torch.manual_seed(0)
    model = NormalizedModel(create_model("resnet26", num_classes=10, resolution="cifar", width=0.25,
                                         stem_downsample=4), (0.5,) * 3, (0.5,) * 3).eval()
    config = AttackConfig("autoattack", eps=8 / 255, steps=2, queries=5)
    run = tmp_path / "runs" / "autoattack-tiny"
    run_attack(model, data, run, configs=[config], num_classes=10, batch_size=4, checks=False, progress=False)
    assert main(["status", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out == f"{run}: attack, {RunStore(run).description()['model']}: 2 of 2 chunks written (finished)\n"

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
    out = capsys.readouterr().out.splitlines()
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

    # damaged records are named, never summarized
    clean_chunk = store.chunk_path("clean", 0, 4)
    clean_chunk.write_bytes(clean_chunk.read_bytes() + b"0")
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("  records unreadable: ") and "top-1" not in "".join(out)


def test_status_refuses_what_is_not_a_run(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert "neither a run directory" in capsys.readouterr().err
