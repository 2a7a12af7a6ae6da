"""Download a published checkpoint (a repo of any family the registry knows) into the local Hugging Face cache.

This is the only place OmniDesk uses the network, and only when the user asks
for it (``omnidesk models download``).  ``huggingface_hub.snapshot_download``
does the work: files that finished downloading are kept in the cache, so an
interrupted download continues where it stopped when run again, and a
complete one is not fetched twice.  Only the files the loader reads are
fetched (no README, images or other extras).  The result is the snapshot
directory that :func:`omnidesk.models.checkpoint.resolve_checkpoint` finds for the
repo id.  What each known repo needs is in the registry (``families.RECOMMENDED``).
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

from .checkpoint import CheckpointError, hf_hub_cache, resolve_checkpoint


class DownloadError(RuntimeError):
    """The download failed; the message names the repo, the reason and what to do."""


# Everything the loaders read (config, weights + index, voices, tokenizer, chat template,
# feature-extractor config; Moshi: its two safetensors and tokenizer_spm_32k_3.model).  Left out: README/.gitattributes, images and other assets.
ALLOW_PATTERNS = [
    "*.json",  # config, generation_config, preprocessor_config, index, tokenizer jsons, vocab.json
    "*.safetensors",
    "spk_dict.pt",
    "merges.txt",
    "vocab.json",
    "tokenizer*",
    "chat_template*",
]

_UNREACHABLE = {"ConnectError", "ConnectTimeout", "ConnectionError", "TimeoutException", "ProxyError",
                "NewConnectionError", "MaxRetryError", "gaierror"}


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _has(error: BaseException, names: set[str]) -> bool:
    return any(cls.__name__ in names for e in _chain(error) for cls in type(e).__mro__)


def _disk_full(error: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _chain(error))


def _silent_tqdm():
    """A progress-bar class that never shows (``progress=False``)."""
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


@contextlib.contextmanager
def _no_telemetry():
    """Keep huggingface_hub from fetching its agent registry from the default Hub while building
    the user agent: a download must talk to the chosen endpoint only."""
    from huggingface_hub import constants

    old = getattr(constants, "HF_HUB_DISABLE_TELEMETRY", None)
    constants.HF_HUB_DISABLE_TELEMETRY = True
    try:
        yield
    finally:
        if old is None:
            del constants.HF_HUB_DISABLE_TELEMETRY
        else:
            constants.HF_HUB_DISABLE_TELEMETRY = old


def _unknown(repo_id: str) -> str:
    """For a repo id the registry does not know (a typo such as Qwen/Qwen2.5-Omni-14B, or a fine-tune):
    the known ones, so the user can compare; '' for a known repo."""
    from .families import RECOMMENDED

    if repo_id in RECOMMENDED:
        return ""
    return f": {repo_id} is not one of the repos OmniDesk knows ({', '.join(RECOMMENDED)})"


def _describe(repo_id: str, error: BaseException, where: str, cache: Path) -> str:
    from huggingface_hub import errors as hf

    resume = (f" Files that finished are kept in {cache}; run `omnidesk models download {repo_id}` "
              f"again to resume.")
    if isinstance(error, KeyboardInterrupt):
        return f"download of {repo_id} was interrupted." + resume
    if _disk_full(error):
        from .families import RECOMMENDED

        need = RECOMMENDED.get(repo_id)
        size = f" (the model needs about {need.download_gb:g} GB)" if need else ""
        return (f"not enough disk space for {repo_id} in {cache}{size}. Free some space, or point "
                f"HF_HUB_CACHE at a larger disk, then run the download again to resume.")
    if isinstance(error, hf.GatedRepoError):
        return (f"{repo_id} on {where} is gated: accept its terms on the model page and log in "
                f"(`hf auth login`), then try again.")
    if isinstance(error, hf.RepositoryNotFoundError):
        return (f"repository {repo_id} was not found on {where}. Check the name{_unknown(repo_id)}; "
                f"private repos need a login (`hf auth login`).")
    if isinstance(error, hf.RevisionNotFoundError):
        return f"repository {repo_id} on {where} has no 'main' revision."
    if _has(error, {"OfflineModeIsEnabled"}):
        return f"cannot download {repo_id}: HF_HUB_OFFLINE is set. Unset it to allow downloads."
    if isinstance(error, hf.LocalEntryNotFoundError) or _has(error, _UNREACHABLE):
        return (f"cannot download {repo_id}: the endpoint {where} is unreachable (no network, "
                f"a firewall, or a wrong HF_ENDPOINT).{resume if cache.exists() else ''}"
                + (f" Also check the name{_unknown(repo_id)}." if _unknown(repo_id) else ""))
    detail = f"{type(error).__name__}: {error}".strip()
    return f"download of {repo_id} from {where} stopped ({detail}).{resume}"


def _supported() -> str:
    from .families import FAMILIES

    return ", ".join(f.title for f in FAMILIES)


def _refuse_unrunnable(repo_id: str, head: Path, where: str) -> None:
    """DownloadError when the repo's config.json (in ``head``, the snapshot so far) names a model no
    family runs, or one its family cannot run (a text-only -Thinking model).  A repo without one
    (Moshi's published repos) is judged once its files are there."""
    from .checkpoint import ConfigError, read_json
    from .families import detect_family

    if not (head / "config.json").is_file():
        return
    family = detect_family(head)
    if family is None:
        try:
            model_type = read_json(head / "config.json").get("model_type")
        except ConfigError:  # unreadable: the error names the file
            model_type = None
        raise DownloadError(f"{repo_id} on {where} is not a checkpoint OmniDesk can run (its config.json has "
                            f"model_type {model_type!r}; supported: {_supported()}); nothing else was downloaded.")
    why = family.unsupported(head)
    if why:
        raise DownloadError(f"{repo_id} is a {family.title} checkpoint OmniDesk cannot run: {why}. Nothing else "
                            f"was downloaded.")


def download(repo_id: str, cache_dir: Path | None = None, endpoint: str | None = None,
             progress: bool = True) -> Path:
    """Fetch ``repo_id`` into the HF cache (resumable) and return its snapshot directory.

    ``cache_dir`` defaults to the cache :func:`hf_hub_cache` reads (HF_HUB_CACHE / HF_HOME /
    ~/.cache/huggingface/hub); ``endpoint`` defaults to huggingface_hub's own (HF_ENDPOINT).
    Raises :class:`DownloadError` with a message naming the repo.
    """
    from huggingface_hub import constants, snapshot_download

    default_cache = cache_dir is None
    cache = Path(cache_dir if cache_dir is not None else hf_hub_cache()).expanduser()
    where = (endpoint or constants.ENDPOINT).rstrip("/")
    repo_cache = cache / ("models--" + repo_id.replace("/", "--"))
    kwargs = {} if progress else {"tqdm_class": _silent_tqdm()}
    if endpoint is not None:
        kwargs["endpoint"] = endpoint
    try:
        with _no_telemetry():
            # config.json first (a few KB): a repo OmniDesk cannot run is refused before its weights
            # (tens of GB) are fetched
            head = Path(snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=["config.json"], **kwargs))
            _refuse_unrunnable(repo_id, head, where)
            snapshot = Path(snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=ALLOW_PATTERNS,
                                              **kwargs))
    except DownloadError:
        raise
    except (Exception, KeyboardInterrupt) as e:
        raise DownloadError(_describe(repo_id, e, where, repo_cache)) from e

    from .families import detect_family

    if detect_family(snapshot) is None:  # Moshi's published repos have no config.json: ask the registry
        raise DownloadError(f"{repo_id} on {where} does not look like a checkpoint OmniDesk can run "
                            f"(no family recognises the files in {snapshot}; supported: {_supported()}).")
    if default_cache or cache.resolve() == hf_hub_cache().resolve():
        try:
            found = resolve_checkpoint(repo_id)
        except CheckpointError as e:
            raise DownloadError(f"{repo_id} was downloaded to {snapshot} but cannot be found again: {e}") from e
        if found.resolve() != snapshot.resolve():
            raise DownloadError(f"{repo_id} was downloaded to {snapshot}, but `{repo_id}` resolves to "
                                f"{found}; check HF_HUB_CACHE / HF_HOME.")
    return snapshot


__all__ = ["ALLOW_PATTERNS", "DownloadError", "download"]
