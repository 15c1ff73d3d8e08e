"""The embedded default target's own training (and any small target or assistant LM like it), and its card.

    recipe.py    TargetRecipe (experiments/configs/target*.yaml, assistant.yaml), `load_recipe`, `apply_quick`
    module.py    TargetLM (the LightningModule), its progress lines
    train.py     `train(recipe, out_dir, runs_dir)`: data, tokenizer, the run and the atomic export
    quality.py   the measurements behind the target card (experiments/target_card.py)
    __main__.py  `python -m domino_lab.pretrain`

Importing this package is cheap; `module` and `train` load Lightning and transformers.
"""
