"""The attack step of the three families whose default path changed, against the path they took
before, in one process (interleaved, process CPU time, one thread), on the trained CIFAR-10 zoo
models at batch 64:

* sasa_resnet26: the logits' relative term in the compiled window pass (``window_dot_rel``) against
  the previous separate pass over the logits (the pre-change ``_stream_logits``, reproduced here);
* gsa_resnet26: the axial positional layers in the factored order (lean path) against the paper's
  order (the GSA layers alone set to ``impl = "reference"``);
* ea_resnet26: the attack copy with External Attention's output batch norm folded
  (``foldable_conv_bn``) against the copy without (the attribute emptied).

Also the largest logit difference and the input-gradient signs that differ between the two.

    python benchmarks/bench_new_paths.py
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _attack_variants import attack_step  # noqa: E402
from _measure import machine_description, step_time_ms, write_json  # noqa: E402
from bench_efficiency import build  # noqa: E402

import robust_attn.layers.local_attention as local_attention  # noqa: E402
from robust_attn.attacks.fast_model import fold_batchnorm  # noqa: E402
from robust_attn.layers.external_attention import ExternalAttention  # noqa: E402
from robust_attn.layers.gsa import GlobalSelfAttention2d  # noqa: E402


def _previous_stream_logits(qc, kp, rel, offsets, logits):
    """SASA's logits as computed before: the content term in the window pass, then the relative
    term as a matmul (more than 4 channels per head) or a chain of multiply-adds over the logits."""
    local_attention.window_dot(qc, kp, offsets, logits)
    if qc.shape[2] > 4:
        local_attention._offset_last(logits).add_(torch.matmul(rel.transpose(1, 2), qc.flatten(3)))
        return logits
    flat = logits.flatten(3)
    for c in range(qc.shape[2]):
        flat.addcmul_(qc[:, :, c].flatten(2), rel[:, c].t()[:, None, :, None])
    return logits


def _sasa(model, x):
    current = local_attention._stream_logits
    copy, _ = fold_batchnorm(model)

    def use(previous: bool):
        local_attention._stream_logits = _previous_stream_logits if previous else current
    return {"previous": (copy, lambda: use(True)), "current": (copy, lambda: use(False))}


def _gsa(model, x):
    copy, _ = fold_batchnorm(model)
    layers = [m for m in copy.modules() if isinstance(m, GlobalSelfAttention2d)]

    def use(impl: str):
        for m in layers:
            m.impl = impl
    return {"previous": (copy, lambda: use("reference")), "current": (copy, lambda: use("lean"))}


def _ea(model, x):
    current, _ = fold_batchnorm(model)
    declared = ExternalAttention.foldable_conv_bn
    ExternalAttention.foldable_conv_bn = ()
    try:
        previous, _ = fold_batchnorm(model)
    finally:
        ExternalAttention.foldable_conv_bn = declared
    return {"previous": (previous, lambda: None), "current": (current, lambda: None)}


CASES = {"sasa_resnet26": _sasa, "gsa_resnet26": _gsa, "ea_resnet26": _ea}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "new_paths_cpu.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{machine_description()}; load average {' '.join(load)} (shared machine: compare the ratios)")
    rows = []
    for name, case in CASES.items():
        model, x = build(name, 32, args.batch)
        with torch.no_grad():
            labels = model(x).argmax(1)
        xc = x.contiguous(memory_format=torch.channels_last)
        paths = case(model, x)
        out, times = {}, {}
        for key, (module, switch) in paths.items():
            switch()
            step = attack_step(module, xc, labels)
            grad = step()
            with torch.no_grad():
                out[key] = (module(xc), grad)
            times[key] = []
        for _ in range(args.repeats):
            for key, (module, switch) in paths.items():
                switch()
                times[key].append(step_time_ms(attack_step(module, xc, labels))[0])
        paths["current"][1]()
        ms = {key: statistics.median(t) for key, t in times.items()}
        row = {"family": name, "batch": args.batch, "previous_ms": ms["previous"], "current_ms": ms["current"],
               "speedup": ms["previous"] / ms["current"],
               "max_logit_diff": (out["current"][0] - out["previous"][0]).abs().max().item(),
               "grad_signs_differing": int((out["current"][1].sign() != out["previous"][1].sign()).sum()),
               "grad_elements": out["current"][1].numel()}
        rows.append(row)
        print(f"{name:<16} previous {ms['previous']:7.1f} ms  current {ms['current']:7.1f} ms  "
              f"{row['speedup']:.2f}x  max logit diff {row['max_logit_diff']:.1e}  "
              f"gradient signs differing {row['grad_signs_differing']}/{row['grad_elements']}", flush=True)
    write_json(args.out, {"benchmark": "attack step, previous vs current default path, one process",
                          "machine": machine_description(), "threads": 1, "load_average_at_start": load,
                          "timing": f"median of {args.repeats} interleaved process-CPU-time steps",
                          "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
