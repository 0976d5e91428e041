"""A service started before an environment's package was installed finds it (a fresh Python
process, so that what it imported at start is real)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ENVIRONMENT = '''
from flywheel.sdk.environment import Environment, Reward


def load_environment() -> Environment:
    return Environment(name="late_env", tasks=[{"prompt": "hi"}], rewards=[Reward(lambda completion: 1.0, name="one")])
'''


def test_an_environment_installed_after_start_is_found(tmp_path: Path) -> None:
    site_dir, source = tmp_path / "site-packages", tmp_path / "src"
    site_dir.mkdir()
    code = textwrap.dedent(f"""
        import pathlib, site
        site.addsitedir({str(site_dir)!r})  # a site folder known at start, as a venv's is
        from flywheel.sdk.environment import load_environment

        # Installed while the process runs, as an editable install does: the package's folder and
        # a .pth in the site folder that puts it on the path (Python reads .pth files at start).
        package = pathlib.Path({str(source)!r}) / "late_env"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text({ENVIRONMENT!r})
        (pathlib.Path({str(site_dir)!r}) / "late_env.pth").write_text({str(source)!r} + "\\n")
        print(load_environment("late_env").name)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "late_env"
