"""common/demo_data.py: the built-in demo set, the same bytes wherever it is generated, made once however many
processes ask for it at the same time."""

import subprocess

from common import demo_data
from harness.processes import PYTHON, REPO


def test_the_demo_set_is_the_same_wherever_it_is_generated(tmp_path):
    for name in ("a", "b"):
        demo_data.generate(tmp_path / name, train_per_class=2, val_per_class=1, num_classes=10)
    files = sorted(path.relative_to(tmp_path / "a") for path in (tmp_path / "a").rglob("*.jpg"))
    assert len(files) == 30 and {path.parts[1] for path in files} == set(demo_data.CLASSES)
    assert all((tmp_path / "a" / path).read_bytes() == (tmp_path / "b" / path).read_bytes() for path in files)


def test_processes_that_ask_for_it_at_once_get_one_whole_set(tmp_path):
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from common import demo_data; "
        f"print(demo_data.ensure_demo_dataset({str(tmp_path / 'demo')!r}, train_per_class=3, val_per_class=1))"
    )
    processes = [subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    assert [process.communicate(timeout=120)[0].strip() for process in processes] == [str(tmp_path / "demo")] * 3
    assert len(list((tmp_path / "demo").rglob("*.jpg"))) == 40
    assert sorted(path.name for path in tmp_path.iterdir()) == [".demo.lock", "demo"]  # no temporary left
