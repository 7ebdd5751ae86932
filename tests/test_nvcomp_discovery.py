"""Finding nvCOMP without a GPU: the installed nvidia-libnvcomp wheels' library paths that `import cumem_rs`
hands to the native module, and what `info` says of compression where the CUDA backend is not loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cumem_rs
from cumem_rs import _native, _nvcomp


def _fake_wheel(site: Path, major: int, with_library: bool = True) -> Path:
    """The files an nvidia-libnvcomp-cu<major> wheel installs that discovery looks at (an empty library file)."""
    lib = site / "nvidia" / "libnvcomp" / "lib64" / "libnvcomp.so.6"
    lib.parent.mkdir(parents=True, exist_ok=True)
    if with_library:
        lib.write_bytes(b"")
    (site / f"nvidia_libnvcomp_cu{major}-6.0.0.12.dist-info").mkdir()
    return lib


def _discover(*sites: Path) -> list:
    """wheel_libraries() in a fresh interpreter whose path holds `sites` (namespace packages are looked up once per
    process, so this one's own `nvidia` packages stay out of it)."""
    code = "from cumem_rs import _nvcomp; print(_nvcomp.wheel_libraries())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, sites), *sys.path]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return eval(out.stdout)  # noqa: S307 - our own repr of a list of (int, str)


def test_an_installed_cu13_wheel_is_found_with_its_cuda_major(tmp_path: Path) -> None:
    lib = _fake_wheel(tmp_path, 13)
    assert (13, str(lib)) in _discover(tmp_path)


def test_a_cu12_wheel_says_12_and_wheels_in_two_sites_are_both_found(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    lib12 = _fake_wheel(a, 12)
    lib13 = _fake_wheel(b, 13)
    found = _discover(a, b)
    assert (12, str(lib12)) in found and (13, str(lib13)) in found


def test_a_wheel_is_found_beside_a_regular_nvidia_package(tmp_path: Path) -> None:
    """torch's own nvidia wheels may make `nvidia` a regular package (with an __init__.py) in another directory,
    earlier on the path: the nvCOMP wheel is still found."""
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "nvidia").mkdir(parents=True)
    (first / "nvidia" / "__init__.py").write_text("")
    lib = _fake_wheel(second, 13)
    assert (13, str(lib)) in _discover(first, second)


def test_a_wheel_without_its_library_is_not_handed_over(tmp_path: Path) -> None:
    _fake_wheel(tmp_path, 13, with_library=False)
    assert all(not path.startswith(str(tmp_path)) for _, path in _discover(tmp_path))


def test_hand_over_never_raises_on_a_broken_native_side() -> None:
    class Broken:
        def set_nvcomp_wheels(self, wheels: list) -> None:
            raise RuntimeError("broken")

    _nvcomp.hand_over(Broken())  # nvCOMP is optional: import cumem_rs must survive this


def test_the_native_module_takes_the_hand_over_and_rejects_a_bad_one() -> None:
    _native.set_nvcomp_wheels([(13, "/nonexistent/libnvcomp.so.6")])
    _native.set_nvcomp_wheels(_nvcomp.wheel_libraries())
    with pytest.raises(TypeError):
        _native.set_nvcomp_wheels([("thirteen", 1)])  # type: ignore[list-item]


@pytest.mark.skipif(cumem_rs.cuda_available(), reason="checks the answer without a CUDA backend")
def test_without_the_cuda_backend_info_says_why_there_is_no_codec() -> None:
    assert _native.cuda_codec_status() == (False, "the CUDA backend is not loaded")
    assert _native.cuda_codec_device_bytes(0) == 0
    lines = _nvcomp.status_lines()
    assert lines[0] == "codec: none: the CUDA backend is not loaded"


def test_the_round_trip_diagnostic_needs_the_cuda_backend_and_names_a_bad_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        _native._codec_round_trip(0, 0, 1 << 21, 1 << 20, "int4")
    if not cumem_rs.cuda_available():
        with pytest.raises(cumem_rs.CumemError):
            _native._codec_round_trip(0, 0, 1 << 21, 1 << 20, "bits16")
