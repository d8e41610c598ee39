"""Attacks that save their progress within a run (robust_attn.attacks.progress): killed at any
point and resumed from what they saved, they return what an uninterrupted run returns; a stop
signal makes them save first (robust_attn.attacks.stopping)."""
import argparse
import os
import signal
import time

import pytest
import torch
import torch.nn as nn

from robust_attn.attacks import AttackConfig, make_attack
from robust_attn.attacks.progress import Progress
from robust_attn.attacks.stopping import StopRequested, stop_deferred, stop_requested


class Killed(Exception):
    pass


class Net(nn.Module):
    """A tiny random CNN; ``kill_after`` forward calls, it raises :class:`Killed`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                  nn.Linear(32, 10))
        self.calls, self.kill_after = 0, None

    def forward(self, x):
        self.calls += 1
        if self.kill_after is not None and self.calls > self.kill_after:
            raise Killed
        return self.body(x)


def _data(n=12):
    g = torch.Generator().manual_seed(1)
    images = torch.rand(n, 3, 8, 8, generator=g)
    net = Net().eval()
    with torch.no_grad():
        labels = net(images).argmax(1)   # every image correct: all are attacked
    labels[0] = (labels[0] + 1) % 10     # but one, which the attacks leave alone
    return net, images, labels


def _killed_then_resumed(config, kill_after):
    """Run ``config`` killed after ``kill_after`` forward calls, saving at every chance, then resume
    from the last save; returns (whole, resumed, saves, calls of the whole run, calls resumed)."""
    net, images, labels = _data()
    whole = make_attack(config).run(net, images, labels)
    calls_whole = net.calls
    saves = []
    attack = make_attack(config)
    attack.progress = Progress(None, saves.append, attack=config.attack, device=images.device, every_s=0)
    net.calls, net.kill_after = 0, kill_after
    with pytest.raises(Killed):
        attack.run(net, images, labels)
    assert saves, "nothing was saved before the kill"
    again = make_attack(config)
    again.progress = Progress(saves[-1], lambda _: None, attack=config.attack, device=images.device, every_s=0)
    net.calls, net.kill_after = 0, None
    resumed = again.run(net, images, labels)
    return whole, resumed, saves, calls_whole, net.calls


@pytest.mark.parametrize("kill_after", [7, 29, 41])   # in the first restart, early and late; in the second
def test_square_killed_anywhere_resumes_to_the_uninterrupted_result(kill_after):
    config = AttackConfig("square", eps=64 / 255, queries=20, restarts=2, seed=3)
    whole, resumed, saves, calls_whole, calls_resumed = _killed_then_resumed(config, kill_after)
    assert torch.equal(resumed.adv, whole.adv) and torch.equal(resumed.queries, whole.queries)
    assert saves[-1]["restart"] == (1 if kill_after > 22 else 0) and saves[-1]["attack"] == "square"
    assert calls_resumed < calls_whole - kill_after + 5   # the work before the last save was not done again
    fooled = (1 < whole.queries) & (whole.queries < 41)   # some images fooled (in either restart), some not
    assert 3 <= fooled.sum() <= 9 and (whole.queries > 21).any() and fooled[whole.queries > 21].any()


@pytest.mark.parametrize("kill_after", [9, 20])
def test_apgd_t_killed_between_target_runs_resumes_to_the_uninterrupted_result(kill_after):
    """Each target run is 1 + 3 forward-backward passes here; the state is saved before each."""
    config = AttackConfig("apgd-t", eps=16 / 255, steps=3, seed=5, options={"n_target_classes": 6})
    whole, resumed, saves, calls_whole, calls_resumed = _killed_then_resumed(config, kill_after)
    assert torch.equal(resumed.adv, whole.adv)
    assert saves[-1]["runs_done"] >= 1 and calls_resumed < calls_whole
    net, images, labels = _data()
    assert 3 <= (net(whole.adv).argmax(1) != labels).sum() <= 10   # some fooled, some not


@pytest.mark.parametrize("kill_after", [20, 30])
def test_fab_t_killed_between_target_classes_resumes_to_the_uninterrupted_result(kill_after):
    """About 10 forward calls per target class here; the state is saved before each class but the first."""
    config = AttackConfig("fab-t", eps=16 / 255, steps=3, seed=5, options={"n_target_classes": 4})
    whole, resumed, saves, calls_whole, calls_resumed = _killed_then_resumed(config, kill_after)
    assert torch.equal(resumed.adv, whole.adv)
    assert saves[-1]["target_class"] >= 3 and calls_resumed < calls_whole - 5
    net, images, labels = _data()
    assert 3 <= (net(whole.adv).argmax(1) != labels).sum() <= 10   # some fooled, some not


def test_autoattack_keeps_a_members_progress_in_its_state_and_resumes_inside_the_member(tmp_path):
    """The ensemble's state file carries Square's progress; a chunk killed in the middle of
    Square resumes there. Progress saved on another device type is not used (a warning), and
    the member starts again: the result is the same."""
    config = AttackConfig("autoattack", eps=24 / 255, steps=3, queries=25, seed=2,
                          options={"attacks": ["apgd-ce", "square"]})
    net, images, labels = _data()
    whole = make_attack(config).run(net, images, labels)
    calls_whole = net.calls
    state = tmp_path / "state.pt"
    aa = make_attack(config)
    aa.state_path, aa.progress_every_s, lines = state, 0, []
    aa.log = lines.append
    net.calls, net.kill_after = 0, 25   # APGD-CE: 1 + 1 + 4 calls; Square then 1 + its queries
    with pytest.raises(Killed):
        aa.run(net, images, labels)
    saved = torch.load(state, weights_only=True)
    assert saved["done"] == 1 and saved["member"]["attack"] == "square" and saved["member"]["run"]["it"] >= 10
    robust = sum(b == "" for b in whole.by)   # Square fools none of APGD-CE's survivors here
    done = lines.index(f"autoattack linf eps=24/255: apgd-ce done, {robust} of 12 images still robust")
    assert lines[:done] == [f"autoattack linf eps=24/255: apgd-ce: run 1 of 1: iterate {k} of 3, 11 images not "
                            f"fooled yet (progress saved)" for k in (1, 2)]   # APGD-CE saved within its run
    it = saved["member"]["run"]["it"]
    assert lines[-1] == (f"autoattack linf eps=24/255: square: query {it + 1} of 25 (restart 1 of 1), {robust} "
                         f"images not fooled yet (progress saved)")
    again = make_attack(config)
    again.state_path = state
    net.calls, net.kill_after = 0, None
    resumed = again.run(net, images, labels)
    assert resumed.by == whole.by and torch.equal(resumed.adv, whole.adv)
    assert torch.equal(resumed.queries, whole.queries)
    assert net.calls < calls_whole - 15
    assert saved["member"]["device"] == "cpu"   # Square's generator is a CPU one on every device
    torch.Generator().set_state(saved["member"]["gen"])   # which a GPU run would resume from too
    saved["member"]["device"] = "cuda"   # a CUDA generator's state (saved before robust_attn.attacks.rng)
    torch.save(saved, state)
    other = make_attack(config)
    other.state_path = state
    net.calls = 0
    with pytest.warns(UserWarning, match="starts again"):
        rerun = other.run(net, images, labels)
    assert rerun.by == whole.by and torch.equal(rerun.adv, whole.adv)
    assert net.calls > calls_whole - 10   # Square ran from its beginning (APGD-CE did not)



def test_progress_fits_where_the_generator_it_holds_lives():
    """A progress is tagged with the device type of the generator whose state it holds: APGD and
    Square draw from a CPU generator on every device and FAB-T from the CPU's global one, so all
    four members' progress is tagged ``cpu`` and moves between a GPU and a CPU; a state tagged
    ``cuda`` (a CUDA generator's, saved before) does not fit them, one tagged None fits anywhere."""
    from robust_attn.attacks.base import ATTACKS

    state = {"attack": "fab-t", "device": "cuda", "target_class": 4}
    assert Progress(state, lambda _: None, attack="fab-t", device=None).state is state
    with pytest.warns(UserWarning, match="starts again"):
        assert Progress(state, lambda _: None, attack="fab-t", device=torch.device("cpu")).state is None
    with pytest.warns(UserWarning, match="starts again"):   # another attack's progress never fits
        assert Progress(state, lambda _: None, attack="square", device=None).state is None
    untagged = {"attack": "fab-t", "device": None, "target_class": 4}   # FAB-T's, saved before the tag
    assert Progress(untagged, lambda _: None, attack="fab-t", device=torch.device("cpu")).state is untagged
    assert all(ATTACKS[n].portable_progress for n in ("apgd-ce", "apgd-t", "fab-t", "square"))
    saves = []
    Progress(None, saves.append, attack="fab-t", device=None).save({"k": torch.ones(1)})
    assert saves[0]["device"] is None and saves[0]["attack"] == "fab-t"



class Signalled(Net):
    """:class:`Net` that sends itself SIGTERM once, at its ``signal_at``-th forward call (what
    ``timeout`` or a scheduler's preemption does to a study)."""

    signal_at = None

    def forward(self, x):
        if self.calls + 1 == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(x)


def test_a_stop_signal_saves_the_members_progress_then_stops_and_the_rerun_gives_the_uninterrupted_result(tmp_path):
    """SIGTERM in the middle of Square, long before a periodic save is due: the ensemble saves
    Square's progress at its next query, raises StopRequested (the CLI exits 143), puts the
    signal handlers back, and running it again resumes there with the uninterrupted result."""
    config = AttackConfig("autoattack", eps=24 / 255, steps=3, queries=25, seed=2,
                          options={"attacks": ["apgd-ce", "square"]})
    net, images, labels = _data()
    whole = make_attack(config).run(net, images, labels)
    calls_whole = net.calls
    net = Signalled()
    net.load_state_dict(_data()[0].state_dict())
    net.eval().signal_at = 20   # APGD-CE: 1 + 1 + 4 calls; Square then 1 + its queries
    state, before = tmp_path / "state.pt", signal.getsignal(signal.SIGTERM)
    aa = make_attack(config)
    aa.state_path, aa.progress_every_s = state, 1e9   # no periodic save: only the signal makes one
    with pytest.raises(StopRequested) as stopped:
        aa.run(net, images, labels)
    assert stopped.value.signum == signal.SIGTERM and "run the same command again" in str(stopped.value)
    assert signal.getsignal(signal.SIGTERM) is before and not stop_requested()
    assert net.calls <= 22   # stopped at the first save point after the signal, not at the end
    saved = torch.load(state, weights_only=True)
    assert saved["done"] == 1 and saved["member"]["attack"] == "square" and saved["member"]["run"]["it"] >= 5
    again = make_attack(config)
    again.state_path = state
    net.calls, net.signal_at = 0, None
    resumed = again.run(net, images, labels)
    assert resumed.by == whole.by and torch.equal(resumed.adv, whole.adv)
    assert torch.equal(resumed.queries, whole.queries) and net.calls < calls_whole - 15


def test_a_second_stop_signal_stops_at_once_and_a_block_left_with_a_signal_noted_raises():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StopRequested):
        with stop_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop_requested() and Progress(None, lambda _: None, attack="x", device=None, every_s=1e9).due()
            with pytest.raises(KeyboardInterrupt, match="second SIGTERM") as second:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)   # the handler runs in the main thread before this returns
            assert not isinstance(second.value, StopRequested)
    assert signal.getsignal(signal.SIGTERM) is before and not stop_requested()
    with stop_deferred():   # without a signal the block changes nothing
        pass


