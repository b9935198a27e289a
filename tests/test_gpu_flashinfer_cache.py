"""scripts/gpu_flashinfer_cache.sh on a stand-in FlashInfer (its two paths only): the libraries a
host built travel as FlashInfer's ahead-of-time layout, and only to a host of the same version and
arch. The real FlashInfer runs only on the GPU host."""

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_flashinfer_cache.sh"
BUILT = ("sampling", "norm")


def stand_in_flashinfer(root: Path, jit_subdir: str) -> Path:
    """A `flashinfer.jit.env` whose cache lies under root/home and AOT folder at root/aot."""
    package = root / "py" / "flashinfer" / "jit"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "env.py").write_text(textwrap.dedent(f"""
        import pathlib
        FLASHINFER_CACHE_DIR = pathlib.Path({str(root / "home/.cache/flashinfer")!r})
        FLASHINFER_JIT_DIR = FLASHINFER_CACHE_DIR / {jit_subdir!r}
        FLASHINFER_AOT_DIR = pathlib.Path({str(root / "aot")!r})
    """))
    return root / "py"


def run(step: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *step], cwd=cwd, env={"PATH": os.environ["PATH"], **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def packed(tmp_path):
    """A host that built two libraries (and sources beside them) packed them under its $OUT."""
    host = tmp_path / "built"
    jit = host / "home/.cache/flashinfer/0.6.15.post1/90a/cached_ops"
    for name in BUILT:
        (jit / name).mkdir(parents=True)
        (jit / name / f"{name}.so").write_bytes(name.encode() * 100)
        (jit / name / f"{name}.cuda.o").write_bytes(b"object")
    python = stand_in_flashinfer(host, "0.6.15.post1/90a/cached_ops")
    out = host / "out"
    out.mkdir()
    done = run(["pack"], host, HOME=str(host / "home"), PYTHONPATH=str(python), OUT=str(out))
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("jit_subdir, installed", [
    ("0.6.15.post1/90a/cached_ops", BUILT),
    ("0.6.15.post1/100a/cached_ops", ()),  # another arch: its libraries would fail to load
    ("0.6.16/90a/cached_ops", ()),
])  # fmt: skip
def test_a_fresh_host_gets_the_packed_libraries_only_where_version_and_arch_match(
    packed, tmp_path, jit_subdir, installed
):
    repo = tmp_path / "repo"
    repo.mkdir()
    kept = run(["keep", str(packed)], repo)
    assert kept.returncode == 0, kept.stderr
    fresh = tmp_path / "fresh"
    python = stand_in_flashinfer(fresh, jit_subdir)
    done = run(["install"], repo, PYTHONPATH=str(python))
    assert done.returncode == 0, done.stderr
    aot = fresh / "aot"
    found = sorted(p.relative_to(aot).as_posix() for p in aot.rglob("*")) if aot.exists() else []
    assert found == sorted([*installed, *(f"{n}/{n}.so" for n in installed)])
    for name in installed:  # the bytes the host built, not only the names
        assert (aot / name / f"{name}.so").read_bytes() == name.encode() * 100


def test_an_unknown_step_exits_2_naming_the_steps(tmp_path):
    done = run(["unpack"], tmp_path)
    assert done.returncode == 2 and "pack|keep FILES_DIR|install" in done.stderr
