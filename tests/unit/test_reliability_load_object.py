"""load_object finds a user's module in the working directory without letting it shadow installed packages."""

import subprocess
import sys
import textwrap


def test_a_file_in_the_working_directory_does_not_shadow_an_installed_package(tmp_path):
    work, scripts = tmp_path / "work", tmp_path / "scripts"
    work.mkdir(), scripts.mkdir()
    (work / "peft.py").write_text("SHADOW = True\n")
    (work / "my_env_for_load_object.py").write_text("class MyEnv:\n    pass\n")
    # A script outside the working directory: `python -c` would put the working directory first by itself.
    (scripts / "probe.py").write_text(textwrap.dedent("""
        import importlib.util, os, sys
        sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
        from agentrl.envs.base import load_object
        print(load_object("my_env_for_load_object:MyEnv").__name__)
        print(importlib.util.find_spec("peft").origin)
    """))
    done = subprocess.run([sys.executable, str(scripts / "probe.py")], cwd=work, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    name, peft_origin = done.stdout.split()
    assert name == "MyEnv" and not peft_origin.startswith(str(work))
