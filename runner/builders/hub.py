"""`model.pretrained: org/name`: a Hugging Face Hub model, found through huggingface_hub's cache as
transformers finds it.

A name that is no local path and is written as a Hub repo id (`meta-llama/Llama-3.2-1B`,
`bert-large-uncased`) is resolved by `snapshot_download` into the cache transformers shares
(HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub): online it asks the Hub which
commit the revision (model.revision, default `main`) is and fetches what is missing; with
HF_HUB_OFFLINE=1, or when the Hub cannot be reached, the cached snapshot is used, and without one
the line says the exact `hf download` command and the cache it fills. The result is the snapshot
directory (`models--org--name/snapshots/<commit>`), which everything else reads as a local
directory of save_pretrained output; its folder name, the commit, is the revision a check keeps.

Only the files ckrun reads are fetched: the JSON files (config.json, the shard index) and the
safetensors weights, or PyTorch .bin/.pt/.pth state dicts where a repo has no safetensors. The
checks before training (validate, estimate, tune --predict) need a transformers model's config
alone: online they fetch only the JSON files, so predicting a 70B model downloads no weights.
"""

from __future__ import annotations

import functools
import logging
import shlex
from pathlib import Path

log = logging.getLogger(__name__)

CONFIG_FILES = ["*.json"]
SAFETENSORS = ["*.safetensors"]
OTHER_WEIGHTS = ["*.bin", "*.pt", "*.pth"]  # older repos: read with weights_only, never unpickled code
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def hub_name(text: str) -> str | None:
    """`text` as a Hub repo id, or None when it is a local path: an existing file or directory, or
    written as a path (`/`, `./`, `~`, more than one `/`) rather than as `org/name` or `name`, by
    huggingface_hub's own rule for repo ids."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(text).expanduser().exists():
        return None
    try:
        validate_repo_id(text)
    except HFValidationError:
        return None
    return text


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), as huggingface_hub read it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> Path:
    """Where huggingface_hub keeps models: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def in_hub_cache(directory: Path) -> bool:
    """Whether `directory` is a snapshot in a Hub cache (`models--org--name/snapshots/<commit>`)."""
    return directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--")


def hub_origin(directory: Path) -> tuple[str, str] | None:
    """(the Hub repo id, the commit) a snapshot in a Hub cache holds; None for any other directory.
    huggingface_hub names the folder `models--org--name` (a repo id has no `--` of its own)."""
    if not in_hub_cache(directory):
        return None
    folder = directory.parent.parent.name.removeprefix("models--")
    return folder.replace("--", "/"), directory.name


def redownload_command(directory: Path, path: Path) -> str | None:
    """`hf download ... --force-download`: a damaged file of a cache snapshot fetched again (a cached blob
    is otherwise kept as it is); None when `directory` is no snapshot."""
    origin = hub_origin(directory)
    if origin is None:
        return None
    repo, commit = origin
    return shlex.join(["hf", "download", repo, path.relative_to(directory).as_posix(), "--revision", commit,
                       "--force-download", "--cache-dir", str(directory.parent.parent.parent)])


def locate(repo: str, revision: str | None, weights: bool) -> Path:
    """The snapshot directory of `repo` at `revision` in the cache, fetched first where the Hub is
    reachable: the JSON files, and with `weights` the weights too. Offline the weights are looked for
    either way (it costs nothing), so a cache without them is one line before any training, not at
    the build. A one-line ValueError when the snapshot cannot be had."""
    if not (weights or offline()):
        return _snapshot(repo, revision, CONFIG_FILES)
    snapshot = _snapshot(repo, revision, CONFIG_FILES + SAFETENSORS)
    if not _holds_weights(snapshot):  # no safetensors in the repo: its PyTorch files
        snapshot = _snapshot(repo, revision, CONFIG_FILES + OTHER_WEIGHTS)
    if not _holds_weights(snapshot):
        raise ValueError(f"the Hub model {repo} ({_at(revision, snapshot)}) holds no weights ckrun reads "
                         f"(*.safetensors, *.bin, *.pt, *.pth){_download_hint(repo, revision)}")
    if weights:
        log.info("model.pretrained %s: %s in %s", repo, _at(revision, snapshot), cache_dir())
    return snapshot


def _snapshot(repo: str, revision: str | None, patterns: list[str]) -> Path:
    """The snapshot; online found once per process and cache (validate's checks and the build ask alike,
    and each asking is a round trip to the Hub; only a snapshot found is remembered), offline looked up
    in the cache each time (it is only files)."""
    if offline():
        return _found.__wrapped__(repo, revision, tuple(patterns), True, str(cache_dir()))
    return _found(repo, revision, tuple(patterns), False, str(cache_dir()))


@functools.lru_cache(maxsize=64)
def _found(repo: str, revision: str | None, patterns: tuple[str, ...], offline_mode: bool, cache: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(patterns), cache_dir=cache,
                                      local_files_only=offline_mode))
    except GatedRepoError:
        raise ValueError(f"the Hub model {repo} is gated: accept its terms at https://huggingface.co/{repo} and "
                         "log in with `hf auth login` (or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"the Hub has no model {repo} (or it is private: log in with `hf auth login`); give an "
                         "existing org/name or a local directory") from None
    except RevisionNotFoundError:
        raise ValueError(f"the Hub model {repo} has no revision {revision!r}; give a branch, tag or commit "
                         "hash in model.revision") from None
    except LocalEntryNotFoundError:
        raise ValueError(missing_line(repo, revision, list(patterns))) from None
    except (HfHubHTTPError, OSError) as err:  # the Hub answered with an error, or the cache cannot be written
        raise ValueError(f"the Hub model {repo} could not be fetched into {cache_dir()}: {_first(err)}") from None


def missing_line(repo: str, revision: str | None, patterns: list[str]) -> str:
    """The one line for a model neither cached nor reachable: what to download, and into which cache."""
    why = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
    at = f" at revision {revision}" if revision else ""
    return (f"no local directory {repo!r}, and the Hub model {repo}{at} is not in the Hugging Face cache "
            f"{cache_dir()} ({why}); download it where there is network with `{download_command(repo, revision, patterns)}` "
            "(or give a local directory)")


def download_command(repo: str, revision: str | None, patterns: list[str]) -> str:
    """`hf download ...`: the files ckrun reads, into the cache this process uses."""
    words = ["hf", "download", repo]
    if revision:
        words += ["--revision", revision]
    for pattern in patterns:
        words += ["--include", pattern]
    return shlex.join([*words, "--cache-dir", str(cache_dir())])


def _download_hint(repo: str, revision: str | None) -> str:
    if not offline():
        return ""
    return f"; download them with `{download_command(repo, revision, CONFIG_FILES + SAFETENSORS)}`"


def _holds_weights(snapshot: Path) -> bool:
    """Whether the snapshot names a weight file: a link whose blob is gone, or something that is no file,
    counts too, so the weights' own check (weight_files.py) names it rather than a line saying there is none."""
    return any(path.suffix in WEIGHT_SUFFIXES for path in snapshot.rglob("*") if not path.is_dir())


def _at(revision: str | None, snapshot: Path) -> str:
    return f"revision {revision}, commit {snapshot.name}" if revision else f"commit {snapshot.name}"


def _first(err: BaseException) -> str:
    from ..problems import first_line

    return first_line(err, 200)
