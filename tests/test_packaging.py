"""What a user installs: the wheel's metadata and files, and training where the optional packages are missing."""

import email
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import flashdp

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("flashdp-*.whl")
    return built


def test_wheel_carries_one_version_an_spdx_license_and_type_information(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(metadata_name))
    assert metadata["Version"] == flashdp.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "flashdp/py.typed" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    required = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert not any(r.startswith(("triton", "transformers")) for r in required), required


def test_trains_where_triton_and_transformers_cannot_be_imported():
    script = textwrap.dedent(
        """
        import sys
        for name in ("triton", "transformers", "peft"):
            sys.modules[name] = None  # import raises ImportError, as where it is not installed
        import torch, flashdp
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for kernels in ("auto", "torch"):
            for mode in ("bk", "ghost"):
                engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0,
                                              optimizer=opt, expected_batch_size=4, sample_rate=0.1, kernels=kernels)
                x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
                engine.backward(torch.nn.functional.cross_entropy(model(x), y, reduction="none"))
                engine.step()
                engine.detach()
        assert "triton" not in sys.modules or sys.modules["triton"] is None
        print("trained")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and "trained" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("version", ["3.10", "3.12", "3.13"])
def test_the_source_compiles_on_every_supported_python(version):
    """Syntax only (torch is installed for one Python here): what a newer feature would break at import."""
    candidates = [
        *Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"),
        shutil.which(f"python{version}"),
    ]
    python = next((str(c) for c in candidates if c and _runs(str(c))), None)
    if python is None:
        pytest.skip(f"no python{version} on this machine")
    sources = [str(p) for p in (ROOT / "src" / "flashdp").rglob("*.py")]
    script = "import sys\nfor f in sys.argv[1:]: compile(open(f, encoding='utf-8').read(), f, 'exec')"
    result = subprocess.run([python, "-c", script, *sources], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def _runs(python: str) -> bool:
    return subprocess.run([python, "-c", "pass"], capture_output=True).returncode == 0
