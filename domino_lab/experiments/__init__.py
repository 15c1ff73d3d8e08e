"""Experiments that reproduce the paper's comparisons at laptop scale, one command each:

    python -m domino_lab.experiments list
    python -m domino_lab.experiments run same_data           # -> experiments/results/same_data.{md,json}
    python -m domino_lab.experiments run block_size --quick  # minutes: tiny budgets, for tests and smoke runs

Specs live in experiments/specs/*.yaml; see spec.py for the format.
"""