def test_the_cli_reports_a_stop_and_exits_as_if_killed_by_the_signal(capsys):
    from robust_attn.cli import _run

    def stopped(args):
        raise StopRequested(signal.SIGTERM)

    args = argparse.Namespace(command="study", func=stopped)
    assert _run(argparse.ArgumentParser(), args, []) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after saving the attack's progress" in capsys.readouterr().err
    args.func = lambda a: (_ for _ in ()).throw(KeyboardInterrupt())   # Ctrl-C elsewhere: 130, no traceback
    assert _run(argparse.ArgumentParser(), args, []) == 130
    assert "interrupted (Ctrl-C); what was finished is saved: run the same command again" in capsys.readouterr().err


@pytest.mark.parametrize("config", [AttackConfig("apgd-t", eps=16 / 255, steps=3, seed=5, options={"n_target_classes": 6}),
                                    AttackConfig("square", eps=64 / 255, queries=20, restarts=2, seed=3),
                                    AttackConfig("square", norm="l2", eps=1.0, queries=20, seed=3)],
                         ids=["apgd-t", "square", "square-l2"])
def test_apgd_and_square_draw_every_random_number_from_a_cpu_generator(config, monkeypatch):
    """Every random number APGD and Square use is drawn through robust_attn.attacks.rng, from a CPU
    generator (whatever device the images are on: then moved there), so the generator state in a
    saved progress resumes on any device. A draw made anywhere else, or from a device's own
    generator, fails here; the result is unchanged (bit for bit) by the spying."""
    import sys

    net, images, labels = _data()
    plain = make_attack(config).run(net, images, labels)
    draws = []

    def spy(draw):
        def wrapped(*args, generator=None, **kw):
            draws.append((sys._getframe(1).f_globals["__name__"], generator.device.type if generator else None))
            return draw(*args, generator=generator, **kw)
        return wrapped

    for name in ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
                 "multinomial", "normal"):
        monkeypatch.setattr(torch, name, spy(getattr(torch, name)))
    spied = make_attack(config).run(net, images, labels)
    assert draws and set(draws) == {("robust_attn.attacks.rng", "cpu")}
    assert torch.equal(spied.adv, plain.adv)


