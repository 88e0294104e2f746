"""Run a MiniMax-M3-shaped target with its EAGLE3 draft, with and without speculation.

The bundled tiny model zoo this example runs by default has not landed yet; until it does, the
script says so and exits with status 1 instead of pretending.
"""

from __future__ import annotations

import sys
from pathlib import Path

ZOO = Path(__file__).resolve().parent.parent / "specdec" / "zoo"


def main() -> int:
    target, draft = ZOO / "minimax-m3-tiny", ZOO / "minimax-m3-tiny-eagle3"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        print(
            "run_minimax_m3: the bundled MiniMax-M3-shaped model and its EAGLE3 draft are not in this "
            f"checkout yet (looked for {target.name} and {draft.name} under specdec/zoo); "
            "they arrive with the model-zoo work.",
            file=sys.stderr,
        )
        return 1
    raise NotImplementedError("the engine and zoo are present but this example has not been wired up")


if __name__ == "__main__":
    sys.exit(main())
