"""README's two set-up commands stay true: CI runs exactly the documented test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = _commands()
    assert len(commands) == 2
    assert "duet up configs/local-pd.yaml" in commands[0] and "127.0.0.1:8000/v1/chat/completions" in commands[0]
    assert commands[1].endswith("pytest -q")


def test_ci_runs_the_readme_test_command():
    readme_test = _commands()[1].split("&& ", 2)[-1]  # after creating and activating the venv
    ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci_lines[-1] == readme_test
