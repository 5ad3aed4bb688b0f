"""README's set-up commands: `python3 .ci/readme.py N` prints the Nth (1 = run the main job,
2 = run the tests). CI runs both as written; tests/test_readme.py reads them the same way."""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def setup_commands(readme: str | None = None) -> list[str]:
    text = README.read_text() if readme is None else readme
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


if __name__ == "__main__":
    print(setup_commands()[int(sys.argv[1]) - 1])
