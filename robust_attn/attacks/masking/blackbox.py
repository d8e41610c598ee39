"""Check ``blackbox_beats_whitebox``: images a black-box (Square) or transfer attack fools that
the white-box attack at the same eps did not (Carlini et al. 2019, section 5.2)."""
from __future__ import annotations

from typing import Collection, Mapping

import pandas as pd

from robust_attn.attacks.masking import near_miss
from robust_attn.attacks.masking.evidence import MaskingCheck, first_indices, verdict_word, success_by_index


def check_blackbox_beats_whitebox(white: pd.DataFrame | Mapping[str, pd.DataFrame],
                                  black: Mapping[str, pd.DataFrame], condition: str | None = None,
                                  near: Mapping[str, Collection[int]] | None = None) -> MaskingCheck:
    """Flag when any image that a black-box or transfer attack fools was not fooled by the
    white-box attack at the same eps (Carlini et al. 2019, 5.2: a gradient-free or transfer
    attack beating the white-box one means the gradients mislead it).

    ``white``: the white-box attack's records, or, where the black-box sources ran at different
    radii, source name -> the white-box records at that source's eps; ``black``: source name ->
    records (Square, or a transfer attack evaluated on this model) at the same eps and the same
    meaning of success (both untargeted, or both toward the same targets). Images are matched by
    ``index``; only images in both are compared. ``condition`` selects the white-box condition in
    ``white``; each black-box frame must hold one condition. Evidence per source: compared,
    black-box and white-box successes, ``beats`` (the count) and the first :data:`MAX_INDICES` of
    their indices.

    ``near``: source name -> the images that are near misses of the white-box attack
    (:mod:`robust_attn.attacks.masking.near_miss`). Those a source wins are counted apart
    (``near_misses``, with their indices) and do not flag while they are rare for the model: the
    images that are a near miss of any source, among the images compared
    (:func:`~robust_attn.attacks.masking.near_miss.excused`); past that every source's count as
    beats too (``near_misses_counted``).
    """
    if not isinstance(black, Mapping) or not black:
        raise ValueError("black must map a source name (e.g. 'square', 'transfer:resnet26') to its records")
    whites = white if isinstance(white, Mapping) else {source: white for source in black}
    missing = [source for source in black if source not in whites]
    if missing:
        raise ValueError(f"no white-box records for {', '.join(map(repr, missing))}: give the white-box attack's "
                         "records at each black-box source's eps")
    compared: dict = {}
    for source, frame in black.items():
        white_success = success_by_index(whites[source], condition, "white-box records")
        black_success = success_by_index(frame, None, f"records of {source!r}")
        common = white_success.index.intersection(black_success.index)
        if len(common) == 0:
            raise ValueError(f"records of {source!r} share no image index with the white-box records; "
                             f"compare attacks run on the same images")
        w, b = white_success.loc[common], black_success.loc[common]
        won = common[(b & ~w).to_numpy()]
        close = set((near or {}).get(source, ()))
        compared[source] = (common, w, b, won, [i for i in won if int(i) in close])
    # near misses are excused while rare for the model: every source's together, on the images compared
    missed_anywhere = {int(i) for *_, missed in compared.values() for i in missed}
    images = set().union(*(set(map(int, common)) for common, *_ in compared.values()))
    counted = not near_miss.excused(len(missed_anywhere), len(images))
    evidence: dict = {}
    total = 0
    for source, (common, w, b, won, missed) in compared.items():
        beats = list(won) if counted else [i for i in won if i not in missed]
        total += len(beats)
        evidence[source] = {"compared": len(common), "black_success": int(b.sum()), "white_success": int(w.sum()),
                            "beats": len(beats), "indices": first_indices(beats)}
        if missed:
            evidence[source].update(near_misses=len(missed), near_miss_indices=first_indices(missed),
                                    near_misses_counted=counted, near_miss_rule=near_miss.rule())
    parts = [f"{s}: {e['beats']} of {e['compared']}" for s, e in evidence.items()]
    nears = [f"{s}: {e['near_misses']}" for s, e in evidence.items()
             if e.get("near_misses") and not e["near_misses_counted"]]
    many = [f"{s}: {e['near_misses']}" for s, e in evidence.items() if e.get("near_misses_counted")]
    if total:
        detail = "images fooled by a black-box/transfer attack but not by the white-box one: " + "; ".join(parts)
    else:
        detail = ("the white-box attack fools every image the black-box/transfer attacks fool"
                  + (", near misses aside" if nears else "") + " ("
                  + "; ".join(f"{s}: {e['compared']} compared" for s, e in evidence.items()) + ")")
    if nears:
        detail += ("; near misses of the white-box attack, not counted (PGD from the clean image closed at least "
                   f"{near_miss.NEAR_MISS:.0%} of their clean margin): " + "; ".join(nears))
    if many:
        detail += (f"; counted among them: near misses on {len(missed_anywhere)} of the {len(images)} images compared, "
                   f"more than {near_miss.RARE:.0%} (a gradient that keeps stopping short of the boundary where a "
                   "black-box attack crosses it): " + "; ".join(many))
    return MaskingCheck("blackbox_beats_whitebox", verdict_word(total > 0), detail, evidence)
