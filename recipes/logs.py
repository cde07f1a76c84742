"""JSON-lines run logs: one JSON object per line, written by the main process only."""
import json
import time
from pathlib import Path
from typing import Any


class JsonlLogger:
    """Appends one JSON object per line (main process only), flushed at once."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, **record: Any) -> None:
        if not self.enabled:
            return
        record.setdefault('time', time.time())
        with self.path.open('a') as f:
            f.write(json.dumps(record) + '\n')
