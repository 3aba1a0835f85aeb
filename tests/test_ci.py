"""What CI runs under the newest JAX the pin admits (`.ci/run`'s second venv, Python 3.12): the files
listed in tests/jax_versions.txt. A test file that runs a Pallas kernel (imports `dsv41_jax.pallas` or
takes the `pallas_impl` fixture) must be listed, or a kernel could break on that JAX unseen. And what the
default run needs beside the package: NVIDIA Dynamo (scripts/install_dynamo.sh), installed by `.ci/run` and
README's command 1."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "jax_versions.txt"


def _listed() -> set[str]:
    return {ln.strip() for ln in LIST.read_text().splitlines() if ln.strip()}


def test_every_kernel_test_file_runs_under_both_jax_ends():
    # an import statement of dsv41_jax.pallas (not a mention in a string), or the pallas_impl fixture taken
    uses_kernels = re.compile(r"^\s*(from dsv41_jax\.pallas\b|import dsv41_jax\.pallas\b|from dsv41_jax import pallas\b)"
                              r"|^\s*def test_\w*\([^)]*\bpallas_impl\b", re.M)
    kernel_files = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                    if p.name != "test_ci.py" and uses_kernels.search(p.read_text())}
    assert kernel_files, "found no kernel test file: the pattern above is out of date"
    missing = sorted(kernel_files - _listed())
    assert not missing, f"kernel tests not run under the newest JAX in CI; add them to {LIST.name}: {missing}"


def test_listed_files_exist_and_ci_runs_the_list():
    absent = sorted(f for f in _listed() if not (ROOT / f).is_file())
    assert not absent, f"{LIST.name} names files that do not exist: {absent}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tests/jax_versions.txt" in ci and "find_python.sh 3.12" in ci


def test_ci_and_readme_install_dynamo_for_the_default_run():
    """The live Dynamo tests (tests/test_dynamo.py) are in the default run and fail without Dynamo: `.ci/run` and
    README's command 1 install it (scripts/install_dynamo.sh) after the package, and pytest's default marker
    expression does not leave them out."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pip install -q -e '.[test]' && scripts/install_dynamo.sh" in ci
    block = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    assert "pip install -e '.[test]' && scripts/install_dynamo.sh && " in block
    addopts = re.search(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert "dynamo" not in addopts, addopts
    assert re.search(r"^pytestmark = pytest\.mark\.dynamo$", (ROOT / "tests" / "test_dynamo.py").read_text(), re.M)
