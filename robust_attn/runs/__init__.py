"""The run store: what a protocol writes and a report reads.

* :mod:`.store`: a run directory (run.json with its schema version, per-image record chunks,
  their checksums), resumable and sharded; :class:`~robust_attn.runs.store.RunStore`;
* :mod:`.migrations`: run.json's schema versions, and runs of an earlier one read in the current layout;
* :mod:`.claims`: a chunk claimed before it is computed, so several processes share a run;
* :mod:`.packing`: a finished run packed into one gzip CSV with checksums, to commit beside a report;
* :mod:`.sealing`: adopting runs written before checksums existed, and
  ``python -m robust_attn.runs.sealing verify|seal|repair RUN_DIR...``.
"""
