"""The cases the notebooks study, apart from the instruments that study them.

* ``zoo``: notebook 07's failure zoo (why memory did not drop), each case broken and fixed;
* ``field``: notebook 07c's cases from the field (state that changes between forward and re-run,
  and other ways checkpointing goes wrong), one record each;
* ``real``: notebook 07b's GPT-2 (``transformers``), per-layer variants;
* ``examples``: small models for ``python -m ckpt_lab.explain``.

``ckpt_lab.explain`` (the instrument) and ``ckpt_lab.bench`` (the harness) import none of these.
"""
