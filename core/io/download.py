"""Model download into huggingface_hub's own cache (and HF_* settings): a model there is reused, a rerun resumes.
Only what mlight reads is fetched; remote code, unsupported architectures, pickle-only repos and a full disk are
refused before any weight is fetched.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import platform
from core.errors import MlightError, ModelError, UnsupportedModelError
from core.telemetry import EventSink, Progress, WarningEvent, ignore

# files mlight reads besides the weights (a tokenizer ships some subset of these)
SUPPORT_FILES = (
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX = "model.safetensors.index.json"
DISK_MARGIN = 256 * 2**20  # leave some room: a full disk breaks more than the download
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class DownloadProgress(Progress):
    file: str = ""
    rate: float = 0.0  # bytes per second since this download started


def looks_like_repo_id(text: str) -> bool:
    return bool(REPO_ID.match(text)) and ".." not in text


def resolve_model(model: str | None, revision: str | None = None, progress: EventSink = ignore,
                  **download_kw: Any) -> tuple[Path, str]:
    """(local checkpoint folder, a name for it) for `--model`: None → demo, a folder, or a repo id."""
    if model is None:
        from core.model.demo import demo_model_dir

        return demo_model_dir(progress), "mlight-demo"
    path = Path(model).expanduser()
    try:
        exists = path.exists()
    except OSError as e:  # a name too long for the file system, say
        raise ModelError(f"model folder {model} cannot be opened: {e.strerror}", "give a shorter path") from e
    if exists:
        if not path.is_dir():
            if path.suffix.lower() == ".gguf":
                return path, path.stem
            raise ModelError(f"--model {model} is a file, not a model folder",
                             "give the folder holding config.json and the .safetensors files, or a .gguf file")
        if not os.access(path, os.R_OK | os.X_OK):
            raise ModelError(f"cannot read model folder {model}: permission denied", "fix its permissions")
        if not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            raise ModelError(f"{model} has no config.json, so it is not a model folder",
                             "give the folder holding config.json and the .safetensors files (or a .gguf file)")
        return path, path.name
    repo, _, tag = model.partition(":")  # owner/name:Q4_K_M picks one GGUF of a repo holding several
    if looks_like_repo_id(repo):
        return download_model(repo, revision, progress=progress, gguf=tag or None, **download_kw), model
    if platform.path_too_long(path):
        raise ModelError(f"model folder {model} cannot be opened: its path is {len(str(path))} characters, past "
                         f"Windows' limit of {platform.WINDOWS_MAX_PATH - 1}",
                         "move the model to a shorter path, or enable long paths (LongPathsEnabled) in Windows")
    raise ModelError(f"model folder {model} does not exist",
                     "give a checkpoint folder, a Hugging Face repo id (org/name), or omit --model for the demo")


def download_model(repo_id: str, revision: str | None = None, *, progress: EventSink = ignore,
                   cache_dir: str | Path | None = None, endpoint: str | None = None,
                   token: str | bool | None = None, gguf: str | None = None) -> Path:
    """The snapshot folder, or a GGUF repo's one model file (`gguf`: a tag such as Q4_K_M, among several)."""
    from huggingface_hub import constants

    kw = dict(cache_dir=str(cache_dir) if cache_dir else None, token=token)
    endpoint = endpoint or constants.ENDPOINT  # resolved now: some hub helpers bind it at import time
    if constants.is_offline_mode():
        return _from_cache(repo_id, revision, kw, why="HF_HUB_OFFLINE is set", gguf=gguf)
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:
        if _is_network(e):
            return _from_cache(repo_id, revision, kw, why=f"the Hub ({endpoint}) cannot be reached",
                               cause=e, gguf=gguf)
        raise _hub_error(e, repo_id, revision) from e
    sizes = {s.rfilename: (s.size or 0) for s in (info.siblings or [])}
    sha = info.sha or revision or "main"
    fetch = functools.partial(_fetch, repo_id, sha, dict(kw, endpoint=endpoint))

    top = [f for f in sizes if "/" not in f]  # subfolders hold other formats (original/, onnx/, ...)
    if any(f.lower().endswith(".gguf") for f in sizes) and not any(f.endswith(".safetensors") for f in top):
        # a repo of GGUF files (llama.cpp's format) rather than a transformers checkpoint
        files = _choose_gguf(repo_id, list(sizes), gguf)
        _check_gguf_arch(repo_id, getattr(info, "gguf", None))
        _check_disk(sum(sizes.get(f, 0) for f in files if not _cached(repo_id, f, sha, kw)), cache_dir)
        return Path(_fetch_all(repo_id, files, sum(sizes.get(f, 0) for f in files), fetch, progress)[0])
    wanted = _choose_files(repo_id, sizes, top)
    noted = not all(_cached(repo_id, f, sha, kw) for f in wanted)
    if noted:  # before the first file lands in the cache
        _note_symlinks(repo_id, cache_dir, progress)
    # config.json by the name the user gave (so the hub cache records refs/<revision> for offline use),
    # everything else by the commit it resolved to, so all files come from one commit
    cfg_path = _fetch(repo_id, revision or "main", dict(kw, endpoint=endpoint), "config.json", None)
    try:
        cfg = json.loads(Path(cfg_path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{repo_id}/config.json is not valid JSON: {e}", "pick another revision or repo") from e
    from core.model.families import spec_from_config

    spec_from_config(cfg, source=f"{repo_id}/config.json")  # refuses remote code and unknown architectures
    if INDEX in wanted:
        index = fetch(INDEX, None)
        try:
            shards = set(json.loads(Path(index).read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(f"{repo_id}/{INDEX} is not a valid index: {e}", "pick another revision or repo") from e
        missing = [s for s in shards if s not in sizes]
        if missing:
            raise ModelError(f"{repo_id}: its {INDEX} names {missing[0]}, which the repo does not have",
                             "the repo is incomplete; pick another revision or repo")
        wanted = [f for f in wanted if not f.endswith(".safetensors")] + sorted(shards)
    todo = [f for f in wanted if not _cached(repo_id, f, sha, kw)]
    total = sum(sizes.get(f, 0) for f in todo)
    _check_disk(total, cache_dir)
    if todo and not noted:  # a resumed download: only shards were missing
        _note_symlinks(repo_id, cache_dir, progress)
    _fetch_all(repo_id, todo, total, fetch, progress)
    return Path(cfg_path).parent


def _choose_gguf(repo_id: str, names: list[str], tag: str | None) -> list[str]:
    """A single file or every part of a split one."""
    from core.model.gguf.files import SPLIT

    sets: dict[str, list[str]] = {}
    for f in sorted(n for n in names if n.lower().endswith(".gguf")):
        name = f.rsplit("/", 1)[-1]
        if name.lower().startswith("mmproj"):
            continue  # vision projectors ship beside the language model
        m = SPLIT.match(name)
        key = f[:len(f) - len(name)] + (m["base"] if m else name)
        sets.setdefault(key, []).append(f)
    listing = ", ".join(sorted(k.rsplit("/", 1)[-1] for k in sets)) or "none"
    if tag:
        sets = {k: v for k, v in sets.items() if tag.lower() in k.lower()}
    if len(sets) == 1:
        return next(iter(sets.values()))
    if not sets:
        raise ModelError(f"{repo_id} has no GGUF file matching {tag!r}", f"it has: {listing}")
    listing = ", ".join(sorted(k.rsplit("/", 1)[-1] for k in sets))
    raise ModelError(f"{repo_id} holds {len(sets)} GGUF models ({listing})",
                     f"name one: --model {repo_id}:TAG (e.g. {repo_id}:Q4_K_M)")


def _check_gguf_arch(repo_id: str, meta: dict | None) -> None:
    """Refuse before downloading when the Hub already says which architecture the GGUF holds."""
    from core.model.families import REGISTRY
    from core.model.gguf.arch import ARCHS

    arch = (meta or {}).get("architecture")
    if arch and ARCHS.get(arch) not in REGISTRY:
        raise UnsupportedModelError(f"{repo_id} is a GGUF of architecture {arch!r}, which mlight does not run",
                                    f"supported GGUF architectures: {', '.join(a for a, h in ARCHS.items() if h in REGISTRY)}")


def _choose_files(repo_id: str, sizes: dict[str, int], top: list[str]) -> list[str]:
    weights = [f for f in top if f.endswith(".safetensors")]
    if not weights:
        pickles = [f for f in top if f.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise ModelError(f"{repo_id} ships only PyTorch pickle weights ({pickles[0]}); mlight reads safetensors "
                             "only, because loading pickles can run arbitrary code",
                             "pick a repo (or a revision) that has .safetensors files")
        raise ModelError(f"{repo_id} has no .safetensors weights", "check the repo id")
    if "config.json" not in sizes:
        raise ModelError(f"{repo_id} has no config.json, so it is not a transformers model",
                         "check the repo id")
    return [f for f in top if f in SUPPORT_FILES] + (weights if INDEX not in sizes else [INDEX])


def _fetch(repo_id: str, revision: str, kw: dict, filename: str, tracker: _Tracker | None) -> str:
    from huggingface_hub import hf_hub_download

    bar = {"tqdm_class": tracker} if tracker else {}
    try:
        return hf_hub_download(repo_id, filename, revision=revision, **kw, **bar)
    except Exception as e:
        raise _hub_error(e, repo_id, revision, filename) from e


def _fetch_all(repo_id: str, files: list[str], total: int, fetch, progress: EventSink) -> list[str]:
    tracker = _Tracker(f"downloading {repo_id}", total, progress)
    tracker.emit(force=True)
    paths = []
    for f in files:
        tracker.file = f
        paths.append(fetch(f, tracker))
    tracker.emit(force=True)
    return paths


def _cached(repo_id: str, filename: str, revision: str, kw: dict) -> bool:
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, filename, cache_dir=kw.get("cache_dir"), revision=revision)
    return isinstance(hit, str) and os.path.isfile(hit)


def _from_cache(repo_id: str, revision: str | None, kw: dict, why: str, cause: Exception | None = None,
                gguf: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      allow_patterns=list(SUPPORT_FILES) + ["*.safetensors", "*.gguf"], **kw))
    except Exception:  # noqa: BLE001 — not cached (or a partial cache): say why we could not fetch it
        hint = ("unset HF_HUB_OFFLINE so that it can be downloaded" if cause is None else
                "check the network (or HF_ENDPOINT), or download it first with `mlight download "
                f"{repo_id}` where the Hub can be reached")
        raise MlightError(f"{why} and {repo_id} is not in the local cache", hint) from cause
    if not (path / "config.json").is_file():
        names = [str(p.relative_to(path)) for p in path.rglob("*.gguf")]
        if names:
            return path / _choose_gguf(repo_id, names, gguf)[0]
        raise MlightError(f"{why} and the cached copy of {repo_id} is incomplete",
                          f"rerun `mlight download {repo_id}` with the network on")
    return path


def _free_bytes(folder: Path) -> int:
    for p in [folder, *folder.parents]:
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 1 << 62  # cannot tell; let the download try


def _check_disk(needed: int, cache_dir: str | Path | None) -> None:
    from huggingface_hub import constants

    folder = Path(cache_dir or constants.HF_HUB_CACHE)
    free = _free_bytes(folder)
    if needed + DISK_MARGIN > free:
        raise MlightError(f"not enough disk space: the download needs {_gb(needed)} and {folder} has {_gb(free)} free",
                          "free some space, or point HF_HOME at a bigger disk")


def _note_symlinks(repo_id: str, cache_dir: str | Path | None, progress: EventSink) -> None:
    """Windows without Developer Mode: the hub cache keeps plain copies. Said once, as a WarningEvent; probing
    the repo's cache folder quietly first leaves huggingface_hub nothing to print through the progress line."""
    if not platform.is_windows():
        return
    from huggingface_hub import constants
    from huggingface_hub.file_download import are_symlinks_supported, repo_folder_name

    folder = Path(cache_dir or constants.HF_HUB_CACHE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ok = are_symlinks_supported(folder / repo_folder_name(repo_id=repo_id, repo_type="model"))
    if not ok:
        progress(WarningEvent(f"{folder} cannot hold symlinks (Windows without Developer Mode), so the Hugging Face "
                              "cache keeps plain copies: each revision of a model takes its full size on disk. "
                              "Turn on Developer Mode in Windows' settings to share files between revisions"))


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _is_network(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "TimeoutException", "TransportError", "ConnectionError",
                         "OfflineModeIsEnabled", "LocalEntryNotFoundError"})


def _hub_error(e: Exception, repo_id: str, revision: str | None, filename: str | None = None) -> MlightError:
    if isinstance(e, MlightError):
        return e
    names = {c.__name__ for c in type(e).__mro__}
    what = f"{repo_id}/{filename}" if filename else repo_id
    if "EntryNotFoundError" in names and _is_network(e):
        names.discard("EntryNotFoundError")
    known = {"GatedRepoError": (f"{repo_id} is gated: its license must be accepted first",
                                "accept it on the model's page and log in with `hf auth login`"),
             "RepositoryNotFoundError": (f"{repo_id} was not found on the Hugging Face Hub (or it is private)",
                                         "check the repo id, or log in with `hf auth login`"),
             "RevisionNotFoundError": (f"revision {revision} not found in {repo_id}", "check --revision"),
             "HFValidationError": (f"{repo_id!r} is not a valid Hugging Face repo id", "use the form org/name"),
             "RemoteEntryNotFoundError": (missing := (f"{what} is missing from the repo",
                                                      "the repo is incomplete; pick another revision")),
             "EntryNotFoundError": missing}
    hit = next((known[n] for n in known if n in names), None)
    if hit:
        return ModelError(*hit)
    if _is_network(e):
        return MlightError(f"the download of {what} failed: the connection to the Hub was lost",
                           "rerun the same command; files already downloaded are kept")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return MlightError(f"disk full while downloading {what}", "free some space and rerun the same command")
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return MlightError(f"the download of {what} failed: {first}",
                       "rerun the same command; files already downloaded are kept")


class _Tracker:
    """Sums bytes over a download's files into rate-limited DownloadProgress events. Passed as huggingface_hub's
    `tqdm_class`, it is every file's bar (and Xet's transfer bar reports into it, uncounted)."""

    def __init__(self, what: str, total: int, sink: EventSink):
        self.what, self.total, self.sink = what, total, sink
        self.done, self.file = 0, ""
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()  # huggingface_hub may update from worker threads

    def __call__(self, *args: Any, initial: int = 0, **kwargs: Any) -> _Tracker:  # a file's bar: a resume's bytes
        if initial:
            self.update(initial)
        return self

    def update(self, n: float | None = 1) -> None:
        with self.lock:
            self.done += int(n or 0)
        self.emit()

    def emit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        rate = self.done / max(now - self.t0, 1e-6)
        self.sink(DownloadProgress(self.what, self.done, self.total, "B", file=self.file, rate=rate))

    def __enter__(self) -> _Tracker:
        return self

    def close(self, *a: Any, **k: Any) -> None:
        pass

    __exit__ = set_description = set_postfix_str = update_transfer = set_transfer_postfix_str = close
