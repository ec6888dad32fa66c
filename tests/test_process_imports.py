"""The launcher and the API servers stay small processes: what they import at start never pulls in
torch (the engine core alone holds the model, ~240 MB of it being torch itself)."""
import subprocess
import sys

LIGHT_MODULES = ["nanoserve.cli", "nanoserve.entrypoints.openai.launcher", "nanoserve.entrypoints.openai.api_server",
                 "nanoserve.model.default", "nanoserve.errors"]


def test_launcher_and_api_server_modules_do_not_import_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in LIGHT_MODULES)
            + "heavy = sorted(m for m in ('torch', 'transformers', 'nanoserve.engine.core') if m in sys.modules)\n"
            + "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

