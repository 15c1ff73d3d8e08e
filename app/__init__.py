"""The domino-lab dashboard (Gradio): watch speculative decoding live, inspect the Domino correction per
token, compare head off / on, browse MLflow runs. `python -m app --help`.

Layout: main.py (CLI + launch), ui.py (Blocks layout and wiring), catalog.py (the known targets and drafters,
loaded once and cached), decode.py (streaming decode + rendering), inspector.py (per-token top-k views),
runs.py (MLflow view). `app` imports `domino_lab`, never the reverse.
"""