@pytest.mark.parametrize("kill_after", [17, 27])   # within the second target class, within the third
def test_fab_t_killed_within_a_target_class_resumes_at_the_iteration_it_saved(kill_after):
    """FAB-T saves after any iteration of a targeted run (fab_run.py), not only between target
    classes: killed in the middle of one, it resumes at its last iteration, not at the class's start."""
    config = AttackConfig("fab-t", eps=16 / 255, steps=3, seed=5, options={"n_target_classes": 4})
    whole, resumed, saves, calls_whole, calls_resumed = _killed_then_resumed(config, kill_after)
    assert torch.equal(resumed.adv, whole.adv)
    assert "run" in saves[-1] and saves[-1]["run"]["it"] >= 1 and saves[-1]["attack"] == "fab-t"
    assert calls_resumed <= calls_whole - kill_after + 3   # at most one iteration (3 calls) done again


@pytest.mark.parametrize("kill_after", [6, 8])   # 3 forward calls before the first iterate, then one each
def test_apgd_ce_killed_within_its_one_run_resumes_at_the_iterate_it_saved(kill_after):
    """APGD-CE is one run (no target classes to save between): it saves after any iterate of its
    run (apgd_single_run's state), so a kill in the middle resumes there, not at its start."""
    config = AttackConfig("apgd-ce", eps=16 / 255, steps=6, seed=5)
    whole, resumed, saves, calls_whole, calls_resumed = _killed_then_resumed(config, kill_after)
    assert torch.equal(resumed.adv, whole.adv)
    assert saves[-1]["runs_done"] == 0 and saves[-1]["run"]["k"] == kill_after - 3
    # calls_whole counts _data's labelling call too: resumed, the 2 calls before x(0) run again, but
    # neither x(0) nor the iterates saved
    assert calls_resumed == (calls_whole - 1) - kill_after + 2


