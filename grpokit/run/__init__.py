"""A run's files: the job a spec describes, its output directory, checkpoints and what they hold, and every file
written atomically.

- :mod:`.job` and :mod:`.job_spec`: a whole training job from one spec (a YAML file's contents, the demo's preset),
  and the spec's shape checked without importing torch;
- :mod:`.run_dir`: output directories owned by one run at a time;
- :mod:`.checkpoints`, :mod:`.checkpoint_parts`, :mod:`.checkpoint_weights`: checkpoints that survive interruptions,
  the state they hold beyond transformers' files, resuming models saved under other names;
- :mod:`.files` and :mod:`.file_checks`: every file written beside its place, flushed and renamed; reading a file's
  framing without loading it;
- :mod:`.file_rendezvous`: processes that meet through files where no collective can be used.
"""
