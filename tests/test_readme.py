"""README.md stays true: its python example runs as written."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_example_runs(capsys):
    (block,) = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
    exec(compile(block, "README.md example", "exec"), {"__name__": "readme"})
    assert "torch.Size" in capsys.readouterr().out