def test_a_progress_keeps_its_members_time_over_resumptions_and_status_tells_the_pace(monkeypatch):
    """Each save records the fraction of the member's iterations done and the seconds it has run,
    added over the processes that resumed it, and the fraction at which that count began (0: the
    member's start; for a state saved before the count, the first save after resuming it).
    ``robust-attn status`` (describe_state) turns them into the time spent and roughly the time
    left at that pace; a state saved before either existed reads as before."""
    import robust_attn.attacks.progress as progress_module
    from robust_attn.attacks.autoattack import AutoAttack

    clock = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    saves = []
    resumed = {"attack": "square", "device": "cpu", "elapsed": 5400.0, "counted_from": 0.0, "fraction": 0.3}
    progress = Progress(resumed, saves.append, attack="square", device=torch.device("cpu"))
    clock[0] = 600.0
    progress.save({"run": 1}, note="query 2000 of 5000", fraction=0.4)
    assert saves[0]["elapsed"] == 6000.0 and saves[0]["fraction"] == 0.4 and saves[0]["counted_from"] == 0.0
    aa = make_attack(AttackConfig("autoattack", eps=8 / 255, steps=3, queries=25, seed=2))
    assert isinstance(aa, AutoAttack)
    state = {"done": 3, "robust": torch.tensor([True, False, True]), "member": saves[0]}
    assert aa.describe_state(state) == ("3 of 4 members done, 2 of 3 images robust; square: query 2000 of 5000; "
                                        "1.7 h in it, about 2.5 h left at that pace")
    old = {"attack": "square", "device": "cpu", "note": "query 1000 of 5000"}   # saved before the count
    assert aa.describe_state({**state, "member": old}) == ("3 of 4 members done, 2 of 3 images robust; square: "
                                                           "query 1000 of 5000")
    progress = Progress(old, saves.append, attack="square", device=torch.device("cpu"))
    clock[0] = 1000.0
    progress.save({"run": 1}, note="query 2000 of 5000", fraction=0.4)   # the count starts here
    clock[0] = 1600.0
    progress.save({"run": 1}, note="query 3000 of 5000", fraction=0.6)
    assert saves[1]["elapsed"] == 0.0 and saves[2]["elapsed"] == 600.0 and saves[2]["counted_from"] == 0.4
    assert aa.describe_state({**state, "member": saves[2]}).endswith(
        "query 3000 of 5000; about 20 min left at its recent pace")   # 0.2 done in 600 s, 0.4 left


@pytest.mark.parametrize("config", [AttackConfig("apgd-t", eps=16 / 255, steps=3, seed=5, options={"n_target_classes": 6}),
                                    AttackConfig("square", eps=64 / 255, queries=20, restarts=2, seed=3),
                                    AttackConfig("fab-t", eps=16 / 255, steps=3, seed=5, options={"n_target_classes": 4})],
                         ids=["apgd-t", "square", "fab-t"])
def test_the_fraction_a_member_saves_grows_with_its_iterations(config):
    net, images, labels = _data()
    attack, saves = make_attack(config), []
    attack.progress = Progress(None, saves.append, attack=config.attack, device=images.device, every_s=0)
    attack.run(net, images, labels)
    fractions = [s["fraction"] for s in saves]
    assert len(fractions) >= 5 and fractions == sorted(fractions) and 0 < fractions[0] and fractions[-1] <= 1
