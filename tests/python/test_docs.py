"""Generated documents match the code: the README's environment-variable table (from the
engine's own table) and docs/horovod_compat.md (every Horovod name, flag and variable, from
ferrovod's modules, parser and table)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_env_table_matches_the_engine() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "env_table.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_variable_the_engine_reads_is_in_its_table() -> None:
    """src/config/ reads variables only through its VARS table: any FERROVOD_ literal read
    elsewhere in src/ would be undocumented."""
    config = ROOT / "src" / "config"
    assert (config / "mod.rs").is_file(), "the configuration module moved: update this test"
    offenders = []
    for path in (ROOT / "src").rglob("*.rs"):
        if path.is_relative_to(config):
            continue
        text = path.read_text()
        if "std::env::var" in text or "env::var(" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], f"environment read outside src/config/: {offenders}"


def test_horovod_compat_table_is_current_and_accounts_for_every_name() -> None:
    """A Horovod name, flag or variable that ferrovod neither provides nor explains, or a
    table that no longer says what the code does, fails here."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compat_table.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
