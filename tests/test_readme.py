"""README's two set-up commands stay true: CI runs both exactly as documented."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    spec = importlib.util.spec_from_file_location("ci_readme", ROOT / ".ci" / "readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.setup_commands()


def test_readme_has_exactly_two_setup_commands():
    commands = _commands()
    assert len(commands) == 2
    assert "duet up configs/local-pd.yaml" in commands[0] and "127.0.0.1:8000/v1/chat/completions" in commands[0]
    assert commands[0].startswith("python3 -m venv .venv") and "pip install -e . " in commands[0]
    assert commands[1].endswith("pytest -q")


def test_ci_runs_both_readme_commands():
    readme_test = _commands()[1].split("&& ", 2)[-1]  # after creating and activating the venv
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'bash -c "$(python3 .ci/readme.py 1)"' in ci
    assert ci.strip().splitlines()[-1] == readme_test
