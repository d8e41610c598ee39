"""The study: every model, every protocol, one report.

* :mod:`.config`: what a study runs (:class:`~robust_attn.study.config.StudyConfig`) and its TOML
  files (``robust-attn study CONFIG.toml``);
* :mod:`.models`: which models, loaded from their specs, and the images each is evaluated on;
* :mod:`.run`: :func:`~robust_attn.study.run.run_study`, the steps the protocols registered
  (:mod:`robust_attn.protocols.study_step`), timings and the report.
"""
