"""Character-level language modelling on Tiny Shakespeare (nanoGPT's ``shakespeare_char``): GPT-2-architecture
models with concatenated or collaborative heads trained from scratch through ``collab_attn.training.train``, and a
trained model converted by ``collab_attn.reparametrize``.

- ``data``: the character vocabulary, the 90/10 split in order, seeded training blocks, fixed validation blocks;
- ``kinds``: the attention kinds, one entry each (what it takes, its sizes, its run name, how its config is built);
- ``models``: the model configs (concatenated heads, reduced-key concatenated heads, collaborative heads);
- ``runs``: one training run and the sweep, one result JSON per run;
- ``convert``: the conversion grid on a trained model, before and after a short re-training;
- ``runs_summary``: tables, learning curves and the README fragments;
- ``race_summary``: the cache race's tables and plot.

Nothing in the library imports this package; the scripts do (``scripts/train_lm.py``, ``scripts/convert_lm.py``).
"""
