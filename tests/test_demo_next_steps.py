"""The README's next step after the demo: real MoE checkpoints of covered families, each with its download,
quantize and chat lines (tests/integration/test_demo_next_steps.py runs those lines on tiny models)."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"ibm-granite/granite-3.1-1b-a400m-instruct": "granitemoe", "allenai/OLMoE-1B-7B-0125-Instruct": "olmoe"}


def readme_next_steps() -> dict[str, list[list[str]]]:
    """hub id -> the README's commands for it (`hf download ID`, then the smoe lines up to the next download)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Next: a real MoE checkpoint"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    steps: dict[str, list[list[str]]] = {}
    for line in filter(None, block.splitlines()):
        words = shlex.split(line)
        if words[:2] == ["hf", "download"]:
            steps[words[2]] = []
        else:
            steps[list(steps)[-1]].append(words)
    return steps


def test_the_readme_names_checkpoints_of_two_covered_families_with_their_three_lines():
    steps = readme_next_steps()
    assert set(steps) == set(FAMILIES)
    for hub_id, commands in steps.items():
        assert [c[:2] for c in commands] == [["smoe", "quantize"], ["smoe", "chat"]]
        assert commands[0][2] == hub_id and commands[1][2] == commands[0][commands[0].index("-o") + 1]
