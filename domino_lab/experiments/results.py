"""How the measurement scripts in experiments/ leave their results: `<stem>.json` (the numbers, for later reading)
and `<stem>.md` (the table a reader opens), each written whole, then the markdown printed."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import atomic_path


def write_results(folder: str | Path, stem: str, data: dict, markdown: str) -> None:
    folder = Path(folder)
    with atomic_path(folder / f"{stem}.json") as tmp:
        tmp.write_text(json.dumps(data, indent=1))
    with atomic_path(folder / f"{stem}.md") as tmp:
        tmp.write_text(markdown)
    print(markdown)
